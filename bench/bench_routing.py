"""Rollout routing replay on random mixture-of-experts models: parity with and without it, and its cost.

    python bench/bench_routing.py [--steps 3] [--families qwen2_moe,qwen3_moe,mixtral,olmoe] [--dense qwen3,mistral]

Every run is ``parityrl train recipes/grpo_tiny.yaml`` (GRPO, bf16, vLLM colocated, LoRA) on a random model of
the architecture zoo (``trainer.builtin.zoo``: 2 layers, weights at std 0.2, so routers have near-ties), for
``--steps`` steps, in its own process, evaluation off. Per MoE family three runs, same seed:

* ``off``: no routes asked of the engine (prefix caching on): the baseline of the step time;
* ``measure``: the engine's routes captured and compared with the trainer's own choice, not replayed;
* ``on``: replayed (``parity.routing_replay: on``).

Printed per run, over its steps: parity/mae, parity/kl_k3 (means), the worst token |d| (parity/max_abs, max),
the routing agreement and the share of tokens that differ in at least one layer, and the median step time of
the steps after the first (the first also scores the batch without replay: ``parity/unreplayed/*``). Then, per
family, the ratios the issue's goal names: kl_k3 on / measure (goal <= 0.3) and step time on / off (goal
<= 1.05), and the dense models' worst token |d| for scale.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.builtin.zoo import ensure_arch_model  # noqa: E402


def run(model_dir: Path, mode: str, steps: int, out: Path) -> dict:
    run_dir = out / f"{model_dir.name}-{mode}"
    cmd = [sys.executable, "-m", "trainer.train", str(ROOT / "recipes/grpo_tiny.yaml"),
           "--set", f"model.path={model_dir}", "--set", f"train.steps={steps}", "--set", "eval.every=0",
           "--set", f"logging.run_dir={run_dir}", "--set", "logging.wandb.mode=disabled",
           "--set", f"parity.routing_replay={mode}", "--set", "checkpoint.every=0"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r.get("step", 0) >= 1 and "parity/mae" in r]

    def mean(key):
        vals = [r[key] for r in rows if key in r]
        return statistics.fmean(vals) if vals else float("nan")

    return {"mae": mean("parity/mae"), "kl_k3": mean("parity/kl_k3"),
            "worst": max(r["parity/max_abs"] for r in rows),
            "agree": mean("parity/routing_agree"), "any_diff": mean("parity/routing_tokens_any_diff"),
            "step_s": statistics.median(r["perf/step_s"] for r in rows[1:]) if len(rows) > 1 else rows[0]["perf/step_s"],
            "unreplayed_kl_k3": mean("parity/unreplayed/kl_k3"), "kl_k3_first": rows[0]["parity/kl_k3"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--families", default="qwen2_moe,qwen3_moe,mixtral,olmoe")
    ap.add_argument("--dense", default="qwen3,mistral")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench_routing-"))
    print(f"{'model':<11} {'mode':<8} {'mae':>9} {'kl_k3':>9} {'worst|d|':>9} {'agree':>7} {'any_diff':>9} "
          f"{'step s':>7}")
    results = {}
    for arch in [a for a in args.dense.split(",") if a]:
        r = run(ensure_arch_model(arch, dtype="bfloat16"), "off", args.steps, out)
        results[(arch, "off")] = r
        print(f"{arch:<11} {'dense':<8} {r['mae']:>9.2e} {r['kl_k3']:>9.2e} {r['worst']:>9.3f} {'-':>7} {'-':>9} "
              f"{r['step_s']:>7.2f}", flush=True)
    for arch in [a for a in args.families.split(",") if a]:
        model_dir = ensure_arch_model(arch, dtype="bfloat16")
        for mode in ("off", "measure", "on"):
            r = results[(arch, mode)] = run(model_dir, mode, args.steps, out)
            print(f"{arch:<11} {mode:<8} {r['mae']:>9.2e} {r['kl_k3']:>9.2e} {r['worst']:>9.3f} "
                  f"{r['agree']:>7.4f} {r['any_diff']:>9.4f} {r['step_s']:>7.2f}", flush=True)
    print("\nratios (goal: kl_k3 on/measure <= 0.3, step time on/off <= 1.05)")
    for arch in [a for a in args.families.split(",") if a]:
        on, measure, off = results[(arch, "on")], results[(arch, "measure")], results[(arch, "off")]
        print(f"{arch:<11} kl_k3 on/measure {on['kl_k3'] / measure['kl_k3']:.2f}   "
              f"(step 1's batch: replayed {on['kl_k3_first']:.2e}, unreplayed {on['unreplayed_kl_k3']:.2e})   "
              f"step time on/off {on['step_s'] / off['step_s']:.2f}")
    print(f"(runs in {out})")


if __name__ == "__main__":
    main()
