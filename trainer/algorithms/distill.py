"""On-policy distillation: the per-token reverse KL to a teacher as the advantage, as registered pure functions.

The student samples a completion y; a teacher with the same tokenizer scores the same ids. Per sampled token
the reverse KL's single-sample (k1) estimate is

    rkl_t = log pi_student(y_t | y_<t) - log pi_teacher(y_t | y_<t)

and its negative r_t = -rkl_t is a dense per-token reward. The advantage of token t is its discounted return over
the sampled tokens from t on, A_t = sum_{k >= 0} gamma^k r_{t+k} (``OPDConfig.gamma``), and its expected policy
gradient E_y[sum_t A_t grad log pi_s(y_t | y_<t)] is, by the score-function identity:

- gamma = 1: exactly -grad KL(pi_s(y) || pi_t(y)), the reverse KL of whole sequences. Its gradient weights each
  token's score by the KL terms of that token and of every later one (reward-to-go: a token also pays for the
  prefixes it leads the student into); earlier terms drop out in expectation. This is MiniLLM's sequence-level
  objective (Gu et al., arXiv 2306.08543: its policy gradient with R_t = sum_{t' >= t} log(p / q_theta), p the
  teacher and q_theta the student, without its length normalisation, clipping and teacher-mixed sampling).
- gamma = 0 (the default): only the token's own term, so the expectation is -grad of the per-token surrogate
  sum_t E_{y_<t ~ pi_s, not differentiated}[KL(pi_s(. | y_<t) || pi_t(. | y_<t))]: each position's next-token
  reverse KL pushed down given the prefix, the prefix distribution held fixed. It is NOT the sequence KL's
  gradient once sequences are longer than one token; it is the choice of the Thinking Machines recipe
  ("On-Policy Distillation", Lu & Thinking Machines Lab 2025: the student optimises the immediate next token
  only) and the Tinker cookbook's default (``kl_discount_factor`` 0.0, ``incorporate_kl_penalty`` in
  tinker_cookbook/distillation/train_on_policy.py), with lower variance than the reward-to-go. GKD
  (Agarwal et al. arXiv 2306.13649, Sec. 3, beta = 1) also trains on per-token reverse KLs of on-policy samples,
  with the full next-token distributions and no gradient through the sampling.

``tests/trainer/algorithms/test_distill.py`` checks both statements in float64 by enumerating every sequence of a
tiny autoregressive student and teacher. The loss is the clipped surrogate of GRPO with these advantages
(``grpo.grpo_loss``), so the recipe's corrections, clipping and KL penalty apply unchanged.

- ``opd``: the advantage is the distillation signal alone (no task reward).
- ``algorithm.distill_coef`` > 0 with an RL algorithm: ``add_distillation`` adds ``distill_coef`` x the per-token
  reward r_t (discount 0, the per-token surrogate above) to the task advantages (the teacher as a dense shaping
  term beside the outcome reward); with ppo it joins each token's reward before GAE, which discounts it with
  ppo's own gamma and lam (trainer/rl/critic.py).

Shapes: S sequences, T completion positions; ``mask`` 1 on sampled tokens only (an episode's environment
tokens are context: 0, so they neither score nor learn, and returns skip them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.algorithms.grpo import grpo_loss
from trainer.algorithms.ppo import gae
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
      gamma: the discount of the per-token rewards over the later sampled tokens (module docstring). 0 (default):
        each token's own reward, the per-token surrogate of the Thinking Machines recipe and the Tinker cookbook
        (``kl_discount_factor`` 0.0). 1: the reward-to-go, whose expected gradient is the sequence reverse KL's
        (MiniLLM, arXiv 2306.08543). In between: a bias-variance trade-off between the two.
      group_baseline: subtract, per group of completions of one prompt, a baseline from each sample's
        advantages: the mean advantage over the valid tokens of the group's OTHER samples (leave-one-out, as RLOO:
        Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al. arXiv 2402.14740).
        Those samples are drawn independently of this one, so the baseline does not depend on its tokens and
        the gradient's expectation is unchanged; a mean that included the sample's own tokens would (the bias of
        GRPO's self-inclusive group mean). Off by default, as the Thinking Machines recipe and the Tinker
        cookbook (no baseline: the per-token reward is already centred near 0 once the student is close to the
        teacher). Needs group_size >= 2.
    Read by ``grpo.grpo_loss`` (the loss): clip_eps_low / clip_eps_high (PPO's 0.2, Schulman et al. arXiv
      1707.06347: one update per batch leaves the ratio at 1, so the clip only matters with several), kl_coef
      (a k3 penalty to the reference policy; 0: the teacher is the anchor), loss_agg (token_mean: every sampled
      token's reverse KL counts the same, as GKD's per-token objective).
    """

    gamma: float = 0.0
    group_baseline: bool = False
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    loss_agg: str = "token_mean"

    def __post_init__(self) -> None:
        check_options(self, [
            (isinstance(self.gamma, (int, float)) and not isinstance(self.gamma, bool) and 0 <= self.gamma <= 1,
             "gamma", "a number in [0, 1] (0: each token's own reverse KL; 1: the sequence reverse KL's gradient)"),
            (isinstance(self.group_baseline, bool), "group_baseline", "a bool"),
            *clip_rules(self), loss_agg_rule(self)])


