"""Triton backend of ``parity.logprobs``: fused lm_head + log-softmax tiles for CUDA.

Same contract as the chunked torch implementation in ``parity/logprobs.py`` (which stays
the CPU path and the reference): per-token log-probs, optional entropy, temperature,
logit softcap and scale, bias, float32/bfloat16/float16 inputs with float32 statistics.
``parity.logprobs._backend_for`` picks this module for CUDA tensors; on CPU tensors it
runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is
imported, since ``@triton.jit`` reads it when the kernels are defined), which is how the
tests check it without a GPU.

Forward (one kernel, no [N, V] tensor anywhere): a program owns ``BLOCK_M`` rows and one
contiguous slice of the vocabulary; it walks that slice in ``BLOCK_V`` blocks, each a
``tl.dot`` over ``BLOCK_K`` slices of the hidden size, and keeps an online log-sum-exp
(running max m, sum s = sum e^(z-m)) plus, for the entropy, t = sum e^(z-m) (z-m),
rescaled as the max grows: t' = e^(m-m') (t + (m-m') s). The target logits (or the k
top-k ids of ``gather_logprobs``) are picked out of the tile that holds them. Splitting
the vocabulary across programs keeps every SM busy when N is small; the [splits, N]
partial statistics are merged by a few torch ops (O(N) work).

Backward (row chunks of C rows): a second kernel recomputes each [BLOCK_M, BLOCK_V]
logits tile with ``tl.dot`` from the saved log-sum-exp and writes d loss / d logits for
the chunk, in the input dtype, into a reused [C, V] buffer; cuBLAS then makes
grad_hidden = dlogits @ W (complete for the chunk: each chunk spans the whole vocabulary,
so grad_hidden is written once, never accumulated) and, on the full path only,
grad_weight += dlogits^T @ hidden. The two big reductions go to cuBLAS rather than
``tl.atomic_add`` because every (row block, vocabulary block) tile contributes a full
[BLOCK_M, H] slab to grad_hidden and a [BLOCK_V, H] slab to grad_weight: with atomics
that is N * H * V / BLOCK_V float adds to global memory per gradient (~7e10 at N = 16k,
H = 3584, V = 152k), against one tensor-core GEMM per chunk that reduces in registers.
The bias gradient is small ([V]) and is summed in the kernel with one atomic add per
column and row block. Matmul work: forward 1, backward 2 (frozen lm_head) or 3 (full).

Frozen lm_head (gradient to hidden only, no differentiable entropy): as on the torch
path, the forward also computes G = d logprob / d hidden and the backward is G * g_lp
(exact for any per-token upstream gradient: row i of grad_hidden depends only on g_lp[i]).
Per row chunk, cuBLAS writes the input-dtype logits into the [C, V] buffer, one program
per row (``_row_grad_kernel``) reads them twice -- online statistics, then p -- and
overwrites them with d logprob / d logits, and cuBLAS makes G = dlogits @ W: 2 GEMMs in
all, where the recompute-in-the-backward path above costs 3. Without a gradient the
fused forward kernel is used (1 GEMM, no buffer).

Logits are rounded to the input dtype after the dot (then widened to float32) because
that is what the torch path and the engines do (a bf16 GEMM writes bf16 logits), so the
two backends agree to the GEMM's summation order rather than to bf16 rounding.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

__all__ = ["Tiles", "TritonLogProbs", "fused_logprobs_triton", "gather_logprobs_triton", "supports"]

# Large negative stand-in for -inf, as the running max's start and as the logit of columns
# past the vocabulary: e^(m - m'), (m - m') * s and e^z * z must come out 0, where -inf
# would give NaN (-inf * 0).
_NEG_BIG = tl.constexpr(-1.0e30)


class Tiles(NamedTuple):
    """Kernel tile shape and launch options."""

    block_m: int
    block_v: int
    block_k: int
    num_warps: int
    num_stages: int


# H100-class GPUs: 128 x 128 output tiles with 64-wide K steps keep the tensor cores fed
# (the shape Triton's matmul tutorial and both public fused-CE kernels settle on for
# bf16); 8 warps cover a 128 x 128 float32 accumulator without spilling. Three stages of
# bf16 operands take 96 KiB of shared memory; float32 operands halve K to stay as small.
CUDA_TILES = Tiles(block_m=128, block_v=128, block_k=64, num_warps=8, num_stages=3)
CUDA_TILES_FP32 = CUDA_TILES._replace(block_k=32)
# The interpreter runs numpy per tile: small tiles keep tests fast and make small shapes
# ragged in every direction (tl.dot needs dimensions >= 16).
INTERPRETER_TILES = Tiles(block_m=16, block_v=16, block_k=16, num_warps=1, num_stages=1)

# The frozen path's row kernel: one program per row walks the vocabulary in 2048-wide
# vectors (8 warps x 32 lanes x 8 elements: 16-byte bf16 loads, no register spill).
ROW_BLOCK, ROW_WARPS = 2048, 8

# Rows per backward chunk on CUDA: the [C, V] dlogits buffer in the input dtype. 1024 rows
# is where the torch path's GEMMs reached full rate on an H100 (issue 25: chunk_size=1024);
# free memory caps it (a quarter of what is free) so the buffer never crowds the model out.
CUDA_CHUNK_ROWS = 1024


def supports(dtype: torch.dtype) -> bool:
    """Input dtypes the kernels handle (float64 stays on the torch path)."""
    return dtype in (torch.float32, torch.bfloat16, torch.float16)


def tiles_for(device: torch.device, dtype: torch.dtype) -> Tiles:
    if device.type != "cuda":
        return INTERPRETER_TILES
    return CUDA_TILES_FP32 if dtype == torch.float32 else CUDA_TILES


# ----------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # tl has no tanh in every backend (the interpreter included); this form saturates to
    # +-1 without overflow: e^(-2|x|) is in (0, 1].
    e = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -y, y)


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, n_rows, vocab, hidden_size, stride_h, stride_w,
                 mult, cap, HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    """(z, dz/du) for a [BLOCK_M, BLOCK_V] tile; z = mult * softcap(h w^T + b), _NEG_BIG outside the vocabulary."""
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < n_rows
    col_ok = cols < vocab
    # 64-bit offsets: V * H passes 2^31 for large heads (128k x 16k).
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    for k0 in range(0, hidden_size, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < hidden_size
        h = tl.load(h_rows + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PRECISION)
    # Round to the input dtype as a GEMM writing input-dtype logits would (module docstring).
    u = acc.to(w_ptr.dtype.element_ty).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dcap = tl.full((BLOCK_M, BLOCK_V), 1.0, tl.float32)
    if HAS_CAP:
        th = _tanh(u / cap)
        u = cap * th
        dcap = 1.0 - th * th
    z = tl.where(col_ok[None, :], u * mult, _NEG_BIG)
    return z, dcap * mult


@triton.jit
def _forward_kernel(h_ptr, w_ptr, b_ptr, ids_ptr, m_ptr, s_ptr, t_ptr, zid_ptr,
                    n_rows, vocab, hidden_size, stride_h, stride_w, span, mult, cap,
                    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, WANT_T: tl.constexpr, N_IDS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Online (max, sum e^(z-max), sum e^(z-max)(z-max)) over one vocabulary slice; picks the ids' logits."""
    # Row blocks vary fastest across program ids, so programs in flight share the same
    # weight slice in L2 while each streams it once.
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    v_start = pid_s * span
    v_end = tl.minimum(vocab, v_start + span)
    m = tl.full((BLOCK_M,), _NEG_BIG, tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    t = tl.zeros((BLOCK_M,), tl.float32)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z, _ = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, n_rows, vocab, hidden_size, stride_h, stride_w,
                            mult, cap, HAS_BIAS, HAS_CAP, BLOCK_M, BLOCK_V, BLOCK_K, PRECISION)
        m_new = tl.maximum(m, tl.max(z, 1))
        scale = tl.exp(m - m_new)
        zc = z - m_new[:, None]
        e = tl.exp(zc)  # 0 outside the vocabulary
        if WANT_T:
            t = scale * (t + (m - m_new) * s) + tl.sum(e * zc, 1)
        s = s * scale + tl.sum(e, 1)
        m = m_new
        for j in tl.static_range(N_IDS):
            idj = tl.load(ids_ptr + rows * N_IDS + j, mask=row_ok, other=-1)
            hit = cols[None, :] == idj[:, None]
            zj = tl.sum(tl.where(hit, z, 0.0), 1)
            in_tile = row_ok & (idj >= v0) & (idj < v0 + BLOCK_V)
            tl.store(zid_ptr + rows * N_IDS + j, zj, mask=in_tile)
    out = pid_s * n_rows + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    if WANT_T:
        tl.store(t_ptr + out, t, mask=row_ok)


