"""Batch filters applied between rewards and advantages (pure functions; the loop acts and logs).

DAPO = GRPO + settings + this filter. DAPO (Yu et al., arXiv 2503.14476) is not a separate
registered algorithm: its loss and advantage are GRPO's with
    clip_eps_low=0.2, clip_eps_high=0.28   ("clip-higher", Sec. 3.1)
    loss_agg="token_mean"                   (token-level policy gradient loss, Sec. 3.3)
    kl_coef=0.0, scale_rewards=True         (no KL penalty; group-normalised advantages)
plus dynamic sampling (Sec. 3.2, ``groups_with_signal`` below: the loop drops, and ideally
re-samples to refill, groups whose rewards are all equal) and overlong reward shaping (Sec. 3.4, a
reward-side concern). Registering a "dapo" name would promise a DAPO the loss alone cannot deliver,
since the sampling part lives in the loop.
"""
from __future__ import annotations

import torch

from trainer.algorithms.sequence import check_finite_rewards, constant_groups


def groups_with_signal(rewards: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """DAPO's dynamic-sampling filter: keep only groups whose rewards are not all equal.

    rewards: [S], group-contiguous (sample i answers prompt i // group_size).
    Returns (keep [S] bool, num_dropped_groups). A group with equal rewards (all correct or all
    wrong) has zero group-relative advantage for every member, so it adds no gradient and only
    dilutes the batch (DAPO, arXiv 2503.14476, Sec. 3.2: keep 0 < #correct < G).
    Equality is exact: rewards that differ by any amount count as signal.

    Raises ValueError: group_size < 2 (a group of one never has signal), S not a multiple of
    group_size, rewards not 1-D, or NaN/inf rewards (naming the sample indices).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"groups_with_signal: group_size must be an int >= 2, got {group_size!r}")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"groups_with_signal: rewards must be a 1-D [S] tensor, got {shape}")
    if rewards.shape[0] % group_size:
        raise ValueError(
            f"groups_with_signal: {rewards.shape[0]} rewards is not a multiple of group_size={group_size}"
        )
    check_finite_rewards("groups_with_signal", rewards)
    flat = constant_groups(rewards.detach().reshape(-1, group_size))  # [G, 1]
    keep = (~flat).expand(-1, group_size).reshape(-1)
    return keep, int(flat.sum().item())
