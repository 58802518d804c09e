"""Fused FP8 activation quantizer (Triton): 1x128 groups, amax, scale and cast in one pass.

Same formula as ``parity.precision.quantize_act_groups``, operation for operation, so the FP8
codes and float32 scales are bitwise the same (tests/parity/test_fp8_triton_interpret.py)::

    amax = max_{i in group} |fp32(x_i)|          (zeros pad a partial last group: never raise it)
    s    = max(amax, EPS) / 448                   IEEE division (div_rn), as scale_from_amax
    q_i  = e4m3(clamp(fp32(x_i) / s, -448, 448))  IEEE division (div_rn), RNE cast

Two details keep it bitwise: both divisions are ``tl.math.div_rn`` (Triton's ``/`` on float32 is
the approximate ``div.full.f32`` on NVIDIA GPUs), and the cast is the hardware's
round-to-nearest-even ``cvt.rn.satfinite.e4m3`` (the explicit clamp first, like ``cast_to_e4m3``).

Output layout is the one ``torch.nn.functional.scaled_mm`` wants for ``BlockWise1x128`` on the
activation side (``parity.fp8_gemm``): codes ``[M_pad, K_pad]`` row-major, zeros in the padding;
scales ``[K_pad/128, M_pad]`` contiguous, i.e. ``scales.t()`` is ``[M_pad, K/128]`` with
stride ``(1, M_pad)`` (M-major). Padded rows quantize to zero codes with the scale EPS/448.

Triton's interpreter (CPU) does not round float32 -> float8e4nv to nearest even (triton 3.9:
17.0 -> 18.0, 1.5 * 2^-10 -> 0), so the kernel can store the float32 values it would cast
(``store_f32=True``); the interpreter tests check those and the scales bitwise, and the GPU
session checks the float8 stores.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from parity.precision import BLOCK, EPS, FP8_DTYPE, FP8_MAX

__all__ = ["quantize_act_groups_triton"]

BLOCK_M = 32  # rows per program; one program quantizes a [BLOCK_M, 128] tile (one group per row)


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_xk, stride_qm, stride_sg,
                      eps, fp8_max,
                      GROUP: tl.constexpr, BLOCK_M: tl.constexpr, STORE_F32: tl.constexpr):
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * K may exceed 2^31
    cols = g * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0)
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    s = tl.math.div_rn(tl.maximum(amax, eps), fp8_max)
    y = tl.math.div_rn(x, s[:, None])
    y = tl.minimum(tl.maximum(y, -fp8_max), fp8_max)
    # Every row and column of the padded output is written (the grid covers M_pad x K_pad).
    q_ptrs = q_ptr + rows[:, None] * stride_qm + cols[None, :]
    if STORE_F32:
        tl.store(q_ptrs, y)
    else:
        tl.store(q_ptrs, y.to(q_ptr.dtype.element_ty))
    tl.store(s_ptr + g * stride_sg + rows, s)


def quantize_act_groups_triton(x2: torch.Tensor, m_pad: int | None = None, k_pad: int | None = None, *,
                               store_f32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] (bf16/fp16/fp32) -> (codes float8_e4m3fn [m_pad, k_pad], scales float32 [k_pad/128, m_pad]).

    m_pad: rows of the output, a multiple of ``BLOCK_M`` >= M (default: M rounded up to BLOCK_M).
    k_pad: columns, a multiple of 128 >= K (default: K rounded up to 128).
    ``codes[:M, :K]`` and ``scales.t()[:M]`` equal ``quantize_act_groups(x2)`` bitwise.
    store_f32: return the clamped float32 values instead of their FP8 codes (interpreter tests).
    """
    if x2.dim() != 2 or not x2.is_floating_point() or x2.dtype == FP8_DTYPE:
        raise ValueError(f"expected a 2-D floating-point [M, K] tensor, got {x2.dtype} {tuple(x2.shape)}")
    m, k = x2.shape
    m_pad = -(-m // BLOCK_M) * BLOCK_M if m_pad is None else m_pad
    k_pad = -(-k // BLOCK) * BLOCK if k_pad is None else k_pad
    if m_pad < m or m_pad % BLOCK_M or k_pad < k or k_pad % BLOCK:
        raise ValueError(f"m_pad={m_pad} (multiple of {BLOCK_M}, >= {m}), k_pad={k_pad} (multiple of {BLOCK}, >= {k})")
    q = torch.empty((m_pad, k_pad), device=x2.device, dtype=torch.float32 if store_f32 else FP8_DTYPE)
    s = torch.empty((k_pad // BLOCK, m_pad), device=x2.device, dtype=torch.float32)
    grid = (m_pad // BLOCK_M, k_pad // BLOCK)
    _act_quant_kernel[grid](x2, q, s, m, k, x2.stride(0), x2.stride(1), q.stride(0), s.stride(0),
                            EPS, FP8_MAX, GROUP=BLOCK, BLOCK_M=BLOCK_M, STORE_F32=store_f32)
    return q, s
