"""Benchmark: a BF16 model's forward + backward on the CPU, with ATen's own products against the backward's products
in float32 (trainer/precision/float32_backward_gemms.py), and the float32 model as the floor.

    PYTHONPATH=. .venv/bin/python bench/speed/bench_cpu_half_backward.py                 # builtin:tiny, 32 x 48 tokens
    PYTHONPATH=. .venv/bin/python bench/speed/bench_cpu_half_backward.py --model DIR --threads 1

Prints, per variant, the median of ``--reps`` forward + backward passes (wall seconds) and its ratio to ATen's BF16
products, and the largest gradient difference between the two BF16 variants relative to each tensor's largest
element (one BF16 rounding step: 7.8e-3). On a CPU where oneDNN has a BF16 GEMM (AVX-512, AMX) the run never takes
the float32 products (``needs_float32_backward_gemms`` is false there); the figures then show what they would cost.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from trainer.builtin.resolve import resolve_model_path
from trainer.precision.float32_backward_gemms import Float32BackwardGemms, needs_float32_backward_gemms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    ids = torch.randint(0, 256, (args.rows, args.tokens), generator=torch.Generator().manual_seed(0))

    def run(dtype, float32_gemms: bool):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        times, grads = [], None
        for _ in range(args.reps + 1):  # the first pass warms up
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = model(input_ids=ids).logits.float().log_softmax(-1)[..., 1].mean()
            if float32_gemms:
                with Float32BackwardGemms():
                    loss.backward()
            else:
                loss.backward()
            times.append(time.perf_counter() - t0)
            grads = [p.grad.float().clone() for p in model.parameters()]
        return statistics.median(times[1:]), grads

    aten_s, aten_g = run(torch.bfloat16, False)
    f32g_s, f32g_g = run(torch.bfloat16, True)
    fp32_s, _ = run(torch.float32, False)
    diff = max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, b in zip(aten_g, f32g_g))
    print(f"model {args.model}, {args.rows} x {args.tokens} tokens, threads {torch.get_num_threads()}, "
          f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"oneDNN BF16 GEMM {'yes' if torch.ops.mkldnn._is_mkldnn_bf16_supported() else 'no'}; "
          f"a BF16 run takes float32 backward products here: {needs_float32_backward_gemms('bfloat16', 'cpu')}")
    print(f"{'variant':<34}{'s / pass':>10}{'x ATen BF16':>13}")
    for name, s in (("BF16, ATen's products", aten_s), ("BF16, backward products in float32", f32g_s),
                    ("float32 model", fp32_s)):
        print(f"{name:<34}{s:>10.3f}{s / aten_s:>13.3f}")
    print(f"largest gradient difference, the two BF16 variants: {diff:.2e} of each tensor's largest element")


if __name__ == "__main__":
    main()
