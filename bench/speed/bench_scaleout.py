"""Step time of one recipe under each launch setup: 1 process, data parallel, ZeRO-2, ZeRO-3 (2 processes).

    python bench/speed/bench_scaleout.py [--recipe recipes/grpo_tiny.yaml] [--steps 6] [--setups one,dp,zero2,zero3]

(PARITYRL_CACHE, HF_HUB_OFFLINE=1 as for the tests.) Each setup is a fresh launch of
``trainer.train`` on the same recipe (``--set train.steps=N``, no checkpoints but the
last, wandb off) into a temporary run directory; the script reads each run's
``metrics.jsonl`` and prints, per setup, the means over steps 2..N (step 1 pays the
engines' warm-up) of the step and its phases, the ratio of the step time to the
one-process run of the same invocation, and the rewards of every step (setups that
sample the same prompts with the same seeds and start from the same weights get the
same step-1 reward; later steps may differ by a sample when bf16 updates differ in the
last bit). DeepSpeed runs use torchrun with the environment ``accelerate launch
--config_file recipes/accelerate/zero{2,3}.yaml`` sets (the form the tests use too).
Timings are wall-clock on whatever else the machine runs: run it on an idle machine.
Prints one ``SCALEOUT {json}`` line at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PHASES = ("perf/step_s", "perf/rollout_s", "perf/train_s", "perf/sync_s", "perf/probe_s")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def command(setup: str) -> tuple[list[str], dict]:
    """(launcher prefix, extra environment) of a setup."""
    if setup == "one":
        return [sys.executable], {}
    if setup == "dp":
        return TORCHRUN, {}
    if setup in ("zero2", "zero3"):
        return TORCHRUN, {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO3_INIT": "false",
                          "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(REPO / f"recipes/accelerate/{setup}.json")}
    raise SystemExit(f"--setups: unknown setup {setup!r}; expected one, dp, zero2, zero3")


def run(setup: str, recipe: str, steps: int, root: Path) -> dict:
    prefix, extra_env = command(setup)
    run_dir = root / setup
    sets = [f"train.steps={steps}", "checkpoint.every=0", "logging.wandb.mode=disabled",
            f"logging.run_dir={run_dir}", f"name=bench_{setup}"]
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           **extra_env}
    cmd = [*prefix, "-m", "trainer.train", recipe, *[x for s in sets for x in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{setup}: exit {proc.returncode}\n{' '.join(cmd)}\n{proc.stderr[-3000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_rows = [r for r in rows if r["step"] >= 2]
    out = {k: sum(r.get(k, 0.0) for r in steps_rows) / len(steps_rows) for k in PHASES}
    out["rewards"] = [round(r["reward/mean"], 4) for r in rows if r["step"] >= 1]
    out["sync_bytes"] = rows[-1].get("perf/sync_bytes")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default=str(REPO / "recipes" / "grpo_tiny.yaml"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--setups", default="one,dp,zero2,zero3")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (step 1 is excluded from the means)")
    setups = args.setups.split(",")
    for s in setups:
        command(s)  # refuse unknown names before the first launch
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_scaleout_") as tmp:
        for s in setups:
            results[s] = run(s, args.recipe, args.steps, Path(tmp))
            print(f"{s}: done", flush=True)
    base = results.get("one", {}).get("perf/step_s")
    print(f"\nmeans of steps 2..{args.steps} (s); ratio = step time / one process's")
    print(f"{'setup':8} {'step':>7} {'ratio':>6} {'rollout':>8} {'train':>7} {'sync':>7} {'probe':>7}  rewards")
    for s, r in results.items():
        ratio = f"{r['perf/step_s'] / base:.2f}" if base else "-"
        print(f"{s:8} {r['perf/step_s']:7.3f} {ratio:>6} {r['perf/rollout_s']:8.3f} {r['perf/train_s']:7.3f} "
              f"{r['perf/sync_s']:7.3f} {r['perf/probe_s']:7.3f}  {r['rewards']}")
    print("SCALEOUT " + json.dumps({"recipe": args.recipe, "steps": args.steps, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
