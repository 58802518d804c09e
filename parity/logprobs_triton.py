"""Triton backend of ``parity.logprobs``: fused lm_head + log-softmax tiles for CUDA.

Same contract as the chunked torch implementation in ``parity/logprobs/torch_path.py`` (which stays
the CPU path and the reference): per-token log-probs, optional entropy, temperature,
logit softcap and scale, bias, float32/bfloat16/float16 inputs with float32 statistics.
``parity.logprobs.dispatch._backend_for`` picks this module for CUDA tensors; on CPU tensors it
runs only under Triton's interpreter (``TRITON_INTERPRET=1`` set before this module is
imported, since ``@triton.jit`` reads it when the kernels are defined), which is how the
tests check it without a GPU. ``tests/parity/test_triton_compile.py`` compiles every
kernel variant for sm_90 on a CPU (Triton's bundled ptxas) and prints registers and spills.

Values (one kernel, no [N, V] tensor anywhere): a program owns ``BLOCK_M`` rows and one
contiguous slice of the vocabulary; it walks that slice in ``BLOCK_V`` blocks, each a
``tl.dot`` over ``BLOCK_K`` slices of the hidden size, and keeps an online log-sum-exp
(running max m, sum s = sum e^(z-m)) plus, for the entropy, t = sum e^(z-m) (z-m),
rescaled as the max grows: t' = e^(m-m') (t + (m-m') s). The target's logit is picked out
of the tile that holds it. The [splits, N] partial statistics are merged by a few torch
ops (O(N) work).

Launch order (``launch_plan``): every vocabulary tile re-reads its program's [BLOCK_M, H]
hidden slab, so the slabs of the programs in flight must stay in L2. Programs are grouped
as in Triton's matmul tutorial: ``group_m`` row blocks (as many slabs as fit in half the
L2) times all vocabulary slices, the row block varying fastest inside a group, so the
~SM-count programs running at once share a few slabs and each weight tile is read by
``group_m`` programs close together in time. With the row block varying fastest over the
whole grid, ~N/BLOCK_M slabs would be in flight (117 MB at N = 16384, H = 3584, over an
H100's 50 MB L2) and the hidden states re-read from HBM for every vocabulary tile
(~139 GB). The number of slices is chosen so that a wave of programs
spans at most one group and the grid fills whole waves of SMs where it can.

Gathering k given ids per row (``gather_logprobs_triton``, the top-k metric and the
architecture probe at load, which asks for every vocabulary id): the log-sum-exp comes
from the values kernel; the ids' logits from a batched product of each row with its k
weight rows (or, when k is a large share of the vocabulary, from row chunks of the full
logits). Nothing is unrolled per id: a kernel specialised on k takes 127 s to compile for
sm_90 at k = 512 and does not finish at the vocabulary size (k = 151,936).

Backward, full path (gradients for the lm_head weight or bias, or a differentiable
entropy), per row chunk of C rows: cuBLAS writes the chunk's logits u = h W^T into a
reused [C, V] input-dtype buffer; one program per row (``_row_backward_kernel``)
overwrites them with d loss / d u from the saved log-sum-exp (and entropy); cuBLAS then
makes grad_hidden = du @ W (complete for the chunk) and the chunk's share of
grad_weight = du^T @ h, summed over chunks in float32 and rounded to the weight's dtype
once (summing in bf16 cost 4.8e-3 relative error at 16 chunks, 9.3e-3 at 64, against
1.7e-3 in float32); the bias gradient is the float32 column sum of du (no atomics: the
same bits every run, as on the torch path). GEMMs: forward 1, backward 3 -- four in
all, where Liger-Kernel's fused linear cross-entropy takes three by forming both
gradients inside its forward. That shortcut needs the upstream gradient of each token
before the loss is known; it is exact only when that gradient is the same for every row
of a mean-reduced cross-entropy (Liger's ``reduction="none"`` gradient was wrong, issue
linkedin/Liger-Kernel#1298), while this project's losses weight every token by its own
advantage and ratio. The recompute of the logits is the price of exactness for any
per-token upstream gradient with O(N) saved state; it runs in cuBLAS, not in a Triton
``tl.dot``.

Frozen lm_head (gradient to hidden only, no differentiable entropy): as on the torch
path, the forward also computes G = d logprob / d hidden and the backward is G * g_lp
(exact for any per-token upstream gradient: row i of grad_hidden depends only on g_lp[i]).
Per row chunk, cuBLAS writes the input-dtype logits into the [C, V] buffer, one program
per row (``_row_grad_kernel``) reads them twice -- online statistics, then p -- and
overwrites them with d logprob / d logits, and cuBLAS makes G = dlogits @ W: 2 GEMMs in
all. Without a gradient the values kernel is used (1 GEMM, no buffer).

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

__all__ = ["LaunchPlan", "Tiles", "TritonLogProbs", "fused_logprobs_triton", "gather_logprobs_triton", "launch_plan",
           "supports"]

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


# H100-class GPUs: 128 x 128 output tiles keep the tensor cores fed (the shape Triton's matmul
# tutorial and both public fused-CE kernels settle on for bf16), 8 warps for the 128 x 128
# float32 accumulator. K steps of 32, not 64: compiled for sm_90 (tests/parity/test_triton_compile.py,
# every flag on), 64-wide steps used all 255 registers and spilled 88-256 bytes per thread to the stack,
# 32-wide ones need 210 registers and spill nothing. float32 operands go through FMA, not the tensor cores
# (IEEE precision): 16-wide steps spill least there (64 bytes against 256 at 32). Not yet timed on a GPU.
CUDA_TILES = Tiles(block_m=128, block_v=128, block_k=32, num_warps=8, num_stages=4)
CUDA_TILES_FP32 = Tiles(block_m=128, block_v=128, block_k=16, num_warps=8, num_stages=3)
# The interpreter runs numpy per tile: small tiles keep tests fast and make small shapes
# ragged in every direction (tl.dot needs dimensions >= 16).
INTERPRETER_TILES = Tiles(block_m=16, block_v=16, block_k=16, num_warps=1, num_stages=1)

# The row kernels: one program per row walks the vocabulary in 2048-wide vectors
# (8 warps x 32 lanes x 8 elements: 16-byte bf16 loads).
ROW_BLOCK, ROW_WARPS = 2048, 8

# Rows per backward chunk on CUDA: the [C, V] buffer in the input dtype. 1024 rows is where
# the torch path's GEMMs reached full rate on an H100 (issue 25: chunk_size=1024); free
# memory caps it (a quarter of what is free) so the buffer never crowds the model out.
CUDA_CHUNK_ROWS = 1024

# Share of the L2 cache the hidden slabs of one program group may take (the rest holds the
# weight tiles streaming through and everything else).
L2_SHARE_FOR_HIDDEN = 0.5

# Gathering ids: a batched row product reads k weight rows per row; the full logits read
# all V. Past k = V / 8 the product's scattered reads cost more than one GEMM's streamed ones.
GATHER_PRODUCT_MAX_SHARE = 8
# Bytes of gathered weight rows (or of full logits) held at once by the gather.
GATHER_BUDGET_BYTES = 256 * 2**20


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
    """z = mult * softcap(h w^T + b) for a [BLOCK_M, BLOCK_V] tile, _NEG_BIG outside the vocabulary."""
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
    if HAS_CAP:
        u = cap * _tanh(u / cap)
    return tl.where(col_ok[None, :], u * mult, _NEG_BIG)


@triton.jit
def _forward_kernel(h_ptr, w_ptr, b_ptr, tgt_ptr, m_ptr, s_ptr, t_ptr, zt_ptr,
                    n_rows, vocab, hidden_size, stride_h, stride_w, span, row_blocks, splits, group_m, mult, cap,
                    HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, WANT_T: tl.constexpr, HAS_TARGET: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """Online (max, sum e^(z-max), sum e^(z-max)(z-max)) over one vocabulary slice; picks the target's logit."""
    # Grouped order (module docstring): group_m row blocks x every slice, row block fastest.
    pid = tl.program_id(0)
    per_group = group_m * splits
    first_m = (pid // per_group) * group_m
    in_group = tl.minimum(row_blocks - first_m, group_m)
    pid_m = first_m + (pid % per_group) % in_group
    pid_s = (pid % per_group) // in_group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    v_start = pid_s * span
    v_end = tl.minimum(vocab, v_start + span)
    m = tl.full((BLOCK_M,), _NEG_BIG, tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    t = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_TARGET:
        tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
        zt = tl.zeros((BLOCK_M,), tl.float32)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, n_rows, vocab, hidden_size, stride_h, stride_w,
                         mult, cap, HAS_BIAS, HAS_CAP, BLOCK_M, BLOCK_V, BLOCK_K, PRECISION)
        m_new = tl.maximum(m, tl.max(z, 1))
        scale = tl.exp(m - m_new)
        zc = z - m_new[:, None]
        e = tl.exp(zc)  # 0 outside the vocabulary
        if WANT_T:
            t = scale * (t + (m - m_new) * s) + tl.sum(e * zc, 1)
        s = s * scale + tl.sum(e, 1)
        m = m_new
        if HAS_TARGET:
            zt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), 1)
    out = pid_s * n_rows + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    if WANT_T:
        tl.store(t_ptr + out, t, mask=row_ok)
    if HAS_TARGET:
        # Exactly one slice holds each target; the others add 0.
        tl.store(zt_ptr + out, zt, mask=row_ok)


