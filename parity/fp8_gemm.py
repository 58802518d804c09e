"""Real FP8 GEMMs for ``parity.precision``'s block quantization: layouts, weight cache, linear layer.

The codes and scales are ``parity.precision``'s (``quantize_weight_blocks``; activations through
the fused Triton kernel ``parity.fp8_triton`` on CUDA, bitwise ``quantize_act_groups``), laid out
for ``torch.nn.functional.scaled_mm`` with ``(BlockWise1x128, BlockWise128x128)``. The layout rule
is read in PyTorch's source (``aten/src/ATen/native/cuda/ScaledBlas.cpp``,
``_scaled_block1x128_block128x128`` and ``_check_deepseek_support``; the meta check in
``torch/_meta_registrations.py`` agrees), for A = x [M, K] and B = W^T [K, N]::

    mat_a   [M, K]  float8, row-major;     mat_b [K, N] float8, column-major (W^T of a row-major W)
    scale_a [M, ceil(K/128)]               float32, strides (1, M)        (M-major)
    scale_b [L4, ceil(N/128)]              float32, strides (1, L4)       L4 = round_up(ceil(K/128), 4)
    K % 16 == 0, N % 16 == 0; SM 9.x only ("DeepSeek style (1x128, 128x128) scaling only
    supported in CUDA for SM90"), cuBLASLt >= 12.9

``scale_b`` is the transpose of a contiguous ``[N/128, L4]`` whose first ``K/128`` columns are
the weight's block scales; the rest is padding cuBLAS never multiplies (zeros here). Without
it, K/128 not a multiple of 4 fails: "scale_b must have shape 8 x 7 Float elements, got [7, 7]"
for K = 896 (K = 256, 896, 4864 -- every layer of Qwen2.5-0.5B -- failed on an H100; 512, 1536,
3584, 4096, 18944 worked: their K/128 are multiples of 4).

Every shape runs: K and N are zero-padded to multiples of 128 (zeros add nothing to a product
and never raise an amax, so the codes and scales of the real elements are unchanged), M to a
multiple of ``fp8_triton.BLOCK_M``; the output is cropped back. For the models the engine runs,
K and N are multiples of 128 and only the weight's scale is padded (no copy per call).

Weights are quantized once per optimizer step: ``Fp8WeightCache`` keys the quantized weight on
the identity, storage and version counter (``Tensor._version``, bumped by every in-place write:
optimizer steps, ``copy_``, ``load_state_dict``) of each tensor the weight is computed from (the
base weight, each active LoRA A and B), plus the LoRA scalings. Writes through ``.data`` do not
bump the version: call ``invalidate()`` (``trainer.models.precision.invalidate_fp8_caches``)
after such a write.

Backward (``Fp8CachedLinear``): straight-through estimator in the input's dtype (BF16), on the
same dequantized operands the forward used -- ``dL/dx = g @ W~``, ``dL/dW' = g^T x~`` -- then
through the LoRA merge by autograd. FP8 gradients were not chosen: Jet-RL (arXiv 2601.14243)
keeps gradients in BF16/FP8 mixed, and the recipe's parity is about the forward both phases
share (the engine has no backward); BF16 gradients keep the learning curve of the emulated
recipe, which the CPU tests pin down.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from parity.precision import (
    BLOCK,
    FP8_DTYPE,
    dequantize_act_groups,
    dequantize_weight_blocks,
    fake_quant_act,
    fake_quant_weight,
    fp8_linear,
    quantize_act_groups,
    quantize_weight_blocks,
    scale_from_amax,
)

__all__ = [
    "M_ALIGN",
    "round_up",
    "scale_b_rows",
    "pad_weight_scale",
    "Fp8Weight",
    "quantize_weight_for_gemm",
    "quantize_act_for_gemm",
    "Fp8WeightCache",
    "fp8_gemm",
    "fp8_cached_linear",
    "scaled_mm_supported",
    "FP8_BACKENDS",
    "VERIFY_SHAPES",
    "fp8_linear_scaled_mm",
    "verify_scaled_mm",
]

# The trainer's FP8 linear backends: "emulated" (parity.precision.fp8_linear, any device) and
# "scaled_mm" (this module's FP8 GEMM, CUDA SM 9.x).
FP8_BACKENDS = ("emulated", "scaled_mm")

M_ALIGN = 32  # rows of the activation are padded to this (== fp8_triton.BLOCK_M)


def round_up(a: int, b: int) -> int:
    return -(-a // b) * b


def scale_b_rows(k: int) -> int:
    """L4 = round_up(ceil(K/128), 4): the first dimension torch wants for a 128x128 weight scale."""
    return round_up(-(-k // BLOCK), 4)


def pad_weight_scale(ws: torch.Tensor) -> torch.Tensor:
    """Block scales [ceil(N/128), ceil(K/128)] -> scale_b [L4, ceil(N/128)] with strides (1, L4).

    L4 = round_up(ceil(K/128), 4) (``scale_b_rows``); entry [kb, nb] is ws[nb, kb]; the rows
    kb >= ceil(K/128) are zeros (padding). Pure layout: no value is changed.
    """
    if ws.dim() != 2:
        raise ValueError(f"weight scale: expected [N/128, K/128], got shape {tuple(ws.shape)}")
    nb, kb = ws.shape
    l4 = round_up(kb, 4)
    padded = torch.zeros((nb, l4), dtype=torch.float32, device=ws.device)
    padded[:, :kb] = ws
    return padded.t()


@dataclass
class Fp8Weight:
    """One weight quantized for the GEMM: codes [N_pad, K_pad] (zero padding), scale [N/128, K/128], scale_b."""

    codes: torch.Tensor
    scale: torch.Tensor
    scale_b: torch.Tensor
    n: int
    k: int

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W~ [N, K] in ``dtype``: bitwise ``fake_quant_weight(W)`` for W of that dtype."""
        return dequantize_weight_blocks(self.codes[: self.n, : self.k], self.scale, dtype)


