"""On-policy distillation: the per-token reverse KL to a teacher as the advantage, as registered pure functions.

The student samples a completion y; a teacher with the same tokenizer scores the same ids. Per sampled token
the reverse KL's single-sample (k1) estimate is

    rkl_t = log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)

and its negative is a dense per-token reward. With discount 0 (each token's return is its own reward, the
Thinking Machines recipe: "On-Policy Distillation", Lu & Thinking Machines Lab 2025, and the Tinker cookbook's
``incorporate_kl_penalty``) the policy gradient of E[-sum_t rkl_t] is that of the reverse KL
KL(pi_student || pi_teacher) on the student's own samples (GKD, Agarwal et al. arXiv 2306.13649, Sec. 3, with
beta = 1: the reverse KL). The loss is the clipped surrogate of GRPO with these advantages (``grpo.grpo_loss``),
so the recipe's corrections, clipping and KL penalty apply unchanged.

- ``opd``: the advantage is the distillation signal alone (no task reward).
- ``algorithm.distill_coef`` > 0 with an RL algorithm: ``add_distillation`` adds ``distill_coef`` x the same
  signal to the task advantages (the teacher as a dense shaping term beside the outcome reward).

Shapes: S sequences, T completion positions; ``mask`` 1 on sampled tokens only (an episode's environment
tokens are context: 0, so they neither score nor learn).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.algorithms.grpo import grpo_loss
from trainer.algorithms.record import Algorithm, check_options, clip_rules, loss_agg_rule
from trainer.algorithms.registry import AdvantageInputs, register_algorithm
from trainer.algorithms.sequence import broadcast_to_tokens


def reverse_kl(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[S, T] per-token reverse-KL estimate log pi_s(y_t) - log pi_t(y_t) on valid tokens, exactly 0 elsewhere.

    Both inputs are log-probs of the SAME sampled ids (the student's). Padding is ignored even if NaN/inf (masked
    before the subtraction). Computed in float32 at least; differentiable in ``student_logprobs``.
    """
    valid = mask != 0
    dtype = torch.promote_types(torch.promote_types(student_logprobs.dtype, teacher_logprobs.dtype), torch.float32)
    zero = torch.zeros((), dtype=dtype, device=student_logprobs.device)
    s = torch.where(valid, student_logprobs.to(dtype), zero)
    t = torch.where(valid, teacher_logprobs.to(dtype), zero)
    return torch.where(valid, s - t, zero)


def distill_rewards(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    """[S, T] the dense per-token reward -(log pi_s(y_t) - log pi_t(y_t)), detached: a constant of the loss."""
    return -reverse_kl(student_logprobs.detach(), teacher_logprobs.detach(), mask)


@dataclass
class OPDConfig:
    """The options of the ``opd`` record (the recipe's ``algorithm:`` keys of a distillation run).

    Read by ``opd_advantages``:
      group_baseline: subtract, per group of completions of one prompt, the mean per-token reward over the
        group's valid tokens (a constant baseline: it leaves the gradient's expectation unchanged and lowers its
        variance). Off by default, as the Thinking Machines recipe and the Tinker cookbook (no baseline: the
        per-token reward is already centred near 0 once the student is close to the teacher).
    Read by ``grpo.grpo_loss`` (the loss): clip_eps_low / clip_eps_high (PPO's 0.2, Schulman et al. arXiv
      1707.06347: one update per batch leaves the ratio at 1, so the clip only matters with several), kl_coef
      (a k3 penalty to the reference policy; 0: the teacher is the anchor), loss_agg (token_mean: every sampled
      token's reverse KL counts the same, as GKD's per-token objective).
    """

    group_baseline: bool = False
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    loss_agg: str = "token_mean"

    def __post_init__(self) -> None:
        check_options(self, [(isinstance(self.group_baseline, bool), "group_baseline", "a bool"),
                             *clip_rules(self), loss_agg_rule(self)])


def opd_advantages(batch: AdvantageInputs, cfg: Any) -> torch.Tensor:
    """[S, T] advantages of on-policy distillation, zero on padding.

    ``batch.token_rewards`` [S, T] must hold the per-token reward -(log pi_s - log pi_t) (``distill_rewards``);
    ``batch.rewards`` (the task's) is not read. With discount 0 the advantage is the token's own reward:
        A_t = r_t                                   (cfg.group_baseline False)
        A_t = r_t - mean of r over the group's valid tokens   (cfg.group_baseline True)
    Returned in float32 (or the rewards' wider dtype).
    """
    if batch.token_rewards is None:
        raise ValueError("opd_advantages: AdvantageInputs.token_rewards is None; expected the per-token "
                         "distillation reward -(log pi_student - log pi_teacher) (a teacher must score the batch)")
    valid = batch.mask != 0
    dtype = torch.promote_types(batch.token_rewards.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=batch.mask.device)
    r = torch.where(valid, batch.token_rewards.detach().to(dtype), zero)
    if not torch.isfinite(r).all():
        rows = torch.nonzero((~torch.isfinite(r)).any(dim=-1)).flatten().tolist()
        raise ValueError(f"opd_advantages: token_rewards are not finite on valid tokens of rows {rows[:10]}")
    if cfg.group_baseline:
        g = batch.group_size
        sums = r.sum(dim=-1).reshape(-1, g).sum(dim=-1, keepdim=True)
        counts = valid.sum(dim=-1).reshape(-1, g).sum(dim=-1, keepdim=True).clamp(min=1)
        baseline = (sums / counts).expand(-1, g).flatten()
        r = r - broadcast_to_tokens(baseline, batch.mask, dtype)
    return torch.where(valid, r, zero)


def add_distillation(advantages: torch.Tensor, token_rewards: torch.Tensor, mask: torch.Tensor,
                     coef: float) -> torch.Tensor:
    """[S, T] task advantages + coef x the per-token distillation reward (``algorithm.distill_coef``), 0 on
    padding. Discount 0 as in ``opd_advantages``: each token gets its own teacher signal, whatever the task
    advantage's shape (a sequence's broadcast outcome advantage, GRPO's)."""
    valid = mask != 0
    dtype = torch.promote_types(advantages.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=advantages.device)
    extra = torch.where(valid, token_rewards.detach().to(dtype), zero)
    return torch.where(valid, advantages.to(dtype) + coef * extra, zero)


register_algorithm(Algorithm(
    name="opd", options=OPDConfig, advantage=opd_advantages, loss=grpo_loss,
    paper="Agarwal et al., GKD, arXiv 2306.13649; Thinking Machines, On-Policy Distillation (2025)",
    # no group statistic unless group_baseline (checked by trainer/config/validate.py); no outcome reward to filter
    min_group_size=1, dynamic_sampling=False, teacher=True))