def distill_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """[S, T] the discounted return of each sampled token, G_t = r_t + gamma * G_(next sampled token), 0 on padding.

    Over the valid positions t_1 < ... < t_L of a row (an episode's environment tokens are skipped: they are not
    the student's actions): ``ppo.gae`` with values 0 and lam 1 is exactly this sum. gamma 0 returns r itself.
    """
    if gamma == 0:
        valid = mask != 0
        zero = torch.zeros((), dtype=token_rewards.dtype, device=token_rewards.device)
        return torch.where(valid, token_rewards, zero)
    return gae(token_rewards, torch.zeros_like(token_rewards), mask, gamma, 1.0)[0]


def opd_advantages(batch: AdvantageInputs, cfg: Any) -> torch.Tensor:
    """[S, T] advantages of on-policy distillation, zero on padding.

    ``batch.token_rewards`` [S, T] must hold the per-token reward r = -(log pi_s - log pi_t) (``distill_rewards``);
    ``batch.rewards`` (the task's) is not read. With G_t the discounted return (``distill_returns``, cfg.gamma):
        A_t = G_t                                                     (cfg.group_baseline False)
        A_t = G_t - b_i,  b_i = mean of G over the valid tokens of the other samples of sample i's group
                                                                      (cfg.group_baseline True)
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
    g = distill_returns(r, batch.mask, cfg.gamma).to(dtype)
    if cfg.group_baseline:
        n = batch.group_size
        if n < 2:
            raise ValueError(f"opd_advantages: group_baseline needs group_size >= 2 (a leave-one-out mean), got {n}")
        sums = g.sum(dim=-1).reshape(-1, n)
        counts = valid.sum(dim=-1).reshape(-1, n).to(dtype)
        # the other samples' tokens: the group's totals minus the sample's own; none valid -> no baseline
        others = (counts.sum(dim=-1, keepdim=True) - counts).clamp(min=1)
        baseline = ((sums.sum(dim=-1, keepdim=True) - sums) / others).flatten()
        g = g - broadcast_to_tokens(baseline, batch.mask, dtype)
    return torch.where(valid, g, zero)


def add_distillation(advantages: torch.Tensor, token_rewards: torch.Tensor, mask: torch.Tensor,
                     coef: float) -> torch.Tensor:
    """[S, T] task advantages + coef x the per-token distillation reward (``algorithm.distill_coef``), 0 on
    padding. Discount 0 (``opd_advantages`` with gamma 0: the per-token surrogate, not the sequence KL's gradient):
    each token gets its own teacher signal, whatever the task advantage's shape (a sequence's broadcast outcome
    advantage, GRPO's)."""
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