@triton.jit
def _row_logits(base, b_ptr, cols, ok, mult, cap, HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr,
                BLOCK: tl.constexpr):
    """(z = mult * softcap(u + b), dz/du) for one vector of a row of input-dtype logits u at ``base``."""
    u = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    dzdu = tl.full((BLOCK,), 1.0, tl.float32) * mult
    if HAS_CAP:
        th = _tanh(u / cap)
        u = cap * th
        dzdu = dzdu * (1.0 - th * th)
    return u * mult, dzdu


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
        z, _ = _row_logits(base, b_ptr, cols, ok, mult, cap, HAS_BIAS, HAS_CAP, BLOCK)
        z = tl.where(ok, z, _NEG_BIG)
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
        z, dzdu = _row_logits(base, b_ptr, cols, ok, mult, cap, HAS_BIAS, HAS_CAP, BLOCK)
        p = tl.exp(z - lse)
        g = (tl.where(cols == tgt, 1.0, 0.0) - p) * dzdu
        tl.store(base + cols, g.to(z_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _row_backward_kernel(z_ptr, b_ptr, tgt_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, vocab, stride_z, mult, cap,
                         HAS_BIAS: tl.constexpr, HAS_CAP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
    """One row of input-dtype logits u overwritten with d(g_lp logprob + g_ent entropy) / du, from the saved statistics.

    d logprob / dz = onehot - p;  d entropy / dz = -p (log p + entropy);  d / du = dz/du d / dz.
    """
    row = tl.program_id(0)
    base = z_ptr + row.to(tl.int64) * stride_z
    tgt = tl.load(tgt_ptr + row)
    lse = tl.load(lse_ptr + row)
    glp = tl.load(glp_ptr + row)
    if HAS_ENT:
        ent = tl.load(ent_ptr + row)
        gent = tl.load(gent_ptr + row)
    for v0 in range(0, vocab, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        ok = cols < vocab
        z, dzdu = _row_logits(base, b_ptr, cols, ok, mult, cap, HAS_BIAS, HAS_CAP, BLOCK)
        logp = z - lse
        p = tl.exp(logp)
        coef = glp + tl.zeros((BLOCK,), tl.float32)
        if HAS_ENT:
            coef += gent * (logp + ent)
        g = (tl.where(cols == tgt, glp, 0.0) - p * coef) * dzdu
        tl.store(base + cols, g.to(z_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------


def _precision(dtype: torch.dtype) -> str:
    # float32 GEMMs stay IEEE (torch's default for matmuls; TF32 would cost ~1e-3 relative).
    return "ieee" if dtype == torch.float32 else "tf32"


class LaunchPlan(NamedTuple):
    """The values kernel's grid: ``splits`` vocabulary slices of ``span`` entries, ``group_m`` row blocks a group."""

    splits: int
    span: int
    group_m: int
    programs: int


def launch_plan(n_rows: int, vocab: int, hidden_size: int, itemsize: int, tiles: Tiles, *,
                sms: Optional[int], l2_bytes: int = 0) -> LaunchPlan:
    """Slices and grouping for the values kernel (module docstring); ``sms`` None: the interpreter.

    group_m: as many [BLOCK_M, H] hidden slabs as fit in ``L2_SHARE_FOR_HIDDEN`` of the L2.
    splits: at least enough that one wave of ``sms`` programs spans one group
    (group_m x splits >= sms) and that small N still gives two waves; among up to twice
    that, the count whose grid leaves the least of its last wave idle.
    """
    row_blocks = triton.cdiv(n_rows, tiles.block_m)
    vocab_blocks = triton.cdiv(vocab, tiles.block_v)
    if sms is None:
        # The interpreter: two slices and groups of two row blocks exercise the merge and the order, cheaply.
        group_m, want = min(row_blocks, 2), min(vocab_blocks, 2)
    else:
        slab = tiles.block_m * hidden_size * itemsize
        group_m = int(max(1, min(row_blocks, (l2_bytes * L2_SHARE_FOR_HIDDEN) // max(1, slab))))
        least = max(math.ceil(sms / group_m), math.ceil(2 * sms / row_blocks), 1)
        best = None
        for s in range(min(least, vocab_blocks), min(2 * least, vocab_blocks) + 1):
            span_blocks = triton.cdiv(vocab_blocks, s)
            real = triton.cdiv(vocab_blocks, span_blocks)
            programs = row_blocks * real
            idle = (-programs) % sms / (triton.cdiv(programs, sms) * sms)
            if best is None or idle < best[0] - 1e-9:
                best = (idle, s)
        want = best[1]
    span = triton.cdiv(vocab_blocks, want) * tiles.block_v
    splits = triton.cdiv(vocab, span)
    return LaunchPlan(splits, span, group_m, row_blocks * splits)


def _device_plan(n: int, vocab: int, hidden: torch.Tensor, tiles: Tiles) -> LaunchPlan:
    sms = l2 = None
    if hidden.device.type == "cuda":
        props = torch.cuda.get_device_properties(hidden.device)
        sms, l2 = props.multi_processor_count, getattr(props, "L2_cache_size", 50 * 2**20)
    return launch_plan(n, vocab, hidden.shape[1], hidden.element_size(), tiles, sms=sms, l2_bytes=l2 or 0)


def _chunk_rows(n: int, vocab: int, itemsize: int, device: torch.device, block_m: int) -> int:
    """Rows per backward chunk: ``CUDA_CHUNK_ROWS``, fewer if the [C, V] buffer would exceed 1/4 of free memory."""
    if device.type != "cuda":
        return n
    free, _ = torch.cuda.mem_get_info(device)
    fit = free // 4 // (vocab * itemsize)
    rows = min(CUDA_CHUNK_ROWS, max(block_m, fit - fit % block_m))
    return min(n, rows)


def _rowmajor(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward_stats(hidden, weight, bias, targets, mult, cap, want_entropy
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(lse [N], entropy [N] or None, the targets' logits [N] or None when ``targets`` is None), float32."""
    hidden, weight = _rowmajor(hidden), _rowmajor(weight)
    n, hsize = hidden.shape
    vocab = weight.shape[0]
    tl_ = tiles_for(hidden.device, hidden.dtype)
    plan = _device_plan(n, vocab, hidden, tl_)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    m, s = torch.empty(plan.splits, n, **f32), torch.empty(plan.splits, n, **f32)
    t = torch.empty(plan.splits, n, **f32) if want_entropy else m
    zt = torch.empty(plan.splits, n, **f32) if targets is not None else m
    _forward_kernel[(plan.programs,)](
        hidden, weight, bias if bias is not None else hidden, targets if targets is not None else m, m, s, t, zt,
        n, vocab, hsize, hidden.stride(0), weight.stride(0), plan.span, triton.cdiv(n, tl_.block_m), plan.splits,
        plan.group_m, float(mult), float(cap or 1.0),
        HAS_BIAS=bias is not None, HAS_CAP=cap is not None, WANT_T=bool(want_entropy), HAS_TARGET=targets is not None,
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
    return lse, ent, (zt.sum(0) if targets is not None else None)


def _ids_logits(hidden, weight, bias, ids, mult, cap) -> torch.Tensor:
    """float32 z = mult * softcap(h w^T + b) at ``ids`` [N, k]: the product in the input dtype (logits rounded to it,
    as the values kernel rounds its tiles), the transform in float32; memory bounded by ``GATHER_BUDGET_BYTES``."""
    n, k = ids.shape
    vocab, hsize = weight.shape
    item = hidden.element_size()
    out = torch.empty(n, k, dtype=torch.float32, device=hidden.device)
    full = k * GATHER_PRODUCT_MAX_SHARE > vocab
    rows = max(1, GATHER_BUDGET_BYTES // (item * (vocab if full else k * hsize)))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        sel = ids[r0:r1]
        if full:
            u = torch.mm(hidden[r0:r1], weight.T).gather(1, sel)
        else:
            u = torch.bmm(weight[sel], hidden[r0:r1, :, None]).squeeze(2)  # [c, k, H] @ [c, H, 1]
        out[r0:r1] = u
    if bias is not None:
        out += bias.float()[ids]
    if cap is not None:
        out = cap * torch.tanh(out / cap)
    return out * mult


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


def _add_weight_grad(acc: torch.Tensor, du: torch.Tensor, h: torch.Tensor, stage: torch.Tensor) -> None:
    """acc (float32 [V, H]) += du^T h, the product made in the input dtype one vocabulary block of ``stage`` at a time
    (so the extra memory is one block, not a second [V, H]) and added in float32."""
    step = stage.shape[0]
    for v0 in range(0, acc.shape[0], step):
        v1 = min(acc.shape[0], v0 + step)
        acc[v0:v1] += torch.mm(du[:, v0:v1].T, h, out=stage[: v1 - v0])


def _backward_grads(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, mult, cap, need, chunk):
    """(grad_hidden, grad_weight, grad_bias), each None unless ``need`` says so (module docstring: full path)."""
    need_h, need_w, need_b = need
    hidden, weight = _rowmajor(hidden), _rowmajor(weight)
    n, hsize = hidden.shape
    vocab = weight.shape[0]
    tl_ = tiles_for(hidden.device, hidden.dtype)
    rows = min(n, chunk) if chunk else _chunk_rows(n, vocab, hidden.element_size(), hidden.device, tl_.block_m)
    one_chunk = rows >= n
    buf = torch.empty(rows, vocab, dtype=hidden.dtype, device=hidden.device)
    g_lp = g_lp.contiguous() if g_lp is not None else torch.zeros_like(lse)
    has_ent = g_ent is not None
    gh = torch.empty_like(hidden) if need_h else None
    gw = torch.empty_like(weight) if need_w else None
    gw32 = torch.zeros(vocab, hsize, dtype=torch.float32, device=hidden.device) if need_w and not one_chunk else None
    stage = torch.empty(min(vocab, max(1, CUDA_CHUNK_ROWS * 8)), hsize, dtype=hidden.dtype,
                        device=hidden.device) if gw32 is not None else None
    gb = torch.zeros(vocab, dtype=torch.float32, device=hidden.device) if need_b else None
    block = ROW_BLOCK if hidden.is_cuda else INTERPRETER_TILES.block_v
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        du = buf[: r1 - r0]
        h = hidden[r0:r1]
        torch.mm(h, weight.T, out=du)
        _row_backward_kernel[(r1 - r0,)](
            du, bias if bias is not None else du, targets[r0:r1], lse[r0:r1], ent[r0:r1] if has_ent else lse,
            g_lp[r0:r1], g_ent[r0:r1] if has_ent else lse, vocab, du.stride(0), float(mult), float(cap or 1.0),
            HAS_BIAS=bias is not None, HAS_CAP=cap is not None, HAS_ENT=has_ent, BLOCK=block,
            num_warps=ROW_WARPS if hidden.is_cuda else 1,
        )
        if need_h:
            torch.mm(du, weight, out=gh[r0:r1])
        if need_w and one_chunk:
            torch.mm(du.T, h, out=gw)
        elif need_w:
            _add_weight_grad(gw32, du, h, stage)
        if need_b:
            gb += du.sum(0, dtype=torch.float32)
    if gw32 is not None:
        gw.copy_(gw32)
    return gh, gw, (gb.to(bias.dtype) if need_b else None)


class TritonLogProbs(torch.autograd.Function):
    """``parity.logprobs``'s backend contract: apply(hidden, weight, bias, targets, xf, want_entropy,
    entropy_grad, chunk, vblock, precompute) with flat, all-valid rows; returns (logprob, entropy).

    ``vblock`` belongs to the torch path's tiling and is ignored here.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, xf, want_entropy, entropy_grad, chunk, vblock, precompute):
        del vblock
        tgt = targets.to(torch.int32)
        grad = None
        if precompute:
            lp, lse, ent, grad = _forward_frozen(hidden, weight, bias, tgt, xf.mult, xf.cap, want_entropy, chunk)
        else:
            lse, ent, zt = _forward_stats(hidden, weight, bias, tgt, xf.mult, xf.cap, want_entropy)
            lp = zt - lse
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
    """log softmax(z)[ids] for flat hidden [N, H] and ids [N, k] (module docstring: gathering ids), float32.

    The log-sum-exp is the values kernel's; the ids' logits are rounded to the input dtype as its
    tiles are, so a token's value here agrees with ``fused_logprobs_triton``'s to the GEMM's
    summation order (not bit for bit: another product computes them).
    """
    hidden, weight = _rowmajor(hidden), _rowmajor(weight)
    mult = logit_scale / temperature
    lse, _, _ = _forward_stats(hidden, weight, bias, None, mult, logit_softcap, want_entropy=False)
    return _ids_logits(hidden, weight, bias, ids.long(), mult, logit_softcap) - lse[:, None]
