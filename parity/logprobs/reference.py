"""The plain reference: full logits, then log-softmax; what the fused kernels are tested against."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from parity.logprobs.inputs import IGNORE_INDEX, _compute_dtype, _transform, _validate

_Result = Tuple[torch.Tensor, Optional[torch.Tensor]]


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
