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

Weights are quantized once per optimizer step and adapter state: ``Fp8WeightCache`` keys the
quantized weight on the identity, storage and version counter (``Tensor._version``, bumped by every
in-place write: optimizer steps, ``copy_``, ``load_state_dict``) of each tensor the weight is
computed from (the base weight, each active LoRA A and B), plus the LoRA scalings and the adapter
switches. It keeps one entry per such key (the policy's merged weight and the reference's base
weight with the adapter off live side by side, so alternating forwards do not re-quantize), drops
an entry as soon as one of its sources is written or freed (it can never be hit again), and keeps
at most ``max_entries``. ``quantizations`` counts the quantizations; a caller reads (and resets) it
per step with ``trainer.models.precision.fp8_weight_quantizations``. Writes through ``.data`` do not bump the
version: call ``invalidate()`` (``trainer.models.precision.invalidate_fp8_caches``) after such a write.

Backward (``Fp8CachedLinear``): straight-through estimator in the input's dtype (BF16), on the
same dequantized operands the forward used (W~ from the cached codes, x~ from the activation's
codes saved by the forward; each dequantized once per backward straight into x's dtype):
``dL/dx = g @ W~``. The merged weight is W' = W + sum_a s_a B_a A_a, and with dL/dW' = g^T x~
the adapters' gradients are taken through the rank r, never forming the [N, K] product::

    dL/dB_a = s_a g^T (x~ A_a^T)        dL/dA_a = s_a (g B_a)^T x~        (4 M r (N + K) FLOPs, not 2 M N K)

which is the same quantity as ``s_a dL/dW' A_a^T`` and ``s_a B_a^T dL/dW'`` (associativity); only
the rounding differs (the rank-r products are rounded to x's dtype, as in a BF16 PEFT LoRA forward,
instead of the [N, K] product). The full ``dL/dW = g^T x~`` (2 M N K FLOPs: a second forward's worth)
is computed only when the base weight itself requires a gradient. FP8 gradients were not chosen:
Jet-RL (arXiv 2601.14243) keeps gradients in BF16/FP8 mixed, and the recipe's parity is about the
forward both phases share (the engine has no backward); BF16 gradients keep the learning curve of
the emulated recipe, which the CPU tests pin down.

``verify_scaled_mm`` checks a device before the trainer uses it, on operands whose block scales are
powers of two apart (``verify_operands``), so that a scale applied to the wrong block (a transposed
or shifted layout) is an O(1) error; ``emulate_block_scaled_mm`` computes in float64 what the GEMM
gives for scales laid out in any way, which is how the CPU tests show that it would be caught.
"""
from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from parity.precision import (
    BLOCK,
    FP8_DTYPE,
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
    "dequantize_act_for_gemm",
    "Fp8WeightCache",
    "fp8_gemm",
    "fp8_gemm_emulated",
    "Fp8CachedLinear",
    "fp8_cached_linear",
    "scaled_mm_supported",
    "FP8_BACKENDS",
    "VERIFY_SHAPES",
    "verify_operands",
    "emulate_block_scaled_mm",
    "relative_error",
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
        """W~ [N, K] in ``dtype``: bitwise ``fake_quant_weight(W)`` for W of that dtype.

        Straight from the padded codes into ``dtype`` (a view of the [N_pad, K_pad] result when N
        or K is padded): an E4M3 code is exact in bf16/fp16, and the in-place multiply by the
        float32 scale computes each product in float32 and rounds it once, as
        ``dequantize_weight_blocks`` does; on CUDA the cast happens in the kernel, with no float32
        tensor of the weight's size.
        """
        n_pad, k_pad = self.codes.shape
        w = self.codes.to(dtype)
        w.view(n_pad // BLOCK, BLOCK, k_pad // BLOCK, BLOCK).mul_(self.scale[:, None, :, None])
        return w[: self.n, : self.k]


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


def dequantize_act_for_gemm(xq: torch.Tensor, scale_a: torch.Tensor, m: int, k: int,
                            dtype: torch.dtype) -> torch.Tensor:
    """(codes [M_pad, K_pad], scale_a [M_pad, K_pad/128]) -> x~ [m, k] in ``dtype``, bitwise
    ``dequantize_act_groups`` of the unpadded codes (a view of the padded result; same rounding
    argument as ``Fp8Weight.dequantize``)."""
    m_pad, k_pad = xq.shape
    x = xq.to(dtype)
    x.view(m_pad, k_pad // BLOCK, BLOCK).mul_(scale_a[:, :, None])
    return x[:m, :k]


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


def fp8_gemm_emulated(xq: torch.Tensor, scale_a: torch.Tensor, w: Fp8Weight, m: int,
                      out_dtype: torch.dtype, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``fp8_gemm``'s result in the emulation's order (any device): dequantized operands, a GEMM in
    ``out_dtype``; bitwise ``parity.precision.fp8_linear`` on the same x and weight."""
    x = dequantize_act_for_gemm(xq, scale_a, m, w.k, out_dtype)
    return F.linear(x, w.dequantize(out_dtype), None if bias is None else bias.to(out_dtype))


# Indirection for the tests and the CPU side of the benchmark: CPU has no block-scaled FP8 GEMM, so
# they swap in ``fp8_gemm_emulated`` and run the rest of this module's path unchanged.
_GEMM: Callable[..., torch.Tensor] = fp8_gemm


class Fp8WeightCache:
    """The quantized weights of one layer, one per state of what they are computed from.

    ``get(sources, extra, compute)``: ``sources`` the tensors the weight depends on (base weight,
    LoRA A/B), ``extra`` hashable values it also depends on (adapter switches, scalings, dtype),
    ``compute()`` the weight to quantize. The key is ``(id, data_ptr, _version, shape, dtype)`` of
    each source plus ``extra``; a hit returns the stored ``Fp8Weight``, a miss quantizes and stores.

    Entries: one per key, so a policy forward (adapter on) and a reference forward (adapter off)
    each keep theirs. An entry whose source was written since (its version moved on: versions only
    grow, so the key can never match again) or freed (its id may be reused by another tensor) is
    dropped on the next ``get``: after an optimizer step the stale merged weight goes and the
    reference's stays. ``max_entries`` bounds the rest (least recently used first): each entry holds
    1 byte per weight element, and a step uses the current adapter, the adapter off, and with
    overlapped rollouts the behaviour adapter (written into the same tensors, so a new version, not
    a new entry). The cache holds weak references to the sources, never the tensors.

    ``quantizations`` counts the quantizations since it was last set to 0 (per-step metric, tests).
    """

    def __init__(self, max_entries: int = 4) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries = {max_entries}: expected >= 1")
        self.max_entries = max_entries
        # key -> (weak references to the sources, their versions and storages at quantization, weight)
        self._entries: OrderedDict[tuple, tuple[tuple, Fp8Weight]] = OrderedDict()
        self.quantizations = 0

    @staticmethod
    def make_key(sources: Sequence[torch.Tensor], extra: tuple = ()) -> tuple:
        return tuple((id(t), t.data_ptr(), t._version, tuple(t.shape), t.dtype) for t in sources) + tuple(extra)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def key(self) -> Optional[tuple]:
        """The most recently used entry's key (None when empty)."""
        return next(reversed(self._entries), None)

    @property
    def value(self) -> Optional[Fp8Weight]:
        """The most recently used entry's weight (None when empty)."""
        return self._entries[self.key][1] if self._entries else None

    @staticmethod
    def _live(refs: tuple) -> bool:
        for ref, version, ptr in refs:
            t = ref()
            if t is None or t._version != version or t.data_ptr() != ptr:
                return False
        return True

    def get(self, sources: Sequence[torch.Tensor], extra: tuple, compute: Callable[[], torch.Tensor]) -> Fp8Weight:
        key = self.make_key(sources, extra)
        for stale in [k for k, (refs, _) in self._entries.items() if not self._live(refs)]:
            del self._entries[stale]
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit[1]
        with torch.no_grad():
            value = quantize_weight_for_gemm(compute())
        self.quantizations += 1
        self._entries[key] = (tuple((weakref.ref(t), t._version, t.data_ptr()) for t in sources), value)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return value

    def invalidate(self) -> None:
        """Drop every entry (after a write through ``.data``, which no version counter sees)."""
        self._entries.clear()


class Fp8CachedLinear(torch.autograd.Function):
    """y = GEMM_fp8(Q(x), cached Q(W')) + b with W' = W + sum_a s_a B_a A_a; backward BF16 STE, the
    adapters' gradients in factored form (module docstring).

    Inputs: x, bias, the ``Fp8Weight`` of W', the scalings (s_a), the base weight W (its gradient
    is computed only if autograd asks for it), then A_1, B_1, A_2, B_2, ... (none for a plain layer).
    """

    @staticmethod
    def forward(ctx, x, bias, fw: Fp8Weight, scalings: tuple, weight, *factors):
        k = x.shape[-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        xq, sa = quantize_act_for_gemm(x2, fw.codes.shape[1])
        y = _GEMM(xq, sa, fw, m, x.dtype, bias)
        ctx.fw, ctx.scalings, ctx.m, ctx.k = fw, scalings, m, k
        ctx.x_shape, ctx.x_dtype, ctx.has_bias = x.shape, x.dtype, bias is not None
        ctx.weight_dtype = weight.dtype if weight is not None else None
        # What backward needs of x is x~ = deq(codes): the FP8 codes (1 byte/element) and scales
        # are saved, not x; the adapters are saved for the rank-r products.
        ctx.save_for_backward(xq, sa, *factors)
        return y.reshape(*x.shape[:-1], fw.n)

    @staticmethod
    def backward(ctx, grad):
        xq, sa, *factors = ctx.saved_tensors
        fw, m, k, dtype = ctx.fw, ctx.m, ctx.k, ctx.x_dtype
        need = ctx.needs_input_grad
        g2 = grad.reshape(-1, fw.n).to(dtype)
        gx = gb = gw = None
        if need[0]:
            # W~ is dequantized here, not kept with the codes: a BF16 copy per cached weight would hold
            # 2 more bytes per element (the BF16 weights again, per adapter state), while dequantizing
            # moves ~7 bytes per element, a few percent of this GEMM's time at M in the thousands.
            gx = (g2 @ fw.dequantize(dtype)).reshape(ctx.x_shape)
        if ctx.has_bias and need[1]:
            gb = g2.sum(0)
        factor_grads: list = [None] * len(factors)
        if need[4] or any(need[5:]):
            x_deq = dequantize_act_for_gemm(xq, sa, m, k, dtype)
            if need[4]:
                gw = (g2.t() @ x_deq).to(ctx.weight_dtype)  # full fine-tuning of the base weight only
            for i, s in enumerate(ctx.scalings):
                a, b = factors[2 * i], factors[2 * i + 1]
                # The rank-r GEMMs run in x's dtype (the adapters rounded to it, the [M, r] products
                # and the gradients too), as autocast runs a BF16 PEFT LoRA layer; the scaling is
                # applied in float32 after.
                if need[5 + 2 * i]:
                    factor_grads[2 * i] = ((g2 @ b.to(dtype)).t() @ x_deq).float().mul_(s).to(a.dtype)
                if need[6 + 2 * i]:
                    factor_grads[2 * i + 1] = (g2.t() @ (x_deq @ a.to(dtype).t())).float().mul_(s).to(b.dtype)
        return (gx, gb, None, None, gw, *factor_grads)


def fp8_cached_linear(x: torch.Tensor, cache: Fp8WeightCache, sources: Sequence[torch.Tensor], extra: tuple,
                      compute: Callable[[], torch.Tensor], bias: Optional[torch.Tensor], *,
                      weight: Optional[torch.Tensor] = None,
                      lora: Sequence[tuple[torch.Tensor, torch.Tensor, float]] = ()) -> torch.Tensor:
    """The FP8 linear layer on a cached quantized weight: ``Fp8CachedLinear``.

    ``sources``, ``extra``, ``compute``: the cache's key and the weight W' to quantize on a miss
    (``Fp8WeightCache.get``). ``weight``: the base weight W [N, K], which gets the full STE gradient
    if it requires one. ``lora``: (A [r, K], B [N, r], scaling) of each adapter merged into W'
    (W' = W + sum s B A, which ``compute`` must return), whose gradients are taken through the rank.
    """
    fw = cache.get(sources, extra, compute)
    factors = [t for a, b, _ in lora for t in (a, b)]
    return Fp8CachedLinear.apply(x, bias, fw, tuple(float(s) for _, _, s in lora), weight, *factors)


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


# (M, K, N) checked by verify_scaled_mm. Each has several N blocks, so a scale_b read along the
# wrong axis, or shifted by a block, lands on another block's scale. K = 896: K/128 = 7, padded to 8
# rows of scale_b (the H100 error "scale_b must have shape 8 x 7" without it), N = 640: 5 blocks.
# The second shape pads M, K and N (37 rows, K = 200: 2 blocks padded to 4 rows, N = 300: 3 blocks,
# the last partial).
VERIFY_SHAPES: tuple[tuple[int, int, int], ...] = ((64, 896, 640), (37, 200, 300))


def verify_operands(m: int, k: int, n: int, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] and W [n, k] (bfloat16, CPU) for ``verify_scaled_mm``, with block scales far apart.

    Each 1x128 group of x and each 128x128 block of W is a standard normal times 2^e, e in -3..3:
    for W's block (nb, kb), e = (2 nb + 3 kb) mod 7 - 3, so neighbours along N differ by a factor 4
    or 32, along K by 8 or 16, and block (i, j) differs from (j, i) unless i = j (mod 7); for x's
    group (i, kb), e = (i + 3 kb) mod 7 - 3. Block amaxes of one normal distribution differ by a few
    percent, so with plain normal operands a scale applied to the wrong block (a transposed or
    shifted layout) moves the result by about as much, near the check's tolerance; here it is O(1).
    """
    g = torch.Generator(device="cpu").manual_seed(seed)
    kb, nb = -(-k // BLOCK), -(-n // BLOCK)
    ex = (torch.arange(m)[:, None] + 3 * torch.arange(kb)) % 7 - 3
    ew = (2 * torch.arange(nb)[:, None] + 3 * torch.arange(kb)) % 7 - 3
    x = torch.randn(m, k, generator=g) * torch.exp2(ex.float()).repeat_interleave(BLOCK, 1)[:, :k]
    w = torch.randn(n, k, generator=g) * torch.exp2(ew.float()).repeat_interleave(BLOCK, 0).repeat_interleave(
        BLOCK, 1)[:n, :k]
    return x.bfloat16(), (w * 0.05).bfloat16()


def emulate_block_scaled_mm(xq: torch.Tensor, scale_a: torch.Tensor, mat_b: torch.Tensor,
                            scale_b: torch.Tensor) -> torch.Tensor:
    """What ``F.scaled_mm(xq, mat_b, scale_a, BlockWise1x128, scale_b, BlockWise128x128)`` computes, in float64.

    xq [M, K] and mat_b [K, N] float8 codes (K, N multiples of 128); scale_a [M, >= K/128], scale_b
    [>= K/128, N/128], read as the logical tensors they are (entry [i, kb] scales x's group
    (i, kb), entry [kb, nb] mat_b's block (kb, nb); rows past K/128 are padding, unread): a scale
    tensor in a wrong layout gives here what the GEMM would give with it. Exact products, float64 sums.
    """
    mm, kk = xq.shape
    nn_ = mat_b.shape[1]
    kb, nb = kk // BLOCK, nn_ // BLOCK
    x = xq.double().view(mm, kb, BLOCK) * scale_a[:, :kb].double()[:, :, None]
    w = mat_b.double().view(kb, BLOCK, nb, BLOCK) * scale_b[:kb].double()[:, None, :, None]
    return x.view(mm, kk) @ w.view(kk, nn_)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||got - ref|| / ||ref||, in float64."""
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm()).item()


def verify_scaled_mm(device: str | torch.device = "cuda", *, rtol: float = 2e-2) -> float:
    """Run the FP8 GEMM path on ``device`` and compare it with the emulation; raise if they disagree.

    Checks, per shape of ``VERIFY_SHAPES`` on ``verify_operands``: the device's activation
    quantizer (the fused Triton kernel on CUDA) gives ``quantize_act_groups``'s codes and scales
    bitwise; the GEMM's relative Frobenius error against the emulated ``fp8_linear`` is below
    ``rtol``. The two multiply the same FP8 operands; only the accumulation differs (FP32 in the
    tensor cores vs a BF16 GEMM of the dequantized operands), so the error is of the order of BF16
    rounding, while a misplaced scale gives an error of order 1 on these operands
    (tests/parity/test_fp8_gemm.py shows it with ``emulate_block_scaled_mm``). Returns the largest error.
    """
    worst = 0.0
    for m, k, n in VERIFY_SHAPES:
        x, w = (t.to(device) for t in verify_operands(m, k, n))
        q_ref, s_ref = quantize_act_groups(x)
        q_dev, s_dev = quantize_act_for_gemm(x, round_up(k, BLOCK))
        if not (torch.equal(q_dev[:m, :k].view(torch.uint8), q_ref.view(torch.uint8))
                and torch.equal(s_dev[:m], s_ref)):
            raise RuntimeError(f"the FP8 activation quantizer on {device} differs from quantize_act_groups "
                               f"(M={m}, K={k}); use backend='emulated'")
        err = relative_error(fp8_linear_scaled_mm(x, w), fp8_linear(x, w))
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
