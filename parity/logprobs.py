"""Chunked fused lm_head + log-softmax: per-token log-probs (and entropy) without [N, V] logits.

The trainer needs, for every sampled token, ``log softmax((h @ W.T + b) / T)[target]`` and
often the entropy of the same distribution. Materialising the [N, V] logits costs
N * V * (2 + 4 + 4) bytes in bf16 (logits, their float32 copy, the saved log-softmax),
e.g. 1.3 GB for 4096 tokens x 32k vocab, several GB for 128k vocabularies. This module
computes the same numbers in tiles:

* forward: row chunks of ``chunk`` tokens against the full vocabulary; only O(N)
  statistics survive the chunk (log-sum-exp, entropy);
* backward: tiles of ``chunk`` rows x ``vocab_block`` vocabulary entries; the logits
  are recomputed from ``hidden`` and ``weight`` and the softmax is rebuilt from the
  saved log-sum-exp, so each tile is independent. The weight gradient is accumulated
  in float32 for one vocabulary block at a time (``vocab_block x H`` floats) and cast
  to the weight's dtype when the block is done (or, when all rows fit one tile, written
  by a single matmul per block, with no accumulation to do).

Matmuls run in the input dtype (bf16 stays bf16: that is where AVX512-BF16/AMX units
and the GPU's tensor cores are); only the logits tile is upcast, to float32 (float64
for float64 inputs, which gradcheck uses), for log-sum-exp, softmax and entropy.

Cost, in units of one N x H x V matmul: the naive version does 1 forward and 2 backward
(1 backward with a frozen lm_head). Keeping only O(N) state costs one recomputation:
forward 1, backward 3 (recompute, d hidden, d weight) -- 4/3 of the naive matmul work
when the lm_head is trained, partly paid back by never touching [N, V] fresh memory.

Frozen lm_head (LoRA, this project's default): when only ``hidden`` needs a gradient
and no entropy is asked for, the forward also computes G = d logprob / d hidden per row
(one extra matmul while the softmax tile is still at hand; G is [N, H] float32) and the
backward is G scaled by the upstream gradient -- 2 matmuls in total, like the naive
version. This is exact for any upstream gradient because row i of d(hidden) depends only
on row i of the upstream gradient (unlike the weight gradient, which Liger-Kernel
precomputes under a scalar-loss assumption; see linkedin/Liger-Kernel issue #1298).
Callers that only want values should run under ``torch.no_grad()`` so that this extra
matmul is skipped.

Logit transform: some architectures post-process the lm_head output before the softmax
(Gemma2/3's final softcap ``cap * tanh(u / cap)``, Cohere's ``logit_scale``, Granite's
``1 / logits_scaling``). With u = h W^T + b the logits are
``z = scale * softcap(u) / T`` -- softcap first, then scale, the order of vLLM's
``LogitsProcessor._get_logits`` (vllm/model_executor/layers/logits_processor.py); no
architecture uses both. The caller passes the two numbers (``logit_softcap``,
``logit_scale``); this module does not know about model configs. The chain rule adds
dz/du = (scale / T) * (1 - tanh^2(u / cap)), recomputed with the logits in every tile;
with a softcap each pass holds one more float32 tile (the tanh derivative).

Formulas (z = (h W^T + b) / T, p = softmax(z), lse = log sum exp z; with a transform
read d/du = dz/du * d/dz):
  logprob_i   = z_{i,t_i} - lse_i
  entropy_i   = -sum_j p_ij log p_ij = lse_i - sum_j p_ij z_ij
  d logprob_i / d z_ij = 1[j = t_i] - p_ij
  d entropy_i / d z_ij = -p_ij (log p_ij + entropy_i)
  d / d logits = (d / d z) / T

References: Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models"
(arXiv:2411.09009) for the recompute-in-tiles idea; Liger-Kernel's
fused_linear_cross_entropy for the chunked CPU/GPU layout.

Entropy as a by-product: ``entropy_grad=False`` returns the entropy computed in the same
forward pass but detached, so a caller that only logs it keeps the log-prob-only backward
(and, with a frozen lm_head, the precomputed-G shortcut above); with ``entropy_grad=True``
the backward carries the entropy term and recomputes every tile.

Truncated sampling (``support``): with top-k / top-p / min-p the engine samples from the softmax over the set S of
tokens it kept, and reports log-probs normalised over S. Given the engine's S per row (a CSR pair), every
normaliser here is over S instead of the vocabulary: ``lse_S = log sum_{j in S} exp z_j``, ``logprob = z_t - lse_S``,
the entropy is the truncated distribution's, and the gradients replace p by p_S (0 outside S):
``d logprob / d z_j = 1[j = t] - p_S,j``. The logits tile is the one computed anyway; S enters as a boolean tile
of the same shape built from the CSR, so no tensor grows with N x V. The log of the trainer's mass inside S,
``lse_S - lse``, comes from the same tile (``return_kept_logmass``). The support path runs on the chunked torch
implementation on every device (the Triton kernels do not take S).

Backends: ``_backend_for`` picks the implementation from the inputs' device, in one place:
CUDA tensors in float32/bf16/fp16 go to the Triton kernels of ``parity.logprobs_triton``
(when triton imports, and once they have matched this path on a small problem on that device
and dtype: ``_triton_ready``; otherwise a warning says why and this path runs), everything
else to the chunked torch implementation here, which is also the reference the Triton kernels
are tested against. Both take the same
``apply()`` arguments and keep O(N) state between forward and backward. On CUDA the torch
path sizes its tiles from free GPU memory (``_memory_budget``), not the CPU budget.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple, Optional, Tuple

import torch

try:
    from parity import logprobs_triton
except ImportError:  # triton is optional: without it every device uses the torch path
    logprobs_triton = None

__all__ = [
    "IGNORE_INDEX",
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "MIN_CHUNK_ROWS",
    "fused_logprobs",
    "fused_gather_logprobs",
    "naive_logprobs",
]

IGNORE_INDEX = -100

# Memory budget, in bytes of float32 tile. The forward holds one [chunk, V] float32 tile
# (chunk = budget / 4V: 512 rows at V = 32k, 128 at V = 128k) plus its input-dtype twin,
# ~1.5x the budget. The backward tile gets half the budget (see _backward_tile_shape) and
# a float32 weight-gradient accumulator, when one is needed, a quarter. Measured with
# bench/bench_logprobs.py on the 2-core CPU: bf16 matmuls with >= 128 rows run at the
# full rate, and the peak extra memory stays near 1/10 of the naive version's at
# N = 4096, V = 32k (107-166 MiB vs 1033-1547 MiB).
DEFAULT_MEMORY_BUDGET_BYTES = 64 * 2**20

# The torch path's budget on CUDA: 640 MiB of float32 tile is ~1024 rows at V = 152k, the
# chunk at which that path's GEMMs ran at full rate on an H100 (issue 25: 54 ms values /
# 99 ms frozen with chunk_size=1024, against 105 / 196 ms with 96-row tiles from the CPU
# budget); an eighth of free memory caps it, leaving room for the tile's twins (~2.5x).
CUDA_MEMORY_BUDGET_BYTES = 640 * 2**20

# Out-of-memory retries halve the tile down to this many rows (or vocabulary entries)
# and then give up by re-raising: smaller tiles only waste time.
MIN_CHUNK_ROWS = 16

_Result = Tuple[torch.Tensor, Optional[torch.Tensor]]


# ----------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------


def fused_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: Optional[float] = None,
    logit_scale: float = 1.0,
    support: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
    return_kept_logmass: bool = False,
):
    """Log-probs of ``targets`` (and entropy) under softmax((hidden @ weight.T + bias) / T), chunked.

    Args:
        hidden: [N, H] or [B, T, H] last hidden states (float32/bf16/fp16/float64).
        weight: [V, H] lm_head weight, same dtype and device as ``hidden``.
        targets: [N] or [B, T] integer token ids in [0, V), or ``ignore_index``
            (padding / prompt): those positions get log-prob 0, entropy 0 and no gradient,
            and cost no compute.
        bias: optional [V] lm_head bias, added in float32.
        temperature: T > 0; the sampler's temperature, so log-probs match the engine's.
        return_entropy: also return the per-token entropy.
        entropy_grad: with ``return_entropy``, whether the entropy is differentiable. False:
            it comes from the same forward pass, detached, and the backward is the one of
            the log-probs alone (the fast path when the entropy is only logged).
        chunk_size: tokens per tile in both passes; None sizes tiles from
            ``_memory_budget`` (on CPU ``DEFAULT_MEMORY_BUDGET_BYTES``: forward
            ``budget // (4 V)`` rows; backward see ``_backward_tile_shape``); on the Triton
            backend, rows per chunk of the [C, V] buffer that the backward and the frozen-lm_head
            forward use (None: ``parity.logprobs_triton._chunk_rows``).
        vocab_chunk_size: vocabulary entries per backward tile (also bounds the float32
            weight-gradient accumulator to ``vocab_chunk_size x H``); None: automatic.
        ignore_index: target value meaning "no token here".
        logit_softcap: None, or cap > 0: logits become cap * tanh(logits / cap) (module docstring).
        logit_scale: logits are multiplied by this (after the softcap, before 1/T).
        support: None, or the kept sets of a truncated sampler (module docstring) as ``(offsets, ids)``: offsets
            [N + 1] int64 over the flattened positions of ``targets``, ids int [M]; position n's set is
            ``ids[offsets[n]:offsets[n + 1]]``. Every valid target must be in its set; the log-probs, the entropy
            and their gradients are then over that set.
        return_kept_logmass: also return, third, log of the probability mass inside each position's set under the
            full softmax (0 without ``support``, and at ignored positions); no gradient.

    Returns:
        (logprobs, entropy): both shaped like ``targets``, float32 (float64 for float64
        inputs); entropy is None unless ``return_entropy``, and carries no gradient when
        ``entropy_grad`` is False. With ``return_kept_logmass``: (logprobs, entropy, kept_logmass).

    Out of memory in a tile (``torch.OutOfMemoryError``, or a RuntimeError saying "out of
    memory" / "can't allocate memory") halves the tile and redoes the pass with a
    warning, down to ``MIN_CHUNK_ROWS``; below that the error is re-raised.
    """
    flat_h, flat_t, bias, out_shape = _validate(
        hidden, weight, targets, bias, temperature, chunk_size, vocab_chunk_size, ignore_index
    )
    xf = _transform(temperature, logit_softcap, logit_scale)
    n_tokens = flat_t.shape[0]
    compute_dtype = _compute_dtype(hidden.dtype)

    valid = flat_t != ignore_index
    all_valid = bool(valid.all())
    if all_valid:
        rows_h, rows_t = flat_h, flat_t
    else:
        # Padded batches: run the kernel on the valid rows only and scatter back.
        idx = valid.nonzero().squeeze(1)
        rows_h, rows_t = flat_h.index_select(0, idx), flat_t.index_select(0, idx)
    kept_sets = None
    if support is not None:
        kept_sets = _KeptSets.of(support, n_tokens, weight.shape[0], flat_h.device)
        if not all_valid:
            kept_sets = kept_sets.rows(idx)
        kept_sets.check_targets(rows_t)

    entropy_grad = bool(return_entropy and entropy_grad)
    if rows_t.numel() == 0:
        # Still route through hidden/weight (empty slices: free) so that backward() works.
        zero = (flat_h[:0].sum() + weight[:0].sum()).to(compute_dtype)
        lp = zero.expand(n_tokens).clone()
        ent = (lp.clone() if entropy_grad else lp.detach().clone()) if return_entropy else None
        out = (lp.reshape(out_shape), (ent.reshape(out_shape) if ent is not None else None))
        return out + (lp.detach().clone().reshape(out_shape),) if return_kept_logmass else out

    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (rows_h, weight, bias)
    )
    # See module docstring: precompute d logprob / d hidden only when it is the whole backward.
    precompute = (
        needs_grad
        and rows_h.requires_grad
        and not weight.requires_grad
        and not (bias is not None and bias.requires_grad)
        and not entropy_grad
    )
    if kept_sets is not None:  # the support path is the chunked torch one on every device
        lp, ent, kept = _ChunkedLogProbs.apply(
            rows_h, weight, bias, rows_t, xf, bool(return_entropy), entropy_grad,
            chunk_size or 0, vocab_chunk_size or 0, bool(precompute), kept_sets,
        )
    else:
        lp, ent = _backend_for(rows_h).apply(
            rows_h, weight, bias, rows_t, xf, bool(return_entropy), entropy_grad,
            chunk_size or 0, vocab_chunk_size or 0, bool(precompute),
        )
        kept = lp.detach().new_zeros(lp.shape)
    if not return_entropy:
        ent = None
    if not all_valid:
        lp = lp.new_zeros(n_tokens).index_copy(0, idx, lp)
        kept = kept.new_zeros(n_tokens).index_copy(0, idx, kept)
        if ent is not None:
            ent = ent.new_zeros(n_tokens).index_copy(0, idx, ent)
    out = (lp.reshape(out_shape), (ent.reshape(out_shape) if ent is not None else None))
    return out + (kept.reshape(out_shape),) if return_kept_logmass else out


@torch.no_grad()
def fused_gather_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    chunk_size: Optional[int] = None,
    logit_softcap: Optional[float] = None,
    logit_scale: float = 1.0,
) -> torch.Tensor:
    """Log-probs of ``k`` given token ids per row, chunked like ``fused_logprobs``; no gradient.

    Args:
        hidden: [N, H] or [B, T, H]; weight: [V, H]; bias: optional [V].
        ids: [N, k] or [B, T, k] token ids in [0, V) (e.g. the engine's top-k at each position).
    Returns:
        float32 (float64 for float64 inputs) log-probs shaped like ``ids``:
        ``log softmax((hidden @ weight.T + bias) / T)[ids]`` (with the logit transform, as
        ``fused_logprobs``).

    On the torch path the logits tile is computed by the same code as ``fused_logprobs``'s forward
    (``_scaled_logits``, matmul in the input dtype, then float32), so a token's value here equals
    the one ``fused_logprobs`` gives it; on the Triton path the log-sum-exp is the values kernel's
    and the ids' logits come from a batched product rounded the same way (equal to the GEMM's
    summation order; nothing is compiled per k, so k may be the whole vocabulary). Used for the
    top-k KL metric and the architecture probe at load.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != hidden.dim() or ids.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"ids: expected shape {tuple(hidden.shape[:-1])} + (k,), got {tuple(getattr(ids, 'shape', ()))}")
    k = ids.shape[-1]
    flat_h, _, bias, _ = _validate(hidden, weight, ids[..., 0] if k else ids.new_zeros(hidden.shape[:-1]), bias,
                                   temperature, chunk_size, None, IGNORE_INDEX)
    xf = _transform(temperature, logit_softcap, logit_scale)
    flat_ids = ids.reshape(-1, k).long()
    vocab = weight.shape[0]
    if k and bool(((flat_ids < 0) | (flat_ids >= vocab)).any()):
        raise ValueError(f"ids: values outside [0, {vocab})")
    cd = _compute_dtype(hidden.dtype)
    n = flat_h.shape[0]
    out = torch.empty(n, k, dtype=cd, device=hidden.device)
    if n == 0 or k == 0:
        return out.reshape(ids.shape)
    if _backend_for(flat_h) is not _ChunkedLogProbs:
        return logprobs_triton.gather_logprobs_triton(
            flat_h, weight, flat_ids, bias=bias, temperature=temperature, logit_softcap=logit_softcap,
            logit_scale=logit_scale,
        ).reshape(ids.shape)
    rows = min(n, chunk_size or _auto_chunk_rows(vocab, _memory_budget(hidden.device)))
    buf = _Buffers(rows, vocab, weight.shape[1], hidden.dtype, cd, hidden.device, exp=False, grad_h=False, grad_w=False,
                   dcap=False)
    bias_c = bias.to(cd) if bias is not None else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        z, _ = _scaled_logits(flat_h[r0:r1], weight, bias_c, xf, buf)
        out[r0:r1] = z.gather(1, flat_ids[r0:r1]) - torch.logsumexp(z, dim=1, keepdim=True)
    return out.reshape(ids.shape)


def naive_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    ignore_index: int = IGNORE_INDEX,
    logit_softcap: Optional[float] = None,
    logit_scale: float = 1.0,
) -> _Result:
    """Reference: full logits, ``log_softmax(logits.float()).gather``; same contract as ``fused_logprobs``.

    Materialises [N, V] logits in the input dtype, then in float32 (float64 for float64
    inputs); autograd does the backward. ``chunk_size``/``vocab_chunk_size`` are accepted
    and ignored so the two functions are interchangeable.
    """
    del chunk_size, vocab_chunk_size
    _, _, bias, _ = _validate(hidden, weight, targets, bias, temperature, None, None, ignore_index)
    _transform(temperature, logit_softcap, logit_scale)
    compute_dtype = _compute_dtype(hidden.dtype)
    logits = (hidden @ weight.T).to(compute_dtype)
    if bias is not None:
        logits = logits + bias.to(compute_dtype)
    if logit_softcap is not None:
        logits = logit_softcap * torch.tanh(logits / logit_softcap)
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    valid = targets != ignore_index
    safe_t = torch.where(valid, targets, torch.zeros_like(targets)).long()
    lp = logp.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1)
    lp = torch.where(valid, lp, torch.zeros_like(lp))
    ent = None
    if return_entropy:
        ent = -(logp.exp() * logp).sum(-1)
        ent = torch.where(valid, ent, torch.zeros_like(ent))
    return lp, ent