@triton.jit
def _backward_kernel(h_ptr, w_ptr, b_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dl_ptr, gb_ptr,
                     n_rows, vocab, hidden_size, stride_h, stride_w, stride_dl, mult, cap,
                     HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, HAS_ENT: tl.constexpr,
                     BIAS_GRAD: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    """dl[r, v] = d(sum g_lp * logprob + g_ent * entropy) / d u[r, v] for one recomputed tile."""
    pid_m = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < n_rows
    col_ok = cols < vocab
    z, dzdu = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, n_rows, vocab, hidden_size, stride_h, stride_w,
                           mult, cap, HAS_BIAS, HAS_CAP, BLOCK_M, BLOCK_V, BLOCK_K, PRECISION)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    glp = tl.load(glp_ptr + rows, mask=row_ok, other=0.0)
    logp = z - lse[:, None]
    p = tl.exp(logp)
    # d logprob / dz = onehot - p;  d entropy / dz = -p (log p + entropy)
    coef = glp[:, None] + tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
    if HAS_ENT:
        ent = tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        gent = tl.load(gent_ptr + rows, mask=row_ok, other=0.0)
        coef += gent[:, None] * (logp + ent[:, None])
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    dz = tl.where(cols[None, :] == tgt[:, None], glp[:, None], 0.0) - p * coef
    ok = row_ok[:, None] & col_ok[None, :]
    du = tl.where(ok, dz * dzdu, 0.0)
    tl.store(dl_ptr + rows.to(tl.int64)[:, None] * stride_dl + cols[None, :], du.to(dl_ptr.dtype.element_ty), mask=ok)
    if BIAS_GRAD:
        tl.atomic_add(gb_ptr + cols, tl.sum(du, 0), mask=col_ok)


