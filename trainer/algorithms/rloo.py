"""RLOO: REINFORCE with a leave-one-out baseline, the whole completion as one action.

References:
- Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
  Human Feedback in LLMs", arXiv 2402.14740 (the leave-one-out baseline; the full completion
  modelled as a single action).
- The loss is TRL's ``RLOOTrainer._compute_loss`` (trl 1.x): a PPO-style clip on the
  SEQUENCE ratio exp(sum_t logprobs - sum_t old_logprobs), averaged over sequences. With one
  optimisation epoch on fresh samples (ratio = 1) it is exactly the paper's REINFORCE estimator;
  the clip only acts on stale or mismatched data (A2C is PPO with one epoch).

Registered as ``"rloo"`` in ``ADVANTAGES`` and ``POLICY_LOSSES``. ``rloo_advantages`` is also the
advantage of PMD-mean (``pmd.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.algorithms.grpo import clipped_surrogate
from trainer.algorithms.kl import behaviour_ratio, kl_k3
from trainer.algorithms.record import Algorithm, check_options, clip_rules
from trainer.algorithms.registry import AdvantageInputs, LossInputs, LossOutput, register_algorithm
from trainer.algorithms.sequence import (
    broadcast_to_tokens,
    constant_groups,
    grouped_rewards,
    leave_one_out_mean,
    per_sequence,
    sequence_terms,
)


@dataclass
class RLOOConfig:
    """The attributes RLOO reads from its (duck-typed) ``cfg`` (``rloo_loss`` only; the advantage reads none).

    clip_eps_low / clip_eps_high: the SEQUENCE ratio is clipped to [1 - low, 1 + high]
      (TRL's RLOOConfig: epsilon = 0.2, epsilon_high = epsilon).
    kl_coef: weight of the sequence's summed k3 KL to the reference policy, in the loss; 0 = off.
      (TRL instead subtracts beta * sum_t k1 from the reward; per sequence, so a comparable scale.)
    """

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        check_options(self, clip_rules(self))


def rloo_advantages(batch: AdvantageInputs, cfg: Any) -> torch.Tensor:
    """Leave-one-out advantages broadcast to tokens: returns [S, T], zero on padding.

    For each group of n = ``group_size`` samples with rewards r:
        A_i = r_i - (1 / (n - 1)) * sum_{j != i} r_j  =  n / (n - 1) * (r_i - mean(r))
    No std normalisation. A group whose rewards are all equal gives exactly 0.
    Reads nothing from ``cfg``. Requires group_size >= 2; NaN/inf rewards raise naming the
    sample index. Computed in float64, returned in float32 (or the wider rewards dtype).
    """
    r = grouped_rewards("rloo_advantages", batch.rewards, batch.group_size)
    adv = r - leave_one_out_mean(r)
    adv = torch.where(constant_groups(r), torch.zeros_like(adv), adv)
    return broadcast_to_tokens(adv.flatten(), batch.mask, torch.promote_types(batch.rewards.dtype, torch.float32))


def rloo_loss(batch: LossInputs, cfg: Any) -> LossOutput:
    """RLOO policy loss on one micro-batch: a clipped REINFORCE step on whole sequences.

    With Delta_i = sum_t (logprobs - old_logprobs) over sequence i's valid tokens, rho_i = exp(Delta_i),
    A_i the sequence's advantage (read at its first valid token, see ``sequence.per_sequence``),
    w_i its importance weight (``is_weights``, constant per sequence) and G = normalizer.num_seqs:
        l_i  = -min(rho_i * A_i, clip(rho_i, 1 - clip_eps_low, 1 + clip_eps_high) * A_i) * w_i
               + kl_coef * sum_t k3(ref, logprobs)_{i,t} * w_kl
        loss = sum_i l_i / G
    with w_kl = w_i, or the token's pi_theta / pi_behaviour with ``behaviour_logprobs`` (the unbiased form,
    ``kl.behaviour_ratio``).
    At rho = 1 the gradient is -A_i * grad(sum_t log pi(y_i,t)) / G: REINFORCE with the LOO baseline.

    Reads cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_coef. Raises if advantages or is_weights
    vary within a sequence (a sequence-level loss), or if kl_coef > 0 without ``ref_logprobs``.

    Metrics (micro-batch contributions; sum over micro-batches and ranks):
      train/pg_loss: the clipped part of ``loss`` (is-weighted).
      train/seq_ratio_mean: mean rho_i over non-empty sequences.
      train/seq_clip_frac_low / train/seq_clip_frac_high: share of sequences with A < 0 and
        rho < 1 - clip_eps_low / with A > 0 and rho > 1 + clip_eps_high.
      train/kl_ref: mean k3 over valid tokens (only when ``ref_logprobs`` is given).
    """
    who = "rloo_loss"
    valid, dtype, zero, adv, seq_lr = sequence_terms(who, batch)
    g = batch.normalizer.num_seqs
    # one action per sequence: PPO's clipped surrogate on the sequence log-ratio (vs 0 = log 1)
    pg, ratio = clipped_surrogate(seq_lr, torch.zeros_like(seq_lr), adv, cfg.clip_eps_low, cfg.clip_eps_high)
    w = None
    if batch.is_weights is not None:
        w = per_sequence(who, "is_weights", batch.is_weights, batch.mask).to(dtype)
        pg = pg * w
    per_seq = pg
    metrics: dict[str, float] = {}
    if batch.ref_logprobs is not None:
        lp = torch.where(valid, batch.logprobs.to(dtype), zero)
        kl = torch.where(valid, kl_k3(lp, torch.where(valid, batch.ref_logprobs.detach().to(dtype), zero)), zero)
        metrics["train/kl_ref"] = (kl.detach().sum() / batch.normalizer.num_tokens).item()
        if cfg.kl_coef > 0:
            if batch.behaviour_logprobs is not None:  # the unbiased form: each token's k3 times pi_theta / pi_b
                behaviour = torch.where(valid, batch.behaviour_logprobs.detach().to(dtype), zero)
                seq_kl = torch.where(valid, kl * behaviour_ratio(lp, behaviour), zero).sum(dim=-1)
            else:
                seq_kl = kl.sum(dim=-1) * (w if w is not None else 1.0)
            per_seq = per_seq + cfg.kl_coef * seq_kl
    elif cfg.kl_coef > 0:
        raise ValueError(f"{who}: cfg.kl_coef={cfg.kl_coef} > 0 but LossInputs.ref_logprobs is None")
    loss = per_seq.sum() / g

    with torch.no_grad():
        has = valid.any(dim=-1)
        ratio = ratio.detach()
        metrics["train/pg_loss"] = (pg.detach().sum() / g).item()
        metrics["train/seq_ratio_mean"] = (torch.where(has, ratio, zero).sum() / g).item()
        metrics["train/seq_clip_frac_low"] = (has & (adv < 0) & (ratio < 1.0 - cfg.clip_eps_low)).sum().item() / g
        metrics["train/seq_clip_frac_high"] = (has & (adv > 0) & (ratio > 1.0 + cfg.clip_eps_high)).sum().item() / g
    return LossOutput(loss=loss, metrics=metrics)


register_algorithm(Algorithm(name="rloo", options=RLOOConfig, advantage=rloo_advantages, loss=rloo_loss,
                             token_weights=False,
                             paper="Ahmadian et al., Back to Basics: REINFORCE-style optimization, arXiv 2402.14740, "
                                   "Sec. 3.2; clip range as TRL's RLOOConfig"))
