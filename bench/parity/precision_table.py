"""The precision-recipe comparison: every recipe `parityrl compare` takes (``trainer.precision.compare_choices``),
measured by parity and by reward.

    python bench/parity/precision_table.py                     # everything (~15 min on 2 idle CPU cores)
    python bench/parity/precision_table.py --skip-train        # parity only
    python bench/parity/precision_table.py --out bench/parity/precision_table.md

For each recipe, in its own process (each needs its own vLLM engine):
1. ``parityrl compare`` on the same prompts and the same weights: the built-in tiny
   model (hidden 128) and a wider random model (hidden 512, 4 layers, built by
   ``trainer.builtin.tiny`` -- where quantisation error is not swamped by tininess). Reported:
   parity MAE, kl_k3, frac_rho_outside_0.9_1.1 (``parity.metrics``).
2. ``parityrl train recipes/grpo_tiny.yaml`` for ``--steps`` steps: the reward at the end
   (mean of the last 5 steps) and the run's mean parity MAE.

Prints a markdown table (the one in bench/RESULTS.md) and writes it to ``--out`` with the raw JSON next to it.
Nothing is timed: the columns are numerics, so the machine's load does not matter.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from trainer.precision import compare_choices, recipe_for

REPO = Path(__file__).resolve().parents[2]
RECIPES = tuple(compare_choices())
WIDE = {"hidden_size": 512, "intermediate_size": 1536, "num_heads": 4, "num_kv_heads": 2, "num_layers": 4}


def dtype_of(recipe: str) -> str:
    """The model dtype the recipe runs in first (its record's ``dtypes``)."""
    return recipe_for(recipe).dtypes[0]


def write_prompts(path: Path, n: int) -> Path:
    from trainer.data.datasets import load_prompt_dataset

    ds = load_prompt_dataset("builtin:arithmetic", split="test", num_examples=n, seed=0)
    path.write_text("".join(json.dumps({"prompt": ds[i]["prompt"]}) + "\n" for i in range(len(ds))))
    return path


def run(cmd: list[str], log: Path) -> None:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed with status {proc.returncode}; see {log}")


def compare_parity(model: str, prompts: Path, recipe: str, work: Path, args) -> dict:
    out = work / f"compare_{Path(model).name}_{recipe}"
    run([sys.executable, "-m", "trainer.cli", "compare", model, str(prompts), "--out", str(out), "--overwrite",
         "--precision", recipe, "--dtype", dtype_of(recipe), "-n", str(args.n), "--max-new-tokens",
         str(args.new_tokens), "--temperature", str(args.temperature), "--seed", "0"], out.with_suffix(".log"))
    m = json.loads((out / "summary.json").read_text())["metrics"]
    return {k: m[f"parity/{k}"] for k in ("mae", "kl_k3", "frac_rho_outside_0.9_1.1", "num_tokens")}


def train_reward(recipe: str, work: Path, args) -> dict:
    run_dir = work / f"train_{recipe}"
    sets = [f"precision.recipe={recipe}", f"model.dtype={dtype_of(recipe)}", f"train.steps={args.steps}",
            f"logging.run_dir={run_dir}", f"name=precision_{recipe}", "logging.wandb.mode=disabled",
            "checkpoint.every=0", "logging.print_every=10"]
    run([sys.executable, "-m", "trainer.cli", "train", "recipes/grpo_tiny.yaml",
         *[x for s in sets for x in ("--set", s)]], work / f"train_{recipe}.log")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] >= 1]
    last = steps[-5:]
    return {"reward_first5": sum(r["reward/mean"] for r in steps[:5]) / 5,
            "reward_last5": sum(r["reward/mean"] for r in last) / len(last),
            "train_parity_mae": sum(r["parity/mae"] for r in steps) / len(steps)}


def table(results: dict, args) -> str:
    lines = [
        f"| recipe | tiny (h=128): mae | kl_k3 | frac ρ∉[0.9,1.1] | wide (h=512): mae | kl_k3 | frac ρ∉[0.9,1.1] "
        f"| reward after {args.steps} steps (first 5 → last 5) | mean train-step mae |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in RECIPES:
        t, w, tr = results[r].get("tiny", {}), results[r].get("wide", {}), results[r].get("train", {})
        f = lambda d, k, fmt: format(d[k], fmt) if k in d else "–"  # noqa: E731
        reward = (f"{tr['reward_first5']:.3f} → {tr['reward_last5']:.3f}" if tr else "–")
        lines.append(f"| `{r}` | {f(t, 'mae', '.2e')} | {f(t, 'kl_k3', '.1e')} | {f(t, 'frac_rho_outside_0.9_1.1', '.4f')} "
                     f"| {f(w, 'mae', '.2e')} | {f(w, 'kl_k3', '.1e')} | {f(w, 'frac_rho_outside_0.9_1.1', '.4f')} "
                     f"| {reward} | {f(tr, 'train_parity_mae', '.2e')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("-n", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=40, help="training budget per recipe (grpo_tiny)")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--out", default=None, help="write the markdown table here (and the JSON next to it)")
    args = p.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from trainer.builtin.tiny import ensure_tiny_base

    work = Path(tempfile.mkdtemp(prefix="parityrl_precision_"))
    prompts = write_prompts(work / "prompts.jsonl", args.prompts)
    wide = str(ensure_tiny_base(**WIDE))
    results: dict = {r: {} for r in RECIPES}
    for r in args.recipes:
        results[r]["tiny"] = compare_parity("builtin:tiny", prompts, r, work, args)
        results[r]["wide"] = compare_parity(wide, prompts, r, work, args)
        if not args.skip_train:
            results[r]["train"] = train_reward(r, work, args)
        print(r, json.dumps(results[r]), flush=True)
    md = table(results, args)
    print("\n" + md)
    if args.out:
        Path(args.out).write_text(md + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps({"settings": vars(args), "results": results}, indent=2))
    print(f"\nlogs and reports: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
