"""The backward pass's matrix products in float32 on a CPU that has no BF16 / FP16 GEMM of its own.

PyTorch runs a BF16 (or FP16) matrix product on the CPU through oneDNN where the CPU supports it (AVX-512 or AMX:
``torch.ops.mkldnn._is_mkldnn_bf16_supported()``); elsewhere -- an AVX2-only x86, e.g. AMD EPYC before Zen 4 -- it
falls back to ATen's reference loops (``aten/src/ATen/native/cpu/BlasKernel.cpp``), whose speed depends on the
operands' layout: the backward's ``grad_out @ W`` is the slow one. Measured on CPU (2-core AVX2-only AMD EPYC, torch
2.13, one thread, ``bench/speed/bench_cpu_half_backward.py --threads 1``): the built-in tiny model's forward + backward
on 32 x 48 tokens takes 12.4 s with ATen's BF16 products, 0.83 s with this module, 0.22 s as a float32 model.

What this changes: during ``backward`` only, every ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` whose operands include
such a half-precision CPU tensor is computed on float32 copies of them and its result rounded back to that dtype.
The reference loops accumulate in float32 too (``opmath_type``), so the gradient is the same quantity with another
summation order: measured (same command), the tiny model's gradients agree with the reference loops' to 7.0e-3 of
each tensor's largest element, one BF16 rounding step (7.8e-3). The forward is untouched -- its log-probs stay bit-for-bit the
ones the engine's own BF16 kernels are compared with (vLLM's CPU backend runs the same ATen products for its
linear layers where oneDNN has no BF16 kernel). With ``train.gradient_checkpointing`` the recomputed forward runs
inside the backward, so its products are float32 ones rounded: activations within one rounding of the first
forward's, which only the gradient sees.

Not applied on a CUDA device, in float32, or where oneDNN has the dtype's GEMM (a faster path exists there; and the
run's numerics stay those of the kernels it would use anyway).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Float32BackwardGemms", "cpu_lacks_gemm", "needs_float32_backward_gemms", "with_float32_backward_gemms"]

_aten = torch.ops.aten
GEMMS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})
HALF = (torch.bfloat16, torch.float16)


def cpu_lacks_gemm(dtype: torch.dtype) -> bool:
    """Whether PyTorch on this CPU computes ``dtype`` matrix products with its reference loops (no oneDNN kernel)."""
    if dtype == torch.bfloat16:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return not torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return False


def needs_float32_backward_gemms(dtype: str | torch.dtype, device: str | torch.device) -> bool:
    """Whether a model of ``dtype`` trained on ``device`` should take its backward's products in float32."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return torch.device(device).type == "cpu" and dtype in HALF and cpu_lacks_gemm(dtype)


def _is_half_cpu(x) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in HALF and x.device.type == "cpu"


class Float32BackwardGemms(TorchDispatchMode):
    """Inside it, a half-precision CPU matrix product is a float32 one rounded back (see the module's docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in GEMMS:
            halves = [a for a in args if _is_half_cpu(a)]
            if halves:
                dtype = halves[0].dtype
                up = [a.float() if _is_half_cpu(a) else a for a in args]
                return func(*up, **kwargs).to(dtype)
        return func(*args, **kwargs)


def with_float32_backward_gemms(backward: Callable[[torch.Tensor], None], dtype: str | torch.dtype,
                                device: str | torch.device) -> Callable[[torch.Tensor], None]:
    """``backward`` itself where it does not apply, else ``backward`` run inside ``Float32BackwardGemms``."""
    if not needs_float32_backward_gemms(dtype, device):
        return backward

    def float32_gemm_backward(loss: torch.Tensor) -> None:
        with Float32BackwardGemms():
            backward(loss)

    return float32_gemm_backward
