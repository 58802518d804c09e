"""Truncated sampling measured right: parity with top-p / top-k against the same runs untruncated, and against the
trainer normalising over the whole vocabulary (the bias the engine's kept sets remove).

    python bench/parity/bench_truncation.py [--steps 5] [--top-p 0.9] [--top-k 20] [--runs tiny-bf16,tiny-fp32,smollm2-fp32]

Each run is GRPO for ``--steps`` steps (its own colocated vLLM engine) three times: untruncated, truncated with the
trainer normalising over the engine's kept sets (what a run does), and truncated with the kept sets ignored
(``TokenBatch.kernel_support`` patched to None here: the test-only switch). Printed: mean ``parity/mae``,
``parity/kl_k3`` and ``parity/max_abs`` over the steps, and ``sampling/kept_mass`` / ``kept_tokens``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

RUNS = {
    "tiny-bf16": ("recipes/grpo_tiny.yaml", ["model.dtype=bfloat16"]),
    "tiny-fp32": ("recipes/grpo_tiny.yaml", ["model.dtype=float32"]),
    "smollm2-fp32": ("recipes/grpo_smollm2_cpu.yaml", ["model.dtype=float32", "rollout.prompts_per_step=2"]),
}


def run(recipe: str, sets: list[str], *, ignore_sets: bool = False) -> list[dict]:
    from trainer.lifecycle.preflight import load_recipe
    from trainer.models.batch import TokenBatch
    from trainer.rl.loop import train

    saved = TokenBatch.kernel_support
    if ignore_sets:
        TokenBatch.kernel_support = lambda self: None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_recipe(recipe, [f"logging.run_dir={tmp}/run", "eval.every=0", "logging.wandb.mode=disabled",
                                       "checkpoint.every=0", "logging.samples_every=0", *sets])
            return train(cfg).history
    finally:
        TokenBatch.kernel_support = saved


def mean(h: list[dict], key: str) -> float:
    vals = [r[key] for r in h if key in r]
    return statistics.mean(vals) if vals else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--runs", default=",".join(RUNS))
    args = p.parse_args()
    trunc = [f"rollout.top_p={args.top_p}", f"rollout.top_k={args.top_k}"]
    print(f"{'run':<14}{'sampling':<26}{'parity/mae':>12}{'kl_k3':>11}{'max |d|':>10}{'kept_mass':>11}"
          f"{'kept_tokens':>13}")
    for name in args.runs.split(","):
        recipe, sets = RUNS[name]
        sets = [f"train.steps={args.steps}", *sets]
        for label, extra, ignore in (("untruncated", [], False), (f"top-p {args.top_p} top-k {args.top_k}", trunc, False),
                                     ("  ... kept sets ignored", trunc, True)):
            h = run(recipe, sets + extra, ignore_sets=ignore)
            print(f"{name:<14}{label:<26}{mean(h, 'parity/mae'):>12.3e}{mean(h, 'parity/kl_k3'):>11.2e}"
                  f"{mean(h, 'parity/max_abs'):>10.3f}{mean(h, 'sampling/kept_mass'):>11.3f}"
                  f"{mean(h, 'sampling/kept_tokens'):>13.2f}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
