"""The entry points: ``fused_logprobs`` (log-probs and entropy, differentiable) and ``fused_gather_logprobs``
(the log-probs of given token ids), both chunked so that no [N, V] logits exist (package docstring)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from parity.logprobs.dispatch import _backend_for
from parity.logprobs.inputs import IGNORE_INDEX, _compute_dtype, _transform, _validate
from parity.logprobs.optional_triton import logprobs_triton
from parity.logprobs.sizing import _auto_chunk_rows, _memory_budget
from parity.logprobs.supports import _KeptSets
from parity.logprobs.tiles import _Buffers, _scaled_logits
from parity.logprobs.torch_path import _ChunkedLogProbs


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
        logit_softcap: None, or cap > 0: logits become cap * tanh(logits / cap) (package docstring).
        logit_scale: logits are multiplied by this (after the softcap, before 1/T).
        support: None, or the kept sets of a truncated sampler (package docstring) as ``(offsets, ids)``: offsets
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
    # See the package docstring: precompute d logprob / d hidden only when it is the whole backward.
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
