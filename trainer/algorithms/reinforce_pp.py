"""REINFORCE++-baseline: group-mean baseline, then normalisation over the whole BATCH.

Reference: Hu et al., "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt
and Reward Models", arXiv 2501.03262. With several samples per prompt, the baseline variant
subtracts the prompt's group mean reward, then normalises with the mean and std of the global
batch instead of each group's own std (GRPO's):
    A'_i   = r_i - mean(r of i's group)
    A_{i,t} = (A'_i - mean_batch(A')) / std_batch(A')      over every valid token of the batch
The batch statistics are taken over TOKENS (each sequence weighted by its length), as the
authors' OpenRLHF and verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``
(``masked_whiten``: Bessel-corrected variance, 1e-8 under the square root).

The loss is PPO's clipped token-level surrogate, i.e. GRPO's (``grpo_loss``: clip range, k3 KL in
the loss, ``loss_agg``), as OpenRLHF/verl pair it. The paper's per-token KL-in-reward variant needs
token rewards and is not what this estimator computes: use ``kl_coef`` (KL in the loss) instead.

Registered as the ``"reinforce_pp_baseline"`` record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.algorithms.grpo import grpo_loss
from trainer.algorithms.record import Algorithm, check_options, clip_rules, loss_agg_rule
from trainer.algorithms.registry import AdvantageInputs, register_algorithm
from trainer.algorithms.sequence import broadcast_to_tokens, constant_groups, grouped_rewards, whiten


@dataclass
class ReinforcePPConfig:
    """The options of ``reinforce_pp_baseline``: read by its loss (GRPO's clipped surrogate).

    Defaults: PPO's clip range 0.2 and token-mean aggregation, as OpenRLHF and verl pair the
    estimator with PPO's loss (paper Sec. 3); no KL in the loss (the paper's KL is in the reward).
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    loss_agg: str = "token_mean"

    def __post_init__(self) -> None:
        check_options(self, [*clip_rules(self), loss_agg_rule(self)])


def reinforce_pp_baseline_advantages(batch: AdvantageInputs, cfg: Any) -> torch.Tensor:
    """Group-mean-centred rewards whitened over the batch's valid tokens: [S, T], zero on padding.

    A'_i = r_i - mean(group); a group whose rewards are all equal gives A'_i = 0 exactly.
    A' is broadcast to the valid tokens, then ``sequence.whiten`` (mean/unbiased std over all valid
    tokens of the batch). Reads nothing from ``cfg``. Requires group_size >= 2 and at least 2
    valid tokens in the batch; NaN/inf rewards raise naming the sample index. Computed in float64,
    returned in float32 (or the wider rewards dtype).

    Its statistics are the whole rollout batch's: with data parallel, ``batch.all_sum`` pools them.
    """
    r = grouped_rewards("reinforce_pp_baseline_advantages", batch.rewards, batch.group_size)
    centred = r - r.mean(dim=-1, keepdim=True)
    centred = torch.where(constant_groups(r), torch.zeros_like(centred), centred)
    adv = whiten(broadcast_to_tokens(centred.flatten(), batch.mask, torch.float64), batch.mask, all_sum=batch.all_sum)
    return adv.to(torch.promote_types(batch.rewards.dtype, torch.float32))


register_algorithm(Algorithm(name="reinforce_pp_baseline", options=ReinforcePPConfig,
                             advantage=reinforce_pp_baseline_advantages, loss=grpo_loss,
                             paper="Hu et al., REINFORCE++, arXiv 2501.03262"))