@triton.jit
def _row_grad_kernel(z_ptr, b_ptr, tgt_ptr, lse_ptr, ent_ptr, zt_ptr, vocab, stride_z, mult, cap,
                     HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, WANT_T: tl.constexpr, BLOCK: tl.constexpr):
    """One row of input-dtype logits u: its statistics, then u overwritten with d logprob / du = (onehot - p) dz/du."""
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    tgt = tl.load(tgt_ptr + row)
    m = tl.full((BLOCK,), _NEG_BIG, tl.float32)  # per-lane online statistics, merged after the loop
    s = tl.zeros((BLOCK,), tl.float32)
    t = tl.zeros((BLOCK,), tl.float32)
    zt = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, vocab, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        ok = cols < vocab
        u = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            u += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_CAP:
            u = cap * _tanh(u / cap)
        z = tl.where(ok, u * mult, _NEG_BIG)
        m_new = tl.maximum(m, z)
        scale = tl.exp(m - m_new)
        zc = z - m_new
        e = tl.exp(zc)
        if WANT_T:
            t = scale * (t + (m - m_new) * s) + e * zc
        s = s * scale + e
        m = m_new
        zt += tl.where(cols == tgt, z, 0.0)
    big_m = tl.max(m, 0)
    w = tl.exp(m - big_m)
    big_s = tl.sum(w * s, 0)
    lse = big_m + tl.log(big_s)
    tl.store(lse_ptr + row, lse)
    tl.store(zt_ptr + row, tl.sum(zt, 0))
    if WANT_T:
        big_t = tl.sum(w * (t + (m - big_m) * s), 0)
        tl.store(ent_ptr + row, tl.log(big_s) - big_t / big_s)
    for v0 in range(0, vocab, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        ok = cols < vocab
        u = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:
            u += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        dzdu = tl.full((BLOCK,), 1.0, tl.float32) * mult
        if HAS_CAP:
            th = _tanh(u / cap)
            u = cap * th
            dzdu = dzdu * (1.0 - th * th)
        p = tl.exp(u * mult - lse)
        g = (tl.where(cols == tgt, 1.0, 0.0) - p) * dzdu
        tl.store(base + cols, g.to(z_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    # float32 GEMMs stay IEEE (torch's default for matmuls; TF32 would cost ~1e-3 relative).
    return "ieee" if dtype == torch.float32 else "tf32"


def _vocab_splits(row_blocks: int, vocab_blocks: int, device: torch.device) -> int:
    """Vocabulary slices per row block in the forward: enough programs for two waves of SMs."""
    if device.type != "cuda":
        return min(vocab_blocks, 2)  # the interpreter: exercise the merge, keep it cheap
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(vocab_blocks, math.ceil(2 * sms / row_blocks)))


def _chunk_rows(n: int, vocab: int, itemsize: int, device: torch.device, block_m: int) -> int:
    """Rows per backward chunk: ``CUDA_CHUNK_ROWS``, fewer if the dlogits buffer would exceed 1/4 of free memory."""
    if device.type != "cuda":
        return n
    free, _ = torch.cuda.mem_get_info(device)
    fit = free // 4 // (vocab * itemsize)
    rows = min(CUDA_CHUNK_ROWS, max(block_m, fit - fit % block_m))
    return min(n, rows)


def _rowmajor(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward_stats(hidden, weight, bias, ids, mult, cap, want_entropy) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """(lse [N], entropy [N] or None, logits of ``ids`` [N, k]), all float32."""
    hidden, weight, ids = _rowmajor(hidden), _rowmajor(weight), ids.contiguous()
    n, hsize = hidden.shape
    vocab, k = weight.shape[0], ids.shape[1]
    tl_ = tiles_for(hidden.device, hidden.dtype)
    row_blocks = triton.cdiv(n, tl_.block_m)
    vocab_blocks = triton.cdiv(vocab, tl_.block_v)
    splits = _vocab_splits(row_blocks, vocab_blocks, hidden.device)
    span = triton.cdiv(vocab_blocks, splits) * tl_.block_v
    splits = triton.cdiv(vocab, span)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    m, s = torch.empty(splits, n, **f32), torch.empty(splits, n, **f32)
    t = torch.empty(splits, n, **f32) if want_entropy else m
    zid = torch.empty(n, k, **f32)
    _forward_kernel[(row_blocks, splits)](
        hidden, weight, bias if bias is not None else hidden, ids, m, s, t, zid,
        n, vocab, hsize, hidden.stride(0), weight.stride(0), span, float(mult), float(cap or 1.0),
        HAS_BIAS=bias is not None, HAS_CAP=cap is not None, WANT_T=bool(want_entropy), N_IDS=k,
        BLOCK_M=tl_.block_m, BLOCK_V=tl_.block_v, BLOCK_K=tl_.block_k, PRECISION=_precision(hidden.dtype),
        num_warps=tl_.num_warps, num_stages=tl_.num_stages,
    )
    # Merge the slices: rescale each slice's sums to the global max M.
    big_m = m.amax(0)
    w = torch.exp(m - big_m)
    big_s = (w * s).sum(0)
    lse = big_m + torch.log(big_s)
    ent = None
    if want_entropy:
        # entropy = lse - sum p z = log S - T / S with T = sum e^(z-M) (z-M)
        big_t = (w * (t + (m - big_m) * s)).sum(0)
        ent = torch.log(big_s) - big_t / big_s
    return lse, ent, zid


def _forward_frozen(hidden, weight, bias, targets, mult, cap, want_entropy, chunk):
    """(logprob, lse, entropy or None, G = d logprob / d hidden in the input dtype) for the frozen-lm_head path."""
    hidden, weight = _rowmajor(hidden), _rowmajor(weight)
    n, hsize = hidden.shape
    vocab = weight.shape[0]
    tl_ = tiles_for(hidden.device, hidden.dtype)
    rows = min(n, chunk) if chunk else _chunk_rows(n, vocab, hidden.element_size(), hidden.device, tl_.block_m)
    buf = torch.empty(rows, vocab, dtype=hidden.dtype, device=hidden.device)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    lse, zt = torch.empty(n, **f32), torch.empty(n, **f32)
    ent = torch.empty(n, **f32) if want_entropy else None
    grad = torch.empty_like(hidden)
    block = ROW_BLOCK if hidden.is_cuda else INTERPRETER_TILES.block_v
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        z = buf[: r1 - r0]
        torch.mm(hidden[r0:r1], weight.T, out=z)
        _row_grad_kernel[(r1 - r0,)](
            z, bias if bias is not None else z, targets[r0:r1], lse[r0:r1], ent[r0:r1] if want_entropy else lse,
            zt[r0:r1], vocab, z.stride(0), float(mult), float(cap or 1.0),
            HAS_BIAS=bias is not None, HAS_CAP=cap is not None, WANT_T=bool(want_entropy), BLOCK=block,
            num_warps=ROW_WARPS if hidden.is_cuda else 1,
        )
        torch.mm(z, weight, out=grad[r0:r1])
    return zt - lse, lse, ent, grad


def _backward_grads(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, mult, cap, need, chunk):
    """(grad_hidden, grad_weight, grad_bias), each None unless ``need`` says so."""
    need_h, need_w, need_b = need
    hidden, weight = _rowmajor(hidden), _rowmajor(weight)
    n, hsize = hidden.shape
    vocab = weight.shape[0]
    tl_ = tiles_for(hidden.device, hidden.dtype)
    rows = min(n, chunk) if chunk else _chunk_rows(n, vocab, hidden.element_size(), hidden.device, tl_.block_m)
    buf = torch.empty(rows, vocab, dtype=hidden.dtype, device=hidden.device)
    g_lp = g_lp.contiguous() if g_lp is not None else torch.zeros_like(lse)
    has_ent = g_ent is not None
    gh = torch.empty_like(hidden) if need_h else None
    gw = torch.empty_like(weight) if need_w else None
    gb = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if need_b else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        dl = buf[: r1 - r0]
        h = hidden[r0:r1]
        grid = (triton.cdiv(r1 - r0, tl_.block_m), triton.cdiv(vocab, tl_.block_v))
        _backward_kernel[grid](
            h, weight, bias if bias is not None else hidden, targets[r0:r1], lse[r0:r1],
            ent[r0:r1] if has_ent else lse, g_lp[r0:r1], g_ent[r0:r1] if has_ent else lse, dl,
            gb if need_b else lse,
            r1 - r0, vocab, hsize, hidden.stride(0), weight.stride(0), dl.stride(0), float(mult), float(cap or 1.0),
            HAS_BIAS=bias is not None, HAS_CAP=cap is not None, HAS_ENT=has_ent, BIAS_GRAD=bool(need_b),
            BLOCK_M=tl_.block_m, BLOCK_V=tl_.block_v, BLOCK_K=tl_.block_k, PRECISION=_precision(hidden.dtype),
            num_warps=tl_.num_warps, num_stages=tl_.num_stages,
        )
        if need_h:
            torch.mm(dl, weight, out=gh[r0:r1])
        if need_w and r0 == 0:
            torch.mm(dl.T, h, out=gw)
        elif need_w:
            gw.addmm_(dl.T, h)
    return gh, gw, (gb.to(bias.dtype) if need_b else None)


class TritonLogProbs(torch.autograd.Function):
    """``parity.logprobs``'s backend contract: apply(hidden, weight, bias, targets, xf, want_entropy,
    entropy_grad, chunk, vblock, precompute) with flat, all-valid rows; returns (logprob, entropy).

    ``vblock`` and ``precompute`` belong to the torch path's tiling and are ignored here.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, xf, want_entropy, entropy_grad, chunk, vblock, precompute):
        del vblock
        tgt = targets.to(torch.int32)
        grad = None
        if precompute:
            lp, lse, ent, grad = _forward_frozen(hidden, weight, bias, tgt, xf.mult, xf.cap, want_entropy, chunk)
        else:
            lse, ent, zid = _forward_stats(hidden, weight, bias, tgt.reshape(-1, 1), xf.mult, xf.cap, want_entropy)
            lp = zid[:, 0] - lse
        keep_ent = ent if (want_entropy and entropy_grad) else None
        if precompute:  # the backward needs G alone
            ctx.save_for_backward(None, None, None, None, None, None, grad)
        else:
            ctx.save_for_backward(hidden, weight, bias, tgt, lse, keep_ent, None)
        ctx.xf, ctx.chunk, ctx.precompute = xf, chunk, precompute
        ctx.set_materialize_grads(False)
        if ent is None:
            ent = torch.zeros(0, dtype=lp.dtype, device=lp.device)
        if keep_ent is None:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, targets, lse, ent, grad = ctx.saved_tensors
        none = (None,) * 7
        if ent is None:
            g_ent = None
        if g_lp is None and g_ent is None:
            return (None, None, None) + none
        if ctx.precompute:
            return ((grad.float() * g_lp.float().unsqueeze(1)).to(grad.dtype), None, None) + none
        gh, gw, gb = _backward_grads(
            hidden, weight, bias, targets, lse, ent,
            g_lp.float() if g_lp is not None else None, g_ent.float().contiguous() if g_ent is not None else None,
            ctx.xf.mult, ctx.xf.cap, ctx.needs_input_grad[:3], ctx.chunk,
        )
        return (gh, gw, gb) + none


def fused_logprobs_triton(hidden, weight, targets, *, bias=None, temperature=1.0, return_entropy=False,
                          entropy_grad=True, chunk_size=None, logit_softcap=None, logit_scale=1.0):
    """The Triton kernels called directly on flat, all-valid inputs: hidden [N, H], targets [N] in [0, V).

    For tests under the interpreter (``parity.logprobs.fused_logprobs`` routes CPU tensors to
    the torch path); no validation beyond what the kernels need. Returns (logprob, entropy or None).
    The frozen-lm_head path is chosen as ``fused_logprobs`` chooses it.
    """
    xf = _Xf(logit_scale / temperature, logit_softcap)
    entropy_grad = bool(return_entropy and entropy_grad)
    precompute = (torch.is_grad_enabled() and hidden.requires_grad and not weight.requires_grad
                  and not (bias is not None and bias.requires_grad) and not entropy_grad)
    lp, ent = TritonLogProbs.apply(hidden, weight, bias, targets, xf, bool(return_entropy), entropy_grad,
                                    chunk_size or 0, 0, precompute)
    return lp, (ent if return_entropy else None)


class _Xf(NamedTuple):
    mult: float
    cap: Optional[float]


@torch.no_grad()
def gather_logprobs_triton(hidden, weight, ids, *, bias=None, temperature=1.0, logit_softcap=None, logit_scale=1.0):
    """log softmax(z)[ids] for flat hidden [N, H] and ids [N, k] (the top-k metric's gather), float32.

    The ids' logits come from the same tiles as the log-sum-exp, so a token's value here
    equals what ``fused_logprobs_triton`` gives it as a target.
    """
    lse, _, zid = _forward_stats(hidden, weight, bias, ids.to(torch.int32), logit_scale / temperature,
                                 logit_softcap, want_entropy=False)
    return zid - lse[:, None]
