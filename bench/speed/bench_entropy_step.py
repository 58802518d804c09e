"""What a logged entropy costs the update: the training phase with the entropy only logged (computed in the
kernel's pass without a gradient, the frozen-lm_head backward kept) against the same run differentiating it
(what every update did before the algorithm record said whether its loss uses entropy).

    python bench/speed/bench_entropy_step.py [--recipe recipes/grpo_tiny.yaml] [--steps 6] [--rounds 2] [--set k=v ...]

Runs the recipe ``rounds`` times each way in this process, alternating which goes first (so load on the machine
and the process's own warm-up fall on both),
and prints the mean ``perf/train_s`` and ``perf/step_s`` over steps 2.. (step 1 carries the warm-up) with the
ratio. The differentiated entropy is forced by making ``Algorithm.entropy_in_loss`` answer True.
Then the kernel alone (``parity.fused_logprobs``, bf16, frozen lm_head, forward + backward of a weighted sum, the
minimum of 5 calls) at the tiny model's lm_head shape and at SmolLM2-135M's, where the lm_head is a real share.
"""
import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch
from bench_step import run

from parity.logprobs import fused_logprobs
from trainer.algorithms.record import Algorithm

# (tokens, hidden, vocabulary): builtin:tiny's lm_head, SmolLM2-135M's
KERNEL_SHAPES = ((1024, 128, 512), (1024, 576, 49152))


def kernel_seconds(n: int, h: int, v: int, entropy_grad: bool, reps: int = 5) -> float:
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=g) * 0.5).bfloat16().requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.05).bfloat16()
    targets, upstream = torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g)
    times = []
    for _ in range(reps + 1):  # the first call warms up
        hidden.grad = None
        t = time.perf_counter()
        lp, _ = fused_logprobs(hidden, weight, targets, return_entropy=True, entropy_grad=entropy_grad)
        (lp * upstream).sum().backward()
        times.append(time.perf_counter() - t)
    return min(times[1:])

KEYS = ("perf/train_s", "perf/step_s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/grpo_tiny.yaml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    samples: dict[str, dict[str, list[float]]] = {w: {k: [] for k in KEYS} for w in ("logged", "differentiated")}
    for r in range(args.rounds):
        ways = ("logged", "differentiated") if r % 2 == 0 else ("differentiated", "logged")  # neither always first
        for way in ways:
            forced = mock.patch.object(Algorithm, "entropy_in_loss", return_value=True)
            with forced if way == "differentiated" else contextlib.nullcontext():
                history = run(args.recipe, "vllm", args.steps, args.overrides)
            for k in KEYS:
                samples[way][k] += [row[k] for row in history[1:]]
            print(f"round {r + 1}, entropy {way}: perf/train_s mean "
                  f"{statistics.mean(row['perf/train_s'] for row in history[1:]):.3f} s", flush=True)
    print(f"\n{args.recipe}: mean over steps 2..{args.steps}, {args.rounds} run(s) each way, alternating")
    for k in KEYS:
        logged, diff = statistics.mean(samples["logged"][k]), statistics.mean(samples["differentiated"][k])
        print(f"{k:<14} entropy logged {logged:7.3f} s   differentiated {diff:7.3f} s   logged/differentiated "
              f"{logged / diff:.2f}x")
    print("\nthe kernel alone (bf16, frozen lm_head, forward + backward, min of 5)")
    for n, h, v in KERNEL_SHAPES:
        logged, diff = kernel_seconds(n, h, v, False), kernel_seconds(n, h, v, True)
        print(f"N={n} H={h} V={v}: entropy logged {logged * 1e3:8.1f} ms   differentiated {diff * 1e3:8.1f} ms   "
              f"logged/differentiated {logged / diff:.2f}x")


if __name__ == "__main__":
    main()
