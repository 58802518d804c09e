"""The HF engine's sampling distribution, truncated in vLLM's order: temperature, min-p, then top-k and top-p.

vLLM's V1 sampler (``vllm/v1/sample/sampler.py``, ``Sampler.sample``; vLLM 0.32) divides the float32 logits by the
temperature, then applies the argmax-invariant logits processors, of which min-p is the built-in one
(``logits_processor/builtin.py``, ``MinPLogitsProcessor.apply``: drop every token whose probability is below
min_p times the largest), then top-k and top-p together (``ops/topk_topp_sampler.py``,
``apply_top_k_top_p_pytorch``: sort ascending; top-k drops every logit below the k-th largest, ties kept; top-p
then drops, over the softmax of what top-k left, every token whose ascending cumulative probability is
<= 1 - top_p, always keeping the largest). Transformers' ``generate`` instead chains its warpers as temperature,
top-k, top-p, min-p (``generation/utils.py``, ``_get_logits_processor``). Min-p commutes with top-k (both keep the
most likely token, and min-p's test p_i >= min_p * p_max does not depend on the normalisation), but not with
top-p: after min-p, top-p measures its mass over the renormalised min-p set, so it can keep fewer tokens. E.g.
probabilities [0.45, 0.30, 0.15, 0.10], min_p 0.25, top_p 0.8: Transformers keeps three (top-p over the whole
distribution keeps 0.45, 0.30, 0.15; min-p's threshold 0.1125 keeps them), vLLM two (min-p drops 0.10; over
[0.5, 0.333, 0.167] top-p stops at 0.833). The HF engine presents its log-probs as vLLM's processed ones, so it
samples from vLLM's distribution: ``VLLMOrderWarper`` replaces Transformers' four warpers.
"""
from __future__ import annotations

import torch

__all__ = ["VLLMOrderWarper", "truncate_like_vllm"]


def truncate_like_vllm(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                       min_p: float = 0.0) -> torch.Tensor:
    """[B, V] logits -> the float32 logits vLLM samples from: divided by ``temperature``, -inf outside the kept set.

    top_k 0 (or >= V), top_p 1.0 and min_p 0.0 are off, as in ``rollout.types.SamplingSpec``. The thresholds are
    float32 tensors, as vLLM holds them (its per-request ``temperature``, ``min_p``, ``top_p`` batch tensors).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [B, V], got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature = {temperature!r}: expected > 0")
    vocab = logits.shape[-1]
    x = logits.float() / torch.tensor(temperature, dtype=torch.float32, device=logits.device)
    if min_p > 0:
        probs = x.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, dtype=torch.float32, device=x.device)
        x = x.masked_fill(probs < floor, -float("inf"))
    use_k, use_p = 0 < top_k < vocab, top_p < 1.0
    if not (use_k or use_p):
        return x
    ordered, index = x.sort(dim=-1, descending=False)
    if use_k:
        kth = ordered[:, vocab - top_k:vocab - top_k + 1]
        ordered = ordered.masked_fill(ordered < kth, -float("inf"))
    if use_p:
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - torch.tensor(top_p, dtype=torch.float32, device=x.device)
        drop[:, -1] = False  # at least the most likely token
        ordered = ordered.masked_fill(drop, -float("inf"))
    return x.scatter(-1, index, ordered)


class VLLMOrderWarper:
    """A Transformers logits processor (``generate(logits_processor=...)``) applying ``truncate_like_vllm``: its
    output is the step's processed scores (``output_scores``), log-softmax of which are vLLM's processed log-probs
    and whose finite entries are the kept set."""

    def __init__(self, *, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> None:
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return truncate_like_vllm(scores, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                                  min_p=self.min_p)
