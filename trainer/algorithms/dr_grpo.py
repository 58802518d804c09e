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

Registered as the ``"dr_grpo"`` record. Both functions delegate to GRPO's with those two
settings FIXED: they define the algorithm, so they are not options (a recipe that sets
``scale_rewards`` or ``loss_agg`` for dr_grpo is refused) and ``cfg.scale_rewards`` / ``cfg.loss_agg``
are not read. Everything else (clip range, KL, importance weights, metrics) is GRPO's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.algorithms.grpo import grpo_advantages, grpo_loss
from trainer.algorithms.record import Algorithm, check_options, clip_rules
from trainer.algorithms.registry import AdvantageInputs, LossInputs, LossOutput, register_algorithm

DR_GRPO_LOSS_AGG = "seq_mean_token_sum_norm"


@dataclass
class DrGRPOConfig:
    """The options of ``dr_grpo``: GRPO's clip range (0.2) and KL weight; the paper uses no KL (Sec. 3.1)."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        check_options(self, clip_rules(self))


class _Fixed:
    """A read-only view of a duck-typed cfg with some attributes fixed by the algorithm's definition."""

    def __init__(self, cfg: Any, **fixed: Any) -> None:
        self._cfg = cfg
        self._fixed = fixed

    def __getattr__(self, name: str) -> Any:
        fixed = self.__dict__["_fixed"]
        return fixed[name] if name in fixed else getattr(self.__dict__["_cfg"], name)


def dr_grpo_advantages(batch: AdvantageInputs, cfg: Any) -> torch.Tensor:
    """A_i = r_i - mean of its group, broadcast to tokens: [S, T], zero on padding.

    ``grpo_advantages`` with scale_rewards=False (reads nothing else from ``cfg``).
    """
    return grpo_advantages(batch, _Fixed(cfg, scale_rewards=False, eps=1.0))  # eps: unused without the std


def dr_grpo_loss(batch: LossInputs, cfg: Any) -> LossOutput:
    """GRPO's clipped surrogate, aggregated as 1/G sum_i (sum_t l_{i,t}) / max_len.

    ``grpo_loss`` with loss_agg="seq_mean_token_sum_norm"; reads cfg.clip_eps_low,
    cfg.clip_eps_high, cfg.kl_coef (the paper uses no KL: 0). Same metrics as ``grpo_loss``.
    """
    return grpo_loss(batch, _Fixed(cfg, loss_agg=DR_GRPO_LOSS_AGG))


register_algorithm(Algorithm(name="dr_grpo", options=DrGRPOConfig, advantage=dr_grpo_advantages, loss=dr_grpo_loss,
                             paper="Liu et al., Understanding R1-Zero-Like Training, arXiv 2503.20783, Sec. 3.1"))
