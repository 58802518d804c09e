"""FP8 (E4M3) block quantization: the one quantizer both phases call.

Recipe ``fp8_unified`` (Jet-RL, arXiv 2601.14243) runs the *same* quantized
linear layers in the rollout engine and in the trainer's forward; this module
holds the only implementation of that quantization, so the two phases can
never drift. Layout (DeepSeek-V3 technical report, arXiv 2412.19437, §3.3.2
"fine-grained quantization"):

- weights ``W [N, K]``: 128x128 blocks, one float32 scale per block;
- activations ``x [..., K]``: 1x128 groups along the last (contraction) dim,
  one float32 scale per token and group;
- element format ``torch.float8_e4m3fn``: 1 sign, 4 exponent, 3 mantissa bits,
  finite max 448, no infinities.

Per block (or group) ``B`` of a tensor ``t``::

    amax  = max(max_{i in B} |t_i|, EPS)                    EPS = 1e-10
    s     = amax / 448                                      (float32 IEEE division; the dequantisation scale)
    q_i   = e4m3(clamp(fp32(t_i) / s, -448, 448))           (round to nearest, ties to even)
    t~_i  = fp32(q_i) * s, rounded once to t's dtype        (dequantize)

This is, operation for operation, the activation quantizer of the CUDA engine: vLLM's CUTLASS
block-FP8 kernel (the one ``rollout.engine_options.block_fp8_kwargs`` pins) quantizes with
``QuantFP8(use_ue8m0=False)`` -> ``per_token_group_quant_fp8`` -> the CUDA op
``per_token_group_fp8_quant`` (vLLM's ``csrc/quantization/w8a8/fp8/per_token_group_quant.cu``:
``local_absmax`` starts at eps = 1e-10, ``y_s = local_absmax / max_8bit``, then
``DST_DTYPE(clamp(x / y_s))``). Two of vLLM's other paths differ, and the engine takes neither:
its Triton fallback (``fp8_utils._per_token_group_quant_fp8``, used off CUDA or for a
non-contiguous input) multiplies by ``1.0 / fp8_max``, one float32 ulp away from the division
for 55% of bf16 amax values; its pure-torch ``QuantFP8.forward_native`` divides too but floors the
scale at 1/(448*512) instead of the amax at 1e-10, so it agrees for amax >= 2^-9 only. Division
is by a tensor, never by a Python number: on CUDA torch computes ``t / number`` as
``t * (1 / number)`` (``aten/src/ATen/native/cuda/BinaryDivTrueKernel.cu``, the ``is_cpu_scalar``
branch). Tests: tests/parity/test_precision.py (against vLLM's own ``forward_native``).

Choices, and why:

- **Zero blocks**: amax is clamped at EPS, so an all-zero block gets the scale
  EPS/448 and quantizes to exact zeros (0 / s = 0), never 0/0 = NaN. The same
  clamp as vLLM's kernels.
- **Saturation**: the value equal to amax maps to exactly +-448 (t/s = 448 up to
  one float32 rounding, and the clamp removes an overshoot of 448*(1+2^-23)).
  The explicit clamp matters: the float8 cast of an out-of-range value is not
  guaranteed to saturate on every backend.
- **Dims not divisible by 128: padding.** The tensor is padded with zeros to the
  next multiple of 128 *for the amax computation only* (zeros never raise an
  amax), so a partial edge block is a block with fewer elements; outputs keep
  the input's shape and scales have ``ceil(dim/128)`` entries per dim. This is
  the layout of vLLM's ``BlockQuantScaleParameter`` (ceil-div scale shapes).
  No fallback to BF16 for odd shapes: a layer is either quantized or not, by
  name. (vLLM's CUDA kernels additionally need K % 128 == 0 for the activation
  groups, and every shard but the last of a fused module to be a multiple of
  128 rows; on CPU the emulation has no such limit.)
- **Idempotence**: fake_quant(fake_quant(t)) == fake_quant(t) bitwise for
  bfloat16 (and float16) t. The element at amax dequantizes to 448*s, within a
  few float32 ulps of amax, which rounds back to amax exactly in bf16; so the
  second pass recomputes the same scale, and every other element lies within
  one bf16 rounding (<= 2^-9 relative) of an E4M3 grid point times s, far
  inside the half-spacing (>= 2^-5 relative) that would move it. For float32 t
  the FP8 codes are identical but 448*s need not equal amax exactly, so the
  values may differ by a float32 ulp of the scale. This is what lets the engine
  re-quantize the BF16 weights the trainer pushes and land on the trainer's
  FP8 values exactly (tests/parity/test_precision.py).
- **Precision of the round trip**: for |t/s| >= 2^-6 (E4M3's smallest normal)
  the relative error of one element is <= 2^-4 (3 mantissa bits, round to
  nearest); below that the absolute error is <= 2^-10 * s (half the subnormal
  spacing 2^-9). A bf16 output adds one bf16 rounding (<= 2^-9 relative).

``fp8_linear`` is the quantized linear layer of both phases::

    y = fake_quant_act(x) @ fake_quant_weight(W)^T (+ b)       computed in x's dtype (BF16)

Backward: straight-through estimator (Bengio et al. 2013, arXiv 1308.3432):
each quantizer's Jacobian is taken as the identity, so
``dL/dx = dL/dy @ W~`` and ``dL/dW = dL/dy^T @ x~`` (W~, x~ the fake-quantized
operands the forward used), in x's dtype; gradients between operators stay in
BF16 and the master weights are never quantized in place.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "BLOCK",
    "EPS",
    "cast_to_e4m3",
    "scale_from_amax",
    "quantize_weight_blocks",
    "dequantize_weight_blocks",
    "quantize_act_groups",
    "dequantize_act_groups",
    "fake_quant_weight",
    "fake_quant_weight_shards",
    "fake_quant_act",
    "fp8_linear",
    "FP8_TARGETS",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128  # weight blocks are BLOCK x BLOCK, activation groups 1 x BLOCK
EPS = 1e-10  # amax floor: zero blocks get a finite scale (same as vLLM's kernels)
# Hugging Face leaf names of the decoder linear layers both phases quantize (Llama, Mistral, Qwen2/3).
# lm_head, embeddings, norms and attention stay BF16 (trainer/models/precision.py says why).
FP8_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cast_to_e4m3(t: torch.Tensor) -> torch.Tensor:
    """Already-scaled values -> float8_e4m3fn: clamp to [-448, 448], round to nearest even."""
    return t.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """Dequantisation scale s = max(amax, EPS) / 448, float32, correctly rounded (module docstring: why a division)."""
    a = amax.float().clamp_min(EPS)
    return a / torch.full_like(a, FP8_MAX)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block = {block!r}: expected a positive int (128 for the fp8 recipes)")


def _check_float(t: torch.Tensor, what: str) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == FP8_DTYPE:
        raise TypeError(f"{what}: expected a floating-point tensor (bf16/fp16/fp32), got "
                        f"{type(t).__name__ if not isinstance(t, torch.Tensor) else t.dtype}")


# ---- weights: 128 x 128 blocks -------------------------------------------------------------------
def quantize_weight_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q float8_e4m3fn [N, K], s float32 [ceil(N/block), ceil(K/block)]).

    ``s`` is the dequantisation multiplier (W ~ q * s per block): what vLLM and
    DeepSeek-V3 checkpoints store as ``weight_scale_inv``.
    """
    _check_float(w, "weight")
    _check_block(block)
    if w.dim() != 2:
        raise ValueError(f"weight: expected a 2-D [out, in] tensor, got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = _ceil_div(n, block), _ceil_div(k, block)
    # Zero padding to whole blocks: it never raises an amax, and is cropped off the codes.
    blocks = F.pad(w.detach().float(), (0, kb * block - k, 0, nb * block - n)).view(nb, block, kb, block)
    s = scale_from_amax(blocks.abs().amax(dim=(1, 3)))
    q = cast_to_e4m3(blocks / s[:, None, :, None]).view(nb * block, kb * block)[:n, :k]
    return q.contiguous(), s


def dequantize_weight_blocks(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                             block: int = BLOCK) -> torch.Tensor:
    """(q [N, K], s [ceil(N/block), ceil(K/block)]) -> q * s in float32, rounded once to ``dtype``."""
    _check_block(block)
    n, k = q.shape
    if tuple(s.shape) != (_ceil_div(n, block), _ceil_div(k, block)):
        raise ValueError(f"scale shape {tuple(s.shape)} does not match weight {tuple(q.shape)} "
                         f"with {block}x{block} blocks (expected {(_ceil_div(n, block), _ceil_div(k, block))})")
    nb, kb = s.shape
    blocks = F.pad(q.float(), (0, kb * block - k, 0, nb * block - n)).view(nb, block, kb, block)
    return (blocks * s.float()[:, None, :, None]).view(nb * block, kb * block)[:n, :k].to(dtype)


def fake_quant_weight(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """W -> dequantize(quantize(W)) in W's dtype (no gradient: see ``fp8_linear`` for the STE)."""
    q, s = quantize_weight_blocks(w, block)
    return dequantize_weight_blocks(q, s, w.dtype, block)


def fake_quant_weight_shards(w: torch.Tensor, shard_rows: Sequence[int], block: int = BLOCK) -> torch.Tensor:
    """Fake-quantize a row-concatenation of independent weights, each with its own block grid.

    vLLM fuses q/k/v (and gate/up) into one matrix; the trainer quantizes each
    Hugging Face module on its own. Blocks restart at every shard boundary so the
    engine sees the trainer's blocks even when a shard (e.g. k_proj with 64 rows)
    is not a multiple of 128.
    """
    if sum(shard_rows) != w.shape[0] or any(r < 1 for r in shard_rows):
        raise ValueError(f"shard_rows {list(shard_rows)} must be positive and sum to the weight's "
                         f"{w.shape[0]} rows")
    return torch.cat([fake_quant_weight(part, block) for part in w.split(list(shard_rows), dim=0)], dim=0)


# ---- activations: 1 x 128 groups -----------------------------------------------------------------
def quantize_act_groups(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q float8_e4m3fn [..., K], s float32 [..., ceil(K/group)]): one scale per token and group."""
    _check_float(x, "activation")
    _check_block(group)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"activation: expected [..., K] with K >= 1, got shape {tuple(x.shape)}")
    k = x.shape[-1]
    g = _ceil_div(k, group)
    groups = F.pad(x.detach().float(), (0, g * group - k)).unflatten(-1, (g, group))
    s = scale_from_amax(groups.abs().amax(dim=-1))
    q = cast_to_e4m3(groups / s[..., None]).flatten(-2)[..., :k]
    return q.contiguous(), s


def dequantize_act_groups(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                          group: int = BLOCK) -> torch.Tensor:
    """(q [..., K], s [..., ceil(K/group)]) -> q * s in float32, rounded once to ``dtype``."""
    _check_block(group)
    k = q.shape[-1]
    if tuple(s.shape) != tuple(q.shape[:-1]) + (_ceil_div(k, group),):
        raise ValueError(f"scale shape {tuple(s.shape)} does not match activation {tuple(q.shape)} "
                         f"with 1x{group} groups")
    groups = F.pad(q.float(), (0, s.shape[-1] * group - k)).unflatten(-1, (s.shape[-1], group))
    return (groups * s.float()[..., None]).flatten(-2)[..., :k].to(dtype)


def fake_quant_act(x: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """x -> dequantize(quantize(x)) in x's dtype (no gradient: see ``fp8_linear`` for the STE)."""
    q, s = quantize_act_groups(x, group)
    return dequantize_act_groups(q, s, x.dtype, group)


# ---- the quantized linear layer ------------------------------------------------------------------
class _StraightThrough(torch.autograd.Function):
    """y = quantizer(t) forward; dL/dt = dL/dy backward (the quantizer's Jacobian taken as I)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, quantizer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return quantizer(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _ste(t: torch.Tensor, quantizer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    if torch.is_grad_enabled() and t.requires_grad:
        return _StraightThrough.apply(t, quantizer)
    return quantizer(t)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
               weight_is_quantized: bool = False) -> torch.Tensor:
    """The FP8 linear layer of both phases: fake_quant_act(x) @ fake_quant_weight(W)^T + b, in x's dtype.

    x [..., K]; weight [N, K]; bias [N] or None. Returns [..., N] in x's dtype.
    ``weight_is_quantized=True``: ``weight`` already went through
    ``fake_quant_weight`` (the engine caches it at load time); by idempotence the
    result is bitwise the same as passing the raw weight.
    Gradients: straight-through to x and weight (module docstring).

    Any device: quantize -> dequantize -> matmul in x's dtype. This is the CPU path and the
    oracle of the CUDA FP8 GEMM (``parity.fp8_gemm.fp8_linear_scaled_mm``, same codes and scales).
    """
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match "
                         "(expected x [..., K], weight [N, K])")
    xq = _ste(x, fake_quant_act)
    wq = weight if weight_is_quantized else _ste(weight, fake_quant_weight)
    return F.linear(xq, wq.to(x.dtype), None if bias is None else bias.to(x.dtype))


def host_has_native_bf16() -> bool:
    """Whether the host CPU computes BF16 natively (AVX512-BF16 or AMX-BF16 flags in /proc/cpuinfo).

    Without it PyTorch emulates BF16 kernels, and BF16 results over differently padded or sharded
    batches differ in the low bits (measured on an AVX2-only AMD EPYC: the two shards' loss 4e-4
    relative from one process's, grad norm 2.6e-3 after a step); equivalence tests between one
    process and several widen their BF16 tolerances there. A GPU run is not judged by this.
    """
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
