"""What a logged entropy costs the update: the training phase with the entropy only logged (computed in the
kernel's pass without a gradient, the frozen-lm_head backward kept) against the same run differentiating it
(what every update did before the algorithm record said whether its loss uses entropy).

    python bench/bench_entropy_step.py [--recipe recipes/grpo_tiny.yaml] [--steps 6] [--rounds 2] [--set k=v ...]

Runs the recipe ``rounds`` times each way in this process, alternating (so load on the machine falls on both),
and prints the mean ``perf/train_s`` and ``perf/step_s`` over steps 2.. (step 1 carries the warm-up) with the
ratio. The differentiated entropy is forced by making ``Algorithm.entropy_in_loss`` answer True.
"""
import argparse
import contextlib
import statistics
from unittest import mock

from bench_step import run

from trainer.algorithms.record import Algorithm

KEYS = ("perf/train_s", "perf/step_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/grpo_tiny.yaml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    samples: dict[str, dict[str, list[float]]] = {w: {k: [] for k in KEYS} for w in ("logged", "differentiated")}
    for _ in range(args.rounds):
        for way in ("logged", "differentiated"):
            forced = mock.patch.object(Algorithm, "entropy_in_loss", return_value=True)
            with forced if way == "differentiated" else contextlib.nullcontext():
                history = run(args.recipe, "vllm", args.steps, args.overrides)
            for k in KEYS:
                samples[way][k] += [row[k] for row in history[1:]]
    print(f"\n{args.recipe}: mean over steps 2..{args.steps}, {args.rounds} run(s) each way, alternating")
    for k in KEYS:
        logged, diff = statistics.mean(samples["logged"][k]), statistics.mean(samples["differentiated"][k])
        print(f"{k:<14} entropy logged {logged:7.3f} s   differentiated {diff:7.3f} s   logged/differentiated "
              f"{logged / diff:.2f}x")


if __name__ == "__main__":
    main()
