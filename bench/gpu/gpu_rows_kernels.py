"""Rows of bench/gpu/gpu_check.py on the project's GPU kernels: the fused log-prob kernel and the FP8 GEMM.

- ``kernel_accuracy`` (CPU too): ``parity.fused_logprobs`` (and the Triton backend on CUDA) against a float64
  reference on a small bf16 shape: log-probs and the hidden-state gradient, within ``KERNEL_LP_ABS`` /
  ``KERNEL_GRAD_REL`` or twice the full-logits implementation's own error;
- ``kernel_speed`` (CUDA): ``bench/speed/bench_logprobs.py``'s CUDA measurement at N = 16384 tokens, Qwen2.5-7B's H and V,
  LoRA mode (gradient for the hidden states), naive vs ours, every variant checked against float64;
- ``fp8_verify`` / ``fp8_speed`` (CUDA SM 9.x): ``parity.fp8_gemm.verify_scaled_mm``, then ``bench/speed/bench_fp8.py``'s
  LoRA linear (Qwen2.5-7B's 3584 x 18944, 8192 tokens), BF16 vs FP8 forward + backward.
"""
from __future__ import annotations

import sys

import torch
from gpu_rows_common import BENCH, Skip, need_cuda

# bench_logprobs and bench_fp8 (imported by the rows that need them) are the speed benchmarks of bench/speed/
if str(BENCH.parent / "speed") not in sys.path:
    sys.path.insert(0, str(BENCH.parent / "speed"))

# Accuracy limits of the kernel rows (bf16 inputs, float64 reference of the same inputs): issue 25's
# goal for the hidden-state gradient; for the log-probs, the rounding of bf16 logits (half an ulp at
# 4 <= |z| < 8 is 2^-6 = 0.016; the small shape's logits are ~N(0, 1)): what a bf16 lm_head output
# costs in any implementation, while a wrong normaliser or gather is off by O(1).
KERNEL_GRAD_REL = 3e-3
KERNEL_LP_ABS = 2e-2


# The implementations this project ships: their accuracy is asserted. Third-party kernels (Liger-Kernel,
# cut-cross-entropy) are timed and their errors printed, never asserted: a check of ours must not fail on another
# project's bug (an older Liger's reduction="none" gradient was wrong, linkedin/Liger-Kernel#1298).
OURS = ("torch", "triton")


def kernel_accuracy() -> str:
    """Ours (and Triton on CUDA) vs float64 on N=256, H=128, V=4096 bf16, every row: log-probs and grad_hidden with
    a frozen lm_head, grad_hidden and grad_weight (sampled vocabulary rows) with a trained one."""
    import bench_logprobs as bl

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n, h, v = 256, 128, 4096
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device, torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) * h**-0.5).to(device, torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    a, b = torch.randn(n, generator=g).to(device), torch.zeros(n, device=device)
    sampled = torch.randperm(v, generator=g)[:256].to(device)
    ref_lp, ref_gh, ref_gw = bl.reference_float64(hidden, weight, targets, a, sampled)
    variants = bl._cuda_variants()
    names = ["naive", "torch"] + (["triton"] if device.type == "cuda" and "triton" in variants else [])
    out, bad, errs = [], [], {}
    for name in names:
        lp, _ = bl._cuda_once(variants[name], "frozen", hidden, weight, targets, a, b)
        lp_err, gh_rel = (lp.double() - ref_lp).abs().max().item(), bl._rel(hidden.grad, ref_gh)
        bl._cuda_once(variants[name], "full", hidden, weight, targets, a, b)
        full_gh, gw_rel = bl._rel(hidden.grad, ref_gh), bl._rel(weight.grad[sampled], ref_gw)
        errs[name] = (lp_err, max(gh_rel, full_gh), gw_rel)
        out.append(f"{name}: lp {lp_err:.1e}, grad_h rel {max(gh_rel, full_gh):.1e}, grad_w rel {gw_rel:.1e}")
        # within the absolute limits, or no worse than twice the full-logits implementation's error in the
        # same dtype (bf16's own); a wrong normaliser or gather is off by O(1) either way
        limits = [max(2 * e, lim) for e, lim in zip(errs["naive"], (KERNEL_LP_ABS, KERNEL_GRAD_REL, KERNEL_GRAD_REL))]
        if name in OURS and any(e > lim for e, lim in zip(errs[name], limits)):
            bad.append(name)
    figure = f"{device.type} bf16 N={n} H={h} V={v}: " + "; ".join(out)
    if bad:
        raise AssertionError(f"{figure} (limits: lp {KERNEL_LP_ABS}, gradients rel {KERNEL_GRAD_REL})")
    return figure


def kernel_speed() -> str:
    """bench_logprobs' CUDA measurement, LoRA mode ('frozen'), at one token count; every row checked against float64."""
    need_cuda()
    import bench_logprobs as bl

    n, h, v = 16384, bl.CUDA_H, bl.CUDA_V
    dev = torch.device(bl.CUDA_DEVICE)
    torch.manual_seed(0)
    hidden = torch.randn(n, h, device=dev, dtype=torch.bfloat16)
    weight = torch.randn(v, h, device=dev, dtype=torch.bfloat16) * h**-0.5
    targets = torch.randint(0, v, (n,), device=dev)
    a, b = torch.randn(n, device=dev), 0.01 * torch.randn(n, device=dev)
    _, ref_gh, _ = bl.reference_float64(hidden, weight, targets, a, torch.arange(1, device=dev))
    cells, bad = [], []
    for name, fn in bl._cuda_variants().items():
        r = bl._cuda_measure(fn, "frozen", (hidden, weight, targets, a, b), reps=5)
        if r is None:
            continue
        if r["oom"]:
            cells.append(f"{name} OOM")
            continue
        gh_rel = bl._rel(r["grad_h"], ref_gh)
        cells.append(f"{name} {r['time'] * 1e3:.0f} ms {r['peak'] / 2**30:.1f} GiB grad_h rel {gh_rel:.1e}")
        if name in OURS and gh_rel > KERNEL_GRAD_REL:
            bad.append(f"{name} grad_h rel {gh_rel:.1e}")
    figure = f"N={n} H={h} V={v} fwd+bwd: " + ", ".join(cells)
    if bad:
        raise AssertionError(f"{figure}; over the limit {KERNEL_GRAD_REL}: {', '.join(bad)}")
    return figure


# ---------------------------------------------------------------- FP8


def _need_fp8() -> None:
    from parity.fp8_gemm import scaled_mm_supported

    need_cuda()
    if not scaled_mm_supported("cuda"):
        cap = ".".join(map(str, torch.cuda.get_device_capability()))
        raise Skip(f"needs SM 9.x and torch's block-scaled FP8 GEMM (torch.nn.functional.scaled_mm); here SM {cap}")


def fp8_verify() -> str:
    from parity.fp8_gemm import verify_scaled_mm

    _need_fp8()
    return f"relative error vs the emulation {verify_scaled_mm('cuda'):.2e}"  # raises when it disagrees


def fp8_speed() -> str:
    _need_fp8()
    import bench_fp8

    m, k, n = 8192, 3584, 18944
    r = bench_fp8.bench_linear(m, k, n, "cuda", "scaled_mm", iters=20)
    return (f"LoRA linear M={m} K={k} N={n} fwd+bwd: BF16 {r['bf16_fwdbwd']:.2f} ms, FP8 {r['fp8_fwdbwd']:.2f} ms "
            f"({r['bf16_fwdbwd'] / r['fp8_fwdbwd']:.2f}x)")