def quantize_weight_for_gemm(w: torch.Tensor) -> Fp8Weight:
    """W [N, K] -> ``Fp8Weight`` (parity.precision's codes and scales, padded for scaled_mm)."""
    q, s = quantize_weight_blocks(w)
    n, k = w.shape
    n_pad, k_pad = round_up(n, BLOCK), round_up(k, BLOCK)
    if (n_pad, k_pad) != (n, k):
        q = F.pad(q.view(torch.uint8), (0, k_pad - k, 0, n_pad - n)).view(FP8_DTYPE)
    return Fp8Weight(q, s, pad_weight_scale(s), n, k)


def quantize_act_for_gemm(x2: torch.Tensor, k_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] -> (codes [M_pad, k_pad], scale_a [M_pad, k_pad/128] with strides (1, M_pad)).

    CUDA: the fused Triton kernel (one pass). Elsewhere: ``quantize_act_groups`` plus padding
    (the reference; same codes and scales bitwise).
    """
    m, k = x2.shape
    m_pad = round_up(max(m, 1), M_ALIGN)
    if x2.is_cuda:
        # late: triton is optional on a CPU install, and only CUDA tensors take the fused kernel
        from parity.fp8_triton import quantize_act_groups_triton

        q, s = quantize_act_groups_triton(x2, m_pad, k_pad)
        return q, s.t()
    q, s = quantize_act_groups(x2)
    q = F.pad(q.view(torch.uint8), (0, k_pad - k, 0, m_pad - m)).view(FP8_DTYPE)
    # Padded rows: zero codes with the scale of a zero group (EPS/448), as the Triton kernel writes.
    s_t = scale_from_amax(torch.zeros((k_pad // BLOCK, m_pad), device=x2.device))
    s_t[: s.shape[1], :m] = s.t()
    return q, s_t.t()


def scaled_mm_supported(device: torch.device | str) -> bool:
    """Whether torch's block-scaled FP8 GEMM can run here: CUDA SM 9.x and ``F.scaled_mm`` present."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(F, "scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def fp8_gemm(xq: torch.Tensor, scale_a: torch.Tensor, w: Fp8Weight, m: int,
             out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[m, N] = (xq * scale_a) @ (codes * scale)^T (+ bias), one cuBLASLt block-scaled FP8 GEMM."""
    from torch.nn.functional import ScalingType, SwizzleType

    y = F.scaled_mm(xq, w.codes.t(), scale_a, ScalingType.BlockWise1x128, w.scale_b, ScalingType.BlockWise128x128,
                    swizzle_a=SwizzleType.NO_SWIZZLE, swizzle_b=SwizzleType.NO_SWIZZLE, output_dtype=out_dtype)
    y = y[:m, : w.n]  # rows: a view; columns: cropped only when N is not a multiple of 128
    return y if bias is None else y + bias.to(out_dtype)


# Indirection for the tests: CPU has no block-scaled FP8 GEMM, so they swap in an emulation of it.
_GEMM: Callable[..., torch.Tensor] = fp8_gemm


class Fp8WeightCache:
    """The quantized weight of one layer, recomputed only when a tensor it is computed from changed.

    ``get(sources, extra, compute)``: ``sources`` the tensors the weight depends on (base weight,
    LoRA A/B), ``extra`` hashable values it also depends on (scalings, dtype), ``compute()`` the
    weight to quantize. The key is ``(id, data_ptr, _version)`` of each source plus ``extra``.
    ``quantizations`` counts the (re)quantizations (tests, benchmarks).
    """

    def __init__(self) -> None:
        self.key: Optional[tuple] = None
        self.value: Optional[Fp8Weight] = None
        self.quantizations = 0

    @staticmethod
    def make_key(sources: Sequence[torch.Tensor], extra: tuple = ()) -> tuple:
        return tuple((id(t), t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in sources) + tuple(extra)

    def get(self, sources: Sequence[torch.Tensor], extra: tuple, compute: Callable[[], torch.Tensor]) -> Fp8Weight:
        key = self.make_key(sources, extra)
        if self.value is None or key != self.key:
            with torch.no_grad():
                self.value = quantize_weight_for_gemm(compute())
            self.key = key
            self.quantizations += 1
        return self.value

    def invalidate(self) -> None:
        self.key, self.value = None, None


class Fp8CachedLinear(torch.autograd.Function):
    """y = GEMM_fp8(Q(x), cached Q(W')) + b; backward BF16 STE (module docstring).

    Inputs: x, bias, the ``Fp8Weight``, ``weight_grad(G)`` (maps dL/dW' [N, K] to the gradients
    of ``params``, or None when no parameter needs one), then ``*params`` (the trainable tensors
    W' depends on, so that autograd hands their gradients to its engine and hooks).
    """

    @staticmethod
    def forward(ctx, x, bias, fw: Fp8Weight, weight_grad, *params):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        xq, sa = quantize_act_for_gemm(x2, fw.codes.shape[1])
        y = _GEMM(xq, sa, fw, m, x.dtype, bias)
        ctx.fw, ctx.weight_grad, ctx.m, ctx.k = fw, weight_grad, m, k
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        # The FP8 codes (1 byte/element) and scales are what backward needs of x: x~ = deq(codes).
        ctx.save_for_backward(xq, sa)
        return y.reshape(*x.shape[:-1], fw.n)

    @staticmethod
    def backward(ctx, grad):
        xq, sa = ctx.saved_tensors
        fw, m, k, dtype = ctx.fw, ctx.m, ctx.k, ctx.x_dtype
        g2 = grad.reshape(-1, fw.n).to(dtype)
        gx = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g2 @ fw.dequantize(dtype)).reshape(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[1]:
            gb = g2.sum(0)
        param_grads: tuple = (None,) * (len(ctx.needs_input_grad) - 4)
        if ctx.weight_grad is not None and any(ctx.needs_input_grad[4:]):
            x_deq = dequantize_act_groups(xq[:m, :k], sa[:m, : -(-k // BLOCK)], dtype)
            param_grads = tuple(ctx.weight_grad(g2.t() @ x_deq))
        return (gx, gb, None, None, *param_grads)


def fp8_cached_linear(x: torch.Tensor, cache: Fp8WeightCache, sources: Sequence[torch.Tensor], extra: tuple,
                      compute: Callable[[], torch.Tensor], bias: Optional[torch.Tensor],
                      params: Sequence[torch.Tensor] = (),
                      weight_grad: Optional[Callable[[torch.Tensor], Sequence[torch.Tensor]]] = None) -> torch.Tensor:
    """The FP8 linear layer on a cached quantized weight: ``Fp8CachedLinear`` (see it for the arguments)."""
    fw = cache.get(sources, extra, compute)
    params = tuple(params) if torch.is_grad_enabled() else ()
    return Fp8CachedLinear.apply(x, bias, fw, weight_grad if params else None, *params)


class _ScaledMMLinear(torch.autograd.Function):
    """Forward: one block-scaled FP8 GEMM (``parity.fp8_gemm``); backward as the emulated STE path, in BF16.

    The uncached form (the weight is quantized on every call); the trainer's layers use
    ``parity.fp8_gemm.fp8_cached_linear``, which quantizes each weight once per optimizer step.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, weight_is_quantized):
        if not x.is_cuda:
            raise RuntimeError("fp8_linear_scaled_mm needs CUDA tensors; the emulated fp8_linear runs on any device")
        x2 = x.reshape(-1, x.shape[-1])
        fw = quantize_weight_for_gemm(weight.detach())
        xq, sa = quantize_act_for_gemm(x2, fw.codes.shape[1])
        y = _GEMM(xq, sa, fw, x2.shape[0], x.dtype, None if bias is None else bias.detach())
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.weight_is_quantized = bias is not None, weight_is_quantized
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        wq = (weight if ctx.weight_is_quantized else fake_quant_weight(weight)).to(grad.dtype)
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = (g2 @ wq).reshape(x.shape) if ctx.needs_input_grad[0] else None
        gw = (g2.t() @ fake_quant_act(x).reshape(-1, x.shape[-1])).to(weight.dtype) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


# (M, K, N) checked by verify_scaled_mm: K = 896 has K/128 = 7, not a multiple of 4 (the weight
# scale must be padded: the H100 error "scale_b must have shape 8 x 7"); the second shape pads
# M, K and N (37 rows, K = 200, N = 96 are not multiples of 32 / 128).
VERIFY_SHAPES: tuple[tuple[int, int, int], ...] = ((64, 896, 640), (37, 200, 96))


def verify_scaled_mm(device: str | torch.device = "cuda", *, rtol: float = 2e-2) -> float:
    """Run the FP8 GEMM path on ``device`` and compare it with the emulation; raise if they disagree.

    Checks, per shape of ``VERIFY_SHAPES``: the device's activation quantizer (the fused Triton
    kernel on CUDA) gives ``quantize_act_groups``'s codes and scales bitwise; the GEMM's relative
    Frobenius error against the emulated ``fp8_linear`` is below ``rtol``. The two
    multiply the same FP8 operands; only the accumulation differs (FP32 in the tensor cores vs a
    BF16 GEMM of the dequantized operands), so the error is of the order of BF16 rounding.
    Returns the largest error.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    worst = 0.0
    for m, k, n in VERIFY_SHAPES:
        x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
        w = (torch.randn(n, k, generator=g) * 0.05).to(device=device, dtype=torch.bfloat16)
        q_ref, s_ref = quantize_act_groups(x)
        q_dev, s_dev = quantize_act_for_gemm(x, round_up(k, BLOCK))
        if not (torch.equal(q_dev[:m, :k].view(torch.uint8), q_ref.view(torch.uint8))
                and torch.equal(s_dev[:m], s_ref)):
            raise RuntimeError(f"the FP8 activation quantizer on {device} differs from quantize_act_groups "
                               f"(M={m}, K={k}); use backend='emulated'")
        ref = fp8_linear(x, w).float()
        got = fp8_linear_scaled_mm(x, w).float()
        err = ((got - ref).norm() / ref.norm()).item()
        if not math.isfinite(err) or err > rtol:
            raise RuntimeError(f"fp8_linear_scaled_mm disagrees with the emulation on {device} "
                               f"(M={m}, K={k}, N={n}): relative error {err:.3g} > {rtol}; use backend='emulated'")
        worst = max(worst, err)
    return worst




def fp8_linear_scaled_mm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                         weight_is_quantized: bool = False) -> torch.Tensor:
    """``parity.precision.fp8_linear`` with its forward GEMM in FP8 (CUDA SM 9.x): same codes and scales.

    Quantizes the weight on every call; the trainer's layers use ``fp8_cached_linear``, which
    quantizes each weight once per change of it. ``verify_scaled_mm`` checks it on a device first.
    """
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"fp8_linear_scaled_mm: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(expected x [..., K], weight [N, K])")
    return _ScaledMMLinear.apply(x, weight, bias, weight_is_quantized)
