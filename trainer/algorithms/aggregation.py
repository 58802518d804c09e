"""Reducing a per-token loss [S, T] to a scalar, exactly across gradient accumulation.

Three modes (names as in the recipe's ``loss_agg``):

- ``token_mean``: sum over all valid tokens / number of valid tokens in the rollout batch.
  Every token weighs the same; long answers are not down-weighted
  (DAPO, arXiv 2503.14476, Sec. 3.3 "token-level policy gradient loss").
- ``seq_mean_token_mean``: mean over sequences of each sequence's token mean
  (the original GRPO objective, DeepSeekMath arXiv 2402.03300, Eq. 3). Every
  sequence weighs the same, so tokens of short answers weigh more.
- ``seq_mean_token_sum_norm``: mean over sequences of (sum of the sequence's token
  losses / a constant ``max_len``, e.g. max_new_tokens). Removes GRPO's length bias
  without making the gradient scale depend on the batch's token count
  (Dr. GRPO, arXiv 2503.20783, Sec. 3.1; verl ``agg_loss`` "seq-mean-token-sum-norm").

Exactness under micro-batching: the denominators are GLOBAL. ``LossNormalizer``
carries the whole rollout batch's valid-token count and sequence count, so with
micro-batches that split the batch along S (whole sequences), the sum of
``aggregate`` over micro-batches equals ``aggregate`` on the full batch. Hence:
call ``backward()`` on each micro-batch's loss as is -- do NOT divide by the number
of accumulation steps. Under DDP (which AVERAGES gradients over ranks), with a
normaliser counted over all ranks, multiply the loss by the world size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


@dataclass(frozen=True)
class LossNormalizer:
    """Global denominators of one optimizer step's rollout batch.

    num_tokens: valid (mask != 0) tokens in the whole batch (a float so that it can be
        the result of an all-reduce across ranks).
    num_seqs: sequences with at least one valid token in the whole batch. Empty
        sequences have no token mean, so they neither contribute nor count.
    max_len: the constant of ``seq_mean_token_sum_norm`` (e.g. max_new_tokens).
    """

    num_tokens: float
    num_seqs: float
    max_len: int

    def __post_init__(self) -> None:
        if not self.num_tokens > 0:
            raise ValueError(f"LossNormalizer.num_tokens must be > 0, got {self.num_tokens!r}")
        if not self.num_seqs > 0:
            raise ValueError(f"LossNormalizer.num_seqs must be > 0, got {self.num_seqs!r}")
        if isinstance(self.max_len, bool) or not isinstance(self.max_len, int) or self.max_len < 1:
            raise ValueError(f"LossNormalizer.max_len must be an int >= 1, got {self.max_len!r}")

    @classmethod
    def from_mask(cls, full_mask: torch.Tensor, max_len: int) -> "LossNormalizer":
        """Count the denominators on the mask [S, T] of the WHOLE rollout batch (not a micro-batch)."""
        if not isinstance(full_mask, torch.Tensor) or full_mask.dim() != 2:
            shape = tuple(full_mask.shape) if isinstance(full_mask, torch.Tensor) else type(full_mask).__name__
            raise ValueError(f"LossNormalizer.from_mask: full_mask must be a 2-D [S, T] tensor, got {shape}")
        valid = full_mask != 0
        num_tokens = float(valid.sum().item())
        if num_tokens == 0:
            raise ValueError(
                f"LossNormalizer.from_mask: full_mask of shape {tuple(full_mask.shape)} has no valid tokens"
            )
        num_seqs = float(valid.any(dim=-1).sum().item())
        return cls(num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)


def aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, mode: str, normalizer: LossNormalizer
) -> torch.Tensor:
    """Reduce ``per_token`` [S, T] over the valid tokens of ``mask`` [S, T] to a scalar.

    With ``m`` the mask, ``L_s = sum_t m[s,t]`` the micro-batch sequence lengths,
    ``N`` = normalizer.num_tokens, ``G`` = normalizer.num_seqs, ``C`` = normalizer.max_len:

    - token_mean:              sum_{s,t} m x / N
    - seq_mean_token_mean:     sum_s (sum_t m x / L_s) / G      (sequences with L_s = 0 add 0)
    - seq_mean_token_sum_norm: sum_s (sum_t m x / C) / G

    Values of ``per_token`` at padding are ignored even if NaN/inf. Returns a 0-dim tensor.
    """
    if per_token.dim() != 2:
        raise ValueError(f"aggregate: per_token must be 2-D [S, T], got shape {tuple(per_token.shape)}")
    if mask.shape != per_token.shape:
        raise ValueError(
            f"aggregate: mask has shape {tuple(mask.shape)}, expected {tuple(per_token.shape)} (per_token's)"
        )
    if mode not in AGG_MODES:
        raise ValueError(f"aggregate: unknown mode {mode!r}; valid modes: {', '.join(AGG_MODES)}")
    valid = mask != 0
    # where, not multiply: 0 * inf = NaN would leak padding garbage into the loss.
    x = torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if mode == "token_mean":
        return x.sum() / normalizer.num_tokens
    seq_sums = x.sum(dim=-1)
    if mode == "seq_mean_token_mean":
        lengths = valid.sum(dim=-1).clamp(min=1).to(seq_sums.dtype)  # empty rows: 0 / 1 = 0
        return (seq_sums / lengths).sum() / normalizer.num_seqs
    return (seq_sums / normalizer.max_len).sum() / normalizer.num_seqs
