"""Dr. GRPO ("GRPO Done Right"): GRPO without its two normalisation biases.

Reference: Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective",
arXiv 2503.20783, Sec. 3.1. GRPO's objective divides each sequence's token sum by its length
|o_i| (a length bias: long wrong answers are penalised less per token) and each advantage by
the group's reward std (a question-difficulty bias). Dr. GRPO removes both:
    A_i = r_i - mean(r)                                      (no std)
    J   = 1/G sum_i 1/C sum_t min(rho_t A_i, clip(rho_t) A_i)  with C a CONSTANT (the generation
                                                              budget, max_new_tokens)
i.e. GRPO with ``scale_rewards=False`` and ``loss_agg="seq_mean_token_sum_norm"`` (whose constant is
``LossNormalizer.max_len``; the loop sets it to ``rollout.max_new_tokens``).

Registered as ``"dr_grpo"`` in both registries. Both functions delegate to GRPO's with those two
settings FIXED: they define the algorithm, so ``cfg.scale_rewards`` and ``cfg.loss_agg`` are not
read. Everything else (clip range, KL, importance weights, metrics) is GRPO's.
"""
from __future__ import annotations

from typing import Any

import torch

from trainer.algorithms.grpo import grpo_advantages, grpo_loss
from trainer.algorithms.registry import ADVANTAGES, POLICY_LOSSES, AdvantageInputs, LossInputs, LossOutput

DR_GRPO_LOSS_AGG = "seq_mean_token_sum_norm"


class _Fixed:
    """A read-only view of a duck-typed cfg with some attributes fixed by the algorithm's definition."""

    def __init__(self, cfg: Any, **fixed: Any) -> None:
        self._cfg = cfg
        self._fixed = fixed

    def __getattr__(self, name: str) -> Any:
        fixed = self.__dict__["_fixed"]
        return fixed[name] if name in fixed else getattr(self.__dict__["_cfg"], name)


@ADVANTAGES.register("dr_grpo")
def dr_grpo_advantages(batch: AdvantageInputs, cfg: Any) -> torch.Tensor:
    """A_i = r_i - mean of its group, broadcast to tokens: [S, T], zero on padding.

    ``grpo_advantages`` with scale_rewards=False (reads nothing else from ``cfg``).
    """
    return grpo_advantages(batch, _Fixed(cfg, scale_rewards=False, eps=1.0))  # eps: unused without the std


@POLICY_LOSSES.register("dr_grpo")
def dr_grpo_loss(batch: LossInputs, cfg: Any) -> LossOutput:
    """GRPO's clipped surrogate, aggregated as 1/G sum_i (sum_t l_{i,t}) / max_len.

    ``grpo_loss`` with loss_agg="seq_mean_token_sum_norm"; reads cfg.clip_eps_low,
    cfg.clip_eps_high, cfg.kl_coef (the paper uses no KL: 0). Same metrics as ``grpo_loss``.
    """
    return grpo_loss(batch, _Fixed(cfg, loss_agg=DR_GRPO_LOSS_AGG))
