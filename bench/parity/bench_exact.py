"""Exact mode against the default recipe, side by side in one invocation: step time per phase, parity, reward.

    PYTHONPATH=. python bench/parity/bench_exact.py --steps 30                                   # the built-in demo
    PYTHONPATH=. python bench/parity/bench_exact.py --recipe recipes/grpo_smollm2_cpu.yaml --steps 4 \\
        --set model.dtype=float32 --set rollout.max_new_tokens=32

Each precision recipe trains in a process of its own (its own engine) with the same recipe and
seed; the loop's own ``perf/*`` metrics are averaged over steps 2..N (step 1 carries warm-up)
and the ratio exact / baseline is printed per phase, then the per-step reward of both runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ["perf/rollout_s", "perf/train_s", "perf/sync_s", "perf/probe_s", "perf/step_s", "perf/rollout_tokens_per_s"]


def run(recipe: str, precision: str, steps: int, overrides: list[str], work: Path) -> list[dict]:
    run_dir = work / precision
    sets = [f"precision.recipe={precision}", f"train.steps={steps}", f"logging.run_dir={run_dir}",
            "logging.wandb.mode=disabled", "checkpoint.every=0", f"name=bench-{precision}", *overrides]
    cmd = [sys.executable, "-m", "trainer.cli", "train", recipe] + [a for s in sets for a in ("--set", s)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "perf/step_s" in r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/grpo_tiny.yaml")
    p.add_argument("--baseline", default="bf16", help="the precision recipe exact mode is compared with")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hist = {rec: run(args.recipe, rec, args.steps, args.overrides, Path(tmp)) for rec in (args.baseline, "exact")}
    mean = {rec: {k: statistics.mean(r.get(k, 0.0) for r in h[1:]) for k in PHASES} for rec, h in hist.items()}
    b, e = mean[args.baseline], mean["exact"]
    print(f"{args.recipe} {' '.join(args.overrides)}: mean over steps 2..{args.steps}")
    print(f"{'phase':<28}{args.baseline:>12}{'exact':>12}{'exact/' + args.baseline:>14}")
    for k in PHASES:
        print(f"{k:<28}{b[k]:>12.3f}{e[k]:>12.3f}{e[k] / b[k] if b[k] else float('nan'):>14.2f}")
    for rec, h in hist.items():
        maes = [r["parity/mae"] for r in h if "parity/mae" in r]
        print(f"{rec:<8} parity/mae mean {statistics.mean(maes):.3e} max {max(maes):.3e}  "
              f"max_abs max {max(r['parity/max_abs'] for r in h):.3e}")
    print("reward per step")
    for rec, h in hist.items():
        print(f"{rec:<8} " + " ".join(f"{r['reward/mean']:.2f}" for r in h))
        print(f"{'':<8} first 5 mean {statistics.mean(r['reward/mean'] for r in h[:5]):.3f}  "
              f"last 5 mean {statistics.mean(r['reward/mean'] for r in h[-5:]):.3f}")


if __name__ == "__main__":
    main()