# ----------------------------------------------------------------------------------
# Validation and sizing
# ----------------------------------------------------------------------------------


class _Transform(NamedTuple):
    """z = mult * softcap(u): ``mult`` = logit_scale / T, ``cap`` None or the softcap."""

    mult: float
    cap: Optional[float]


def _transform(temperature, logit_softcap, logit_scale) -> _Transform:
    if logit_softcap is not None and not (isinstance(logit_softcap, (int, float)) and math.isfinite(logit_softcap)
                                          and logit_softcap > 0):
        raise ValueError(f"logit_softcap: expected None or a finite number > 0, got {logit_softcap!r}")
    if not (isinstance(logit_scale, (int, float)) and math.isfinite(logit_scale) and logit_scale > 0):
        raise ValueError(f"logit_scale: expected a finite number > 0, got {logit_scale!r}")
    # 1/T first, as before the transform existed: without one the bits are unchanged.
    mult = 1.0 / float(temperature)
    if logit_scale != 1.0:
        mult *= float(logit_scale)
    return _Transform(mult, None if logit_softcap is None else float(logit_softcap))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _validate(hidden, weight, targets, bias, temperature, chunk_size, vocab_chunk_size, ignore_index):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        raise ValueError(
            f"hidden: expected a [N, H] or [B, T, H] tensor, got "
            f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}"
        )
    if not hidden.is_floating_point():
        raise ValueError(f"hidden: expected a floating dtype, got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight: expected a [V, H] tensor, got shape {tuple(getattr(weight, 'shape', ()))}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: hidden size {weight.shape[1]} (shape {tuple(weight.shape)}) does not match "
            f"hidden's last dimension {hidden.shape[-1]}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}; cast one of them "
            f"(the matmul runs in the input dtype)"
        )
    if weight.device != hidden.device:
        raise ValueError(f"weight: on {weight.device}, hidden on {hidden.device}")
    if not isinstance(targets, torch.Tensor) or targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets: expected shape {tuple(hidden.shape[:-1])} (hidden's leading dims), got "
            f"{tuple(getattr(targets, 'shape', ()))}"
        )
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise ValueError(f"targets: expected an integer dtype, got {targets.dtype}")
    vocab = weight.shape[0]
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        raise ValueError(
            f"targets: {int(bad.sum())} ids outside [0, {vocab}) (and not ignore_index={ignore_index}), "
            f"e.g. {int(targets[bad][0])}"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (vocab,):
            raise ValueError(f"bias: expected shape ({vocab},), got {tuple(getattr(bias, 'shape', ()))}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}: expected a positive int or None, got {value!r}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).long()
    return flat_h, flat_t, bias, targets.shape


def _memory_budget(device: torch.device) -> int:
    """Bytes of float32 tile for the torch path on ``device`` (see the two budget constants)."""
    if device.type != "cuda":
        return DEFAULT_MEMORY_BUDGET_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return max(DEFAULT_MEMORY_BUDGET_BYTES, min(CUDA_MEMORY_BUDGET_BYTES, free // 8))


def _auto_chunk_rows(cols: int, budget_bytes: int) -> int:
    """Rows per tile so that one float32 [rows, cols] tile fits ``budget_bytes`` (multiple of 16)."""
    rows = budget_bytes // (4 * cols)
    return max(MIN_CHUNK_ROWS, rows - rows % MIN_CHUNK_ROWS)


def _auto_vocab_block(hidden_size: int, budget_bytes: int) -> int:
    """Vocabulary entries per backward tile: the float32 accumulator [block, H] gets budget / 4."""
    return max(1024, budget_bytes // 4 // (4 * hidden_size))


def _backward_tile_shape(
    n: int, vocab: int, hidden_size: int, chunk: int, vblock: int, budget: int = DEFAULT_MEMORY_BUDGET_BYTES
) -> Tuple[int, int]:
    """(rows, vocab_block) of the backward tiles; ``chunk``/``vblock`` of 0 mean automatic.

    Backward tiles are independent given lse, so the vocabulary is always blocked. The
    tile gets half the budget. When all N rows fit one tile with a vocabulary block of at
    least 1024, that is preferred: each weight-gradient block is then a single matmul
    written straight into the gradient, with no float32 accumulator and no cast.
    Otherwise the float32 accumulator [vocab_block, H] gets a quarter of the budget.
    """
    tile_budget = budget // 2
    if not chunk and not vblock:
        one_chunk_block = tile_budget // (4 * n)
        if one_chunk_block >= min(1024, vocab):
            return n, min(vocab, one_chunk_block)
    vblock = min(vocab, vblock or _auto_vocab_block(hidden_size, budget))
    rows = min(n, chunk or _auto_chunk_rows(vblock, tile_budget))
    return rows, vblock


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    msg = str(err).lower()
    # The CPU allocator says "can't allocate memory", CUDA/XPU say "out of memory".
    return isinstance(err, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def _retry_halving(run, rows: int, vblock: int, what: str, split_vocab: bool):
    """Call ``run(rows, vblock)``; on OOM halve the tile (rows first, then the vocab block) and retry.

    Each retry redoes the whole pass from fresh accumulators, so a failure part-way
    through can never leave a partially accumulated result behind.
    """
    while True:
        try:
            return run(rows, vblock)
        except RuntimeError as err:
            if not _is_oom(err):
                raise
            if rows // 2 >= MIN_CHUNK_ROWS:
                new_rows, new_vblock = rows // 2, vblock
            elif split_vocab and vblock // 2 >= MIN_CHUNK_ROWS:
                new_rows, new_vblock = rows, vblock // 2
            else:
                raise
            tile = lambda r, v: f"{r} x {v if split_vocab else 'V'}"
            warnings.warn(
                f"fused_logprobs {what}: out of memory with a {tile(rows, vblock)} tile; retrying with "
                f"{tile(new_rows, new_vblock)} ({err.__class__.__name__}: {str(err)[:120]})",
                RuntimeWarning,
                stacklevel=3,
            )
            rows, vblock = new_rows, new_vblock


# ----------------------------------------------------------------------------------
# Tiles (module-level so tests can inject failures)
# ----------------------------------------------------------------------------------
#
# Every pass allocates its tile buffers once and reuses them: on a CPU a
# fresh 64 MiB tensor costs more in page faults than the arithmetic done on it (measured on a 2-core CPU:
# bf16 matmul into a new [256, 65536] tensor 113 ms, into a reused one 49 ms; exp 80 ms
# vs 8 ms), which is also why the naive version pays more than its FLOPs suggest.


class _KeptSets:
    """A truncated sampler's kept sets over the kernel's rows (CSR), and their boolean tiles."""

    def __init__(self, offsets: torch.Tensor, ids: torch.Tensor, vocab: int) -> None:
        self.offsets, self.ids, self.vocab = offsets, ids, vocab
        sizes = offsets[1:] - offsets[:-1]
        self.row_of = torch.repeat_interleave(torch.arange(sizes.numel(), device=ids.device), sizes)

    @classmethod
    def of(cls, support, n: int, vocab: int, device) -> "_KeptSets":
        if not (isinstance(support, (tuple, list)) and len(support) == 2):
            raise ValueError("support: expected (offsets [N + 1], ids [M])")
        offsets, ids = (torch.as_tensor(x, device=device) for x in support)
        if offsets.dim() != 1 or offsets.numel() != n + 1 or ids.dim() != 1:
            raise ValueError(f"support: offsets must be [N + 1] = [{n + 1}] and ids [M], got "
                             f"{tuple(offsets.shape)} and {tuple(ids.shape)}")
        offsets, ids = offsets.long(), ids.long()
        if int(offsets[0]) != 0 or int(offsets[-1]) != ids.numel() or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError("support: offsets must start at 0, never decrease and end at len(ids)")
        if ids.numel() and bool(((ids < 0) | (ids >= vocab)).any()):
            raise ValueError(f"support: ids outside [0, {vocab})")
        return cls(offsets, ids, vocab)

    def rows(self, idx: torch.Tensor) -> "_KeptSets":
        """The sets of rows ``idx``, in that order."""
        sizes = (self.offsets[1:] - self.offsets[:-1])[idx]
        offsets = torch.zeros(idx.numel() + 1, dtype=torch.long, device=idx.device)
        offsets[1:] = sizes.cumsum(0)
        within = torch.arange(int(offsets[-1]), device=idx.device) - torch.repeat_interleave(offsets[:-1], sizes)
        return _KeptSets(offsets, self.ids[torch.repeat_interleave(self.offsets[idx], sizes) + within], self.vocab)

    def check_targets(self, targets: torch.Tensor) -> None:
        hit = torch.zeros(targets.numel(), dtype=torch.long, device=targets.device)
        hit.index_add_(0, self.row_of, (self.ids == targets[self.row_of]).long())
        missing = (hit == 0).nonzero().squeeze(1)
        if missing.numel():
            raise ValueError(f"support: {missing.numel()} target(s) outside their kept set (first at valid position "
                             f"{int(missing[0])}): a token must be sampled from the set it is normalised over")

    def tile(self, r0: int, r1: int, v0: int, v1: int) -> torch.Tensor:
        """bool [r1 - r0, v1 - v0]: True where the vocabulary entry is in the row's set."""
        keep = torch.zeros(r1 - r0, v1 - v0, dtype=torch.bool, device=self.ids.device)
        a, b = int(self.offsets[r0]), int(self.offsets[r1])
        ids, rows = self.ids[a:b], self.row_of[a:b]
        inside = (ids >= v0) & (ids < v1)
        keep[rows[inside] - r0, ids[inside] - v0] = True
        return keep


class _Buffers:
    """Reusable tile buffers of one pass; ``None`` fields are not needed by the pass.

    Tiles are stored flat so that a ragged last tile [r, v] is still a contiguous view.
    """

    def __init__(self, rows, cols, hidden_size, in_dtype, compute_dtype, device, *, exp, grad_h, grad_w, dcap):
        self.z = torch.empty(rows * cols, dtype=compute_dtype, device=device)
        # Input-dtype tile: the matmul's output, then the input-dtype copy of d/dlogits.
        same = in_dtype == compute_dtype
        self.zin = self.z if same else torch.empty(rows * cols, dtype=in_dtype, device=device)
        self.e = torch.empty(rows * cols, dtype=compute_dtype, device=device) if exp else None
        # d softcap(u) / du of the current tile, for passes that need a gradient under a softcap.
        self.dcap = torch.empty(rows * cols, dtype=compute_dtype, device=device) if dcap else None
        self.gh = torch.empty(rows, hidden_size, dtype=in_dtype, device=device) if grad_h else None
        self.gw = torch.empty(cols, hidden_size, dtype=in_dtype, device=device) if grad_w else None
        # Float staging for _accumulate: 1M elements (4 MiB) is past the point of diminishing returns.
        self.stage = torch.empty(min(2**20, max(rows, cols) * hidden_size), dtype=compute_dtype, device=device)

    @staticmethod
    def tile(flat: torch.Tensor, r: int, v: int) -> torch.Tensor:
        return flat[: r * v].view(r, v)


def _scaled_logits(h, w, bias_c, xf, buf):
    """(float [r, v] tile z = mult * softcap(h w^T + b), d softcap/du tile or None); the matmul stays in h's dtype.

    The derivative tile is only filled when ``buf`` has room for it (passes that need gradients).
    """
    r, v = h.shape[0], w.shape[0]
    z, zin = buf.tile(buf.z, r, v), buf.tile(buf.zin, r, v)
    torch.mm(h, w.T, out=zin)
    if buf.zin is not buf.z:
        z.copy_(zin)
    if bias_c is not None:
        z += bias_c
    dcap = None
    if xf.cap is not None:
        z.mul_(1.0 / xf.cap).tanh_()
        if buf.dcap is not None:
            dcap = buf.tile(buf.dcap, r, v)
            torch.mul(z, z, out=dcap).neg_().add_(1.0)  # 1 - tanh^2
        z.mul_(xf.cap)
    if xf.mult != 1.0:
        z *= xf.mult
    return z, dcap


def _to_input_dtype(x, buf):
    """Input-dtype version of the float tile ``x`` (a copy into the reused buffer if dtypes differ)."""
    if buf.zin is buf.z:  # float32/float64 inputs: x already is the input-dtype tile
        return x
    return buf.tile(buf.zin, *x.shape).copy_(x)


def _accumulate(acc, x, stage, first: bool):
    """acc (float) = x if first else acc + x, for a lower-precision x, without temporaries.

    A mixed-dtype ``acc += x`` makes torch allocate a float copy of x on every call (page
    faults on each; ~5x slower than the add itself), so x is cast into the reused flat
    float buffer ``stage`` one block at a time.
    """
    if first or acc.dtype == x.dtype:
        return acc.copy_(x) if first else acc.add_(x)
    step = max(1, stage.numel() // acc.shape[1])
    for s in range(0, acc.shape[0], step):
        e = min(acc.shape[0], s + step)
        acc[s:e] += stage[: (e - s) * acc.shape[1]].view(e - s, acc.shape[1]).copy_(x[s:e])
    return acc


def _forward_tile(h, weight, bias_c, t, xf, want_entropy, want_grad_h, buf, keep=None):
    """One row chunk against the full vocabulary.

    Returns (logprob [r], lse [r], entropy [r] or None, G [r, H] or None, lse over the whole vocabulary [r] or
    None) where G = ((onehot(t) - p) * dz/du) @ weight = d logprob / d hidden. ``keep`` [r, V]: the rows' kept
    sets; every normaliser (lse, p, entropy) is then over them, and the last output is the full one.
    """
    z, dcap = _scaled_logits(h, weight, bias_c, xf, buf)
    z_t = z.gather(1, t.unsqueeze(1)).squeeze(1)
    lse_full = None
    if keep is not None:
        lse_full = torch.logsumexp(z, dim=1)
        z.masked_fill_(~keep, -math.inf)
    m = z.amax(dim=1, keepdim=True)
    z -= m  # z' = z - max, so exp never overflows
    if want_entropy:
        e = torch.exp(z, out=buf.tile(buf.e, *z.shape))
        s = e.sum(dim=1)
        if keep is not None:
            z.masked_fill_(~keep, 0.0)  # e is 0 there; 0 * -inf would be NaN
        # entropy = lse - sum p z = log s - sum(e z') / s  (the max cancels)
        ent = torch.log(s) - torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).reshape(-1) / s
    else:
        e = z.exp_()
        s = e.sum(dim=1)
        ent = None
    lse = m.squeeze(1) + torch.log(s)
    logprob = z_t - lse
    grad_h = None
    if want_grad_h:
        g = e.div_(s.unsqueeze(1)).neg_()  # -p
        g.scatter_add_(1, t.unsqueeze(1), torch.ones_like(z_t).unsqueeze(1))
        if dcap is not None:
            g *= dcap
        if xf.mult != 1.0:
            g *= xf.mult
        grad_h = torch.mm(_to_input_dtype(g, buf), weight, out=buf.gh[: h.shape[0]]).to(lse.dtype)
    return logprob, lse, ent, grad_h, lse_full


def _backward_tile(h, w_blk, b_blk_c, t, v0, lse, ent, g_lp, g_ent, xf, buf, keep=None):
    """Minus the gradient of sum(g_lp * logprob + g_ent * entropy) w.r.t. the tile's raw logits.

    Rows ``h`` [r, H] against vocabulary block ``w_blk`` [v, H] starting at ``v0``.
    Returns float [r, v] (a view of ``buf.z``):
        (p * (g_lp + g_ent * (log p + entropy)) - g_lp * onehot) * dz/du
    The sign is flipped because it saves a full pass over the tile; the caller negates
    the much smaller accumulated gradients once at the end. ``keep`` [r, v]: the rows' kept sets in this block
    (``lse`` and ``ent`` are then the truncated distribution's); p is 0 outside them.
    """
    logp, dcap = _scaled_logits(h, w_blk, b_blk_c, xf, buf)
    logp.sub_(lse.unsqueeze(1))
    if g_ent is not None:
        p = torch.exp(logp, out=buf.tile(buf.e, *logp.shape))
        coef = logp.add_(ent.unsqueeze(1)).mul_(g_ent.unsqueeze(1))
        if g_lp is not None:
            coef += g_lp.unsqueeze(1)
        neg_grad = coef.mul_(p)
    else:
        neg_grad = logp.exp_().mul_(g_lp.unsqueeze(1))
    if keep is not None:
        neg_grad.masked_fill_(~keep, 0.0)  # also what an overflow outside the set made inf or NaN
    if g_lp is not None:
        local = t - v0
        rows = ((local >= 0) & (local < w_blk.shape[0])).nonzero().squeeze(1)
        neg_grad.index_put_((rows, local[rows]), -g_lp[rows], accumulate=True)
    if dcap is not None:
        neg_grad *= dcap
    if xf.mult != 1.0:
        neg_grad *= xf.mult
    return neg_grad


def _forward_pass(hidden, weight, bias, targets, xf, want_entropy, precompute, rows, kept_sets=None):
    cd = _compute_dtype(hidden.dtype)
    n, (vocab, hsize) = hidden.shape[0], weight.shape
    rows = min(rows, n)
    buf = _Buffers(rows, vocab, hsize, hidden.dtype, cd, hidden.device,
                   exp=want_entropy, grad_h=precompute, grad_w=False, dcap=precompute and xf.cap is not None)
    bias_c = bias.to(cd) if bias is not None else None
    lp = torch.empty(n, dtype=cd, device=hidden.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if want_entropy else None
    gh = torch.empty(n, hsize, dtype=cd, device=hidden.device) if precompute else None
    kept = torch.zeros_like(lp) if kept_sets is not None else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        keep = kept_sets.tile(r0, r1, 0, vocab) if kept_sets is not None else None
        out = _forward_tile(hidden[r0:r1], weight, bias_c, targets[r0:r1], xf, want_entropy, precompute, buf, keep)
        lp[r0:r1], lse[r0:r1] = out[0], out[1]
        if want_entropy:
            ent[r0:r1] = out[2]
        if precompute:
            gh[r0:r1] = out[3]
        if keep is not None:
            kept[r0:r1] = out[1] - out[4]  # log of the full softmax's mass inside the set (<= 0)
    return lp, lse, ent, gh, kept


def _backward_pass(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, xf, need, rows, vblock, kept_sets=None):
    need_h, need_w, need_b = need
    cd = lse.dtype
    n, (vocab, hsize) = hidden.shape[0], weight.shape
    rows, vb = min(rows, n), min(vblock, vocab)
    buf = _Buffers(rows, vb, hsize, hidden.dtype, cd, hidden.device,
                   exp=g_ent is not None, grad_h=need_h, grad_w=need_w and rows < n, dcap=xf.cap is not None)
    bias_c = bias.to(cd) if bias is not None else None
    # _backward_tile returns minus d/dlogits: gh and gb accumulate minus their gradient and
    # are negated once at the end; the weight gradient uses -hidden ([N, H], cheap) instead.
    gh = torch.empty(n, hsize, dtype=cd, device=hidden.device) if need_h else None
    neg_hidden = -hidden if need_w else None
    gw = torch.empty_like(weight) if need_w else None
    one_chunk = rows >= n  # then each weight-gradient block is one matmul: no float accumulator
    gw_acc = torch.empty(vb, hsize, dtype=cd, device=hidden.device) if need_w and not one_chunk else None
    gb = torch.zeros(vocab, dtype=cd, device=hidden.device) if need_b else None
    for v0 in range(0, vocab, vb):
        v1 = min(vocab, v0 + vb)
        w_blk = weight[v0:v1]
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            neg_grad = _backward_tile(
                hidden[r0:r1], w_blk, bias_c[v0:v1] if bias_c is not None else None, targets[r0:r1], v0,
                lse[r0:r1], ent[r0:r1] if ent is not None else None,
                g_lp[r0:r1] if g_lp is not None else None, g_ent[r0:r1] if g_ent is not None else None,
                xf, buf, kept_sets.tile(r0, r1, v0, v1) if kept_sets is not None else None,
            )
            if need_b:
                gb[v0:v1] += neg_grad.sum(0)
            grad_in = _to_input_dtype(neg_grad, buf)
            if need_h:
                part = torch.mm(grad_in, w_blk, out=buf.gh[: r1 - r0])
                _accumulate(gh[r0:r1], part, buf.stage, first=v0 == 0)
            if need_w and one_chunk:
                torch.mm(grad_in.T, neg_hidden, out=gw[v0:v1])
            elif need_w:
                part = torch.mm(grad_in.T, neg_hidden[r0:r1], out=buf.gw[: v1 - v0])
                _accumulate(gw_acc[: v1 - v0], part, buf.stage, first=r0 == 0)
        if need_w and not one_chunk:
            gw[v0:v1] = gw_acc[: v1 - v0]
    if need_h:
        gh.neg_()
    if need_b:
        gb.neg_()
    return gh, gw, gb


# ----------------------------------------------------------------------------------
# Autograd function (chunked torch backend)
# ----------------------------------------------------------------------------------


class _ChunkedLogProbs(torch.autograd.Function):
    """Inputs are flat: hidden [N, H], targets [N] all valid (the wrapper drops ignored rows).

    ``chunk``/``vblock`` of 0 mean "from the memory budget".
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, xf, want_entropy, entropy_grad, chunk, vblock, precompute,
                kept_sets=None):
        vocab, hsize = weight.shape
        rows = chunk or _auto_chunk_rows(vocab, _memory_budget(hidden.device))
        run = lambda r, _v: _forward_pass(hidden, weight, bias, targets, xf, want_entropy, precompute, r, kept_sets)
        lp, lse, ent, gh, kept = _retry_halving(run, min(rows, hidden.shape[0]), vocab, "forward", split_vocab=False)
        keep_ent = ent if entropy_grad else None  # a detached entropy plays no part in the backward
        ctx.save_for_backward(hidden, weight, bias, targets, lse, keep_ent, gh)
        ctx.xf, ctx.chunk, ctx.vblock, ctx.precompute = xf, chunk, vblock, precompute
        ctx.kept_sets = kept_sets
        ctx.set_materialize_grads(False)
        if ent is None:
            ent = torch.zeros(0, dtype=lp.dtype, device=lp.device)
        if keep_ent is None:
            ctx.mark_non_differentiable(ent)
        if kept_sets is None:
            return lp, ent
        ctx.mark_non_differentiable(kept)
        return lp, ent, kept

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent, *_g_kept):
        hidden, weight, bias, targets, lse, ent, gh = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        none = (None,) * (8 if ctx.kept_sets is not None else 7)
        if ent is None or (g_ent is not None and g_ent.numel() == 0):
            g_ent = None
        g_lp = g_lp.to(lse.dtype) if g_lp is not None else None
        g_ent = g_ent.to(lse.dtype) if g_ent is not None else None
        if g_lp is None and g_ent is None:
            return (None, None, None) + none
        if ctx.precompute:
            # Only hidden needs a gradient and there is no entropy term: G * g_lp.
            grad_h = (gh * g_lp.unsqueeze(1)).to(hidden.dtype) if g_lp is not None else None
            return (grad_h, None, None) + none

        vocab, hsize = weight.shape
        rows, vblock = _backward_tile_shape(
            hidden.shape[0], vocab, hsize, ctx.chunk, ctx.vblock, _memory_budget(hidden.device)
        )
        run = lambda r, v: _backward_pass(
            hidden, weight, bias, targets, lse, ent, g_lp, g_ent, ctx.xf, need, r, v, ctx.kept_sets
        )
        gh, gw, gb = _retry_halving(run, rows, vblock, "backward", split_vocab=True)
        grad_h = gh.to(hidden.dtype) if gh is not None else None
        grad_b = gb.to(bias.dtype) if gb is not None else None
        return (grad_h, gw, grad_b) + none


def _backend_for(hidden: torch.Tensor):
    """The autograd Function implementing the kernel for ``hidden``'s device and dtype.

    CUDA tensors in a dtype the Triton kernels handle (not float64) go to
    ``parity.logprobs_triton.TritonLogProbs`` when triton imports and the kernels passed their
    check on that device and dtype (``_triton_ready``); everything else to the chunked torch
    implementation. Both take the same apply() arguments.
    """
    if (hidden.is_cuda and logprobs_triton is not None and logprobs_triton.supports(hidden.dtype)
            and _triton_ready(hidden.device, hidden.dtype)):
        return logprobs_triton.TritonLogProbs
    return _ChunkedLogProbs


# (device, dtype) -> None when the Triton kernels passed ``_triton_self_check`` there, else why not
_TRITON_CHECKED: dict = {}
# (device, dtype) whose check ran out of memory: not a verdict on the kernels, so it is tried again on the next call
_TRITON_CHECK_OOM: set = set()


class _CheckOutOfMemory(Exception):
    """The self-check could not run for lack of memory (a transient state, not a property of the kernels)."""


def _triton_ready(device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels may run on ``device`` in ``dtype``: checked once per process against the torch
    path. A kernel that does not compile for this GPU, or computes something else, would otherwise fail or
    mislead every step; then the torch path (correct, slower) runs instead, with one warning saying why.
    A check that ran out of memory decides nothing: this call takes the torch path and the next one checks again."""
    key = (str(device), dtype)
    if key not in _TRITON_CHECKED:
        try:
            verdict = _triton_self_check(device, dtype)
        except _CheckOutOfMemory as e:
            if key not in _TRITON_CHECK_OOM:
                _TRITON_CHECK_OOM.add(key)
                warnings.warn(f"parity.logprobs: the Triton log-prob kernels' check on {device} in {dtype} ran out of "
                              f"memory ({e}); the chunked torch path runs until a later call can check them",
                              stacklevel=3)
            return False
        _TRITON_CHECKED[key] = verdict
        if verdict is not None:
            warnings.warn(f"parity.logprobs: the Triton log-prob kernels failed their check on {device} in {dtype} "
                          f"({verdict}); the chunked torch path runs instead (same results, slower)",
                          stacklevel=3)
    return _TRITON_CHECKED[key] is None


def self_check_shape(device, dtype: torch.dtype) -> Tuple[int, int, int, int]:
    """(tokens, hidden, vocabulary, rows per backward chunk) of ``_triton_self_check``'s problem on ``device``: three
    row blocks, several K steps and backward chunks, at least two vocabulary tiles per program of the values kernel
    under the device's own launch plan, each dimension ragged against its tile."""
    tiles = logprobs_triton.tiles_for(torch.device(device), dtype)
    n, h = 2 * tiles.block_m + 37, 3 * tiles.block_k + 5
    sms = l2 = None
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        sms, l2 = props.multi_processor_count, getattr(props, "L2_cache_size", 50 * 2**20)
    wide = logprobs_triton.launch_plan(n, 2**30, h, torch.tensor([], dtype=dtype).element_size(), tiles,
                                       sms=sms, l2_bytes=l2 or 0)
    return n, h, wide.splits * 2 * tiles.block_v + 37, tiles.block_m


def _triton_self_check(device, dtype: torch.dtype, shape: Optional[Tuple[int, int, int, int]] = None) -> Optional[str]:
    """None if ``parity.logprobs_triton`` agrees with the torch path on ``device``, else why not; raises
    ``_CheckOutOfMemory`` when the device had no room to run it.

    Two runs on ``self_check_shape``'s problem: (1) temperature and a frozen bias, each backward path (frozen
    lm_head, and the full one); (2) every option on: softcap, logit scale, a differentiable entropy in the loss, a
    trained bias. Compared: log-probs, entropy, the gradients to hidden, lm_head weight and bias, and the top-k gather;
    the lm_head gradient also against float64 on sampled vocabulary rows. Tolerances are far above rounding (float32
    1e-4, half precisions 3e-2, relative) and far below what a wrong kernel gives (O(1)): this finds a kernel that
    fails or is wrong, it does not grade accuracy."""
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.inference_mode(False):
        return _compare_backends(device, dtype, tol, shape or self_check_shape(device, dtype))


_CHECK_RUNS = (
    # (name, frozen lm_head, softcap, logit scale, temperature, differentiable entropy, trained bias)
    ("frozen lm_head", True, None, 1.0, 0.7, False, False),
    ("full", False, None, 1.0, 0.7, False, False),
    ("every option", False, 5.0, 1.3, 0.8, True, True),
)


def _compare_backends(device, dtype: torch.dtype, tol: float, shape: Tuple[int, int, int, int]) -> Optional[str]:
    """``_triton_self_check``'s comparison (inputs made on the CPU generator, so every device sees the same)."""
    g = torch.Generator().manual_seed(0)
    n, h, v, chunk = shape
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) * 0.2).to(device=device, dtype=dtype)
    bias = (torch.randn(v, generator=g) * 0.1).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    up_lp, up_ent = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    sampled = torch.randperm(v, generator=g)[:64].to(device)

    def run(fn, frozen, cap, scale, temp, ent_grad, bias_grad):
        hh = hidden.clone().requires_grad_(True)
        ww = weight.clone().requires_grad_(not frozen)
        bb = bias.clone().requires_grad_(bias_grad)
        with torch.enable_grad():  # the first call may come under no_grad (a scoring pass)
            lp, ent = fn.apply(hh, ww, bb, targets, _transform(temp, cap, scale), True, ent_grad, chunk, 0, frozen)
            loss = (lp * up_lp).sum() + ((ent * up_ent).sum() if ent_grad else 0)
            loss.backward()
        grads = [None if x.grad is None else x.grad.float() for x in (hh, ww, bb)]
        return [lp.float(), ent.float()] + grads

    def reference_weight_rows(cap, scale, temp, ent_grad, bias_grad):
        """float64 lm_head gradient on the sampled vocabulary rows (naive full logits of this small problem)."""
        h64, w64 = hidden.double(), weight.double().requires_grad_(True)
        b64 = bias.double().requires_grad_(bias_grad)
        with torch.enable_grad():
            lp, ent = naive_logprobs(h64, w64, targets, bias=b64, temperature=temp, return_entropy=True,
                                     logit_softcap=cap, logit_scale=scale)
            ((lp * up_lp.double()).sum() + ((ent * up_ent.double()).sum() if ent_grad else 0)).backward()
        return w64.grad[sampled]

    def far(a, b) -> bool:
        return bool(((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)) > tol)

    names = ("log-probs", "entropy", "gradient to hidden", "lm_head gradient", "bias gradient")
    try:
        for label, *opts in _CHECK_RUNS:
            got, ref = run(logprobs_triton.TritonLogProbs, *opts), run(_ChunkedLogProbs, *opts)
            for name, a, b in zip(names, got, ref):
                if b is not None and (a is None or not torch.isfinite(a).all() or far(a, b)):
                    return f"{name} differs from the torch path ({label})"
            if not opts[0] and far(got[3][sampled], reference_weight_rows(*opts[1:])):
                return f"lm_head gradient differs from float64 on sampled vocabulary rows ({label})"
        top = logprobs_triton.gather_logprobs_triton(hidden, weight, targets[:, None], bias=bias, temperature=0.7)
        frozen_ref = run(_ChunkedLogProbs, *_CHECK_RUNS[0][1:])[0]
        if far(top[:, 0].float(), frozen_ref):
            return "the top-k gather differs from the torch path"
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile or launch here: say why, use torch
        if _is_oom(e):
            raise _CheckOutOfMemory(" ".join(str(e).split())[:200]) from e
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return None
