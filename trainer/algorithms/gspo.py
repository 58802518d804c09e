"""GSPO: Group Sequence Policy Optimization -- importance ratio and clipping at the sequence level.

Reference: Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071:
- The objective (Eq. 5) uses s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|) = exp(mean_t log(pi/pi_old)(y_i,t)),
  the length-normalised sequence ratio, clipped per SEQUENCE:
      J = E[ 1/G sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) ]
  with GRPO's group-normalised advantages A_i. Because s_i is a geometric mean its clip range is
  tiny: the paper's experiments set the two ranges of Eq. 5 to 3e-4 and 4e-4, not PPO's 0.2.
- Its gradient analysis: grad J = E[ 1/G sum_i s_i A_i * 1/|y_i| sum_t grad log pi(y_i,t) ] (unclipped).
- The "GSPO-token" variant: s_{i,t} = sg[s_i] * pi(y_i,t) / sg[pi(y_i,t)], same value as s_i, whose
  gradient is the one above; with the same A on every token it IS GSPO, and it also accepts
  per-token advantages. This module implements that token form (as verl's ``gspo`` loss), so
  per-token importance weights and KL terms compose like GRPO's.

Registered as ``"gspo"`` in ``POLICY_LOSSES``; ``ADVANTAGES["gspo"]`` is GRPO's advantage
estimator unchanged (the paper keeps it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.algorithms.aggregation import aggregate
from trainer.algorithms.grpo import LOG_RATIO_CLAMP, add_kl_and_is_weights, clipped_surrogate, grpo_advantages
from trainer.algorithms.record import Algorithm, check_options, clip_rules, group_scale_rules
from trainer.algorithms.registry import LossInputs, LossOutput, register_algorithm
from trainer.algorithms.sequence import sequence_lengths, sequence_log_ratio

# GSPO's objective is a mean over sequences of each sequence's token mean (its 1/G and 1/|y_i|).
GSPO_LOSS_AGG = "seq_mean_token_mean"



@dataclass
class GSPOConfig:
    """The attributes GSPO reads from its (duck-typed) ``cfg``; defaults are the paper's.

    Read by the advantage (GRPO's): scale_rewards, eps (see ``grpo.GRPOConfig``).
    Read by ``gspo_loss``:
      clip_eps_low / clip_eps_high: the sequence ratio is clipped to [1 - low, 1 + high]
        (paper: 3e-4 / 4e-4).
      kl_coef: weight of the per-token k3 KL to the reference, aggregated like the policy term; 0 = off.
    ``loss_agg`` is NOT read: GSPO's objective fixes the aggregation to ``seq_mean_token_mean``.
    """

    scale_rewards: bool = True
    eps: float = 1e-4
    clip_eps_low: float = 3e-4
    clip_eps_high: float = 4e-4
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        check_options(self, [*group_scale_rules(self), *clip_rules(self)])


def gspo_loss(batch: LossInputs, cfg: Any) -> LossOutput:
    """GSPO policy loss (token form) on one micro-batch.

    With L_i the valid length of sequence i, s_i = exp(sum_t (logprobs - old_logprobs) / L_i)
    (log clamped to +-LOG_RATIO_CLAMP) and, per valid token, log s_{i,t} = sg[log s_i] + lp_t - sg[lp_t]:
        l_{i,t} = -min(s_{i,t} A_{i,t}, clip(s_{i,t}, 1 - clip_eps_low, 1 + clip_eps_high) A_{i,t})
                  + kl_coef * k3(ref, logprobs)_{i,t}
        l_{i,t} = l_{i,t} * is_weights_{i,t}                 (if given)
        loss = aggregate(l, mask, "seq_mean_token_mean", normalizer) = 1/G sum_i 1/L_i sum_t l_{i,t}
    Value: s_{i,t} = s_i, so clipping acts on whole sequences. Gradient w.r.t. logprobs[i, t]
    (unclipped, no KL): -s_i A_i / (L_i G) -- the paper's sequence-level gradient.

    Reads cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_coef (not cfg.loss_agg). Padding is ignored
    even if NaN/inf; constants are detached; computed in float32 at least.

    Metrics (micro-batch contributions; sum over micro-batches and ranks):
      train/pg_loss: the clipped part of ``loss`` (is-weighted).
      train/seq_ratio_mean: mean s_i over non-empty sequences.
      train/clip_frac_low / train/clip_frac_high: share of valid TOKENS whose clipped branch is
        active (A < 0 and s < 1 - clip_eps_low / A > 0 and s > 1 + clip_eps_high), as GRPO's keys
        and the paper's "fraction of clipped tokens".
      train/kl_ref: mean k3 over valid tokens (only when ``ref_logprobs`` is given).
    """
    valid = batch.mask != 0
    dtype = torch.promote_types(batch.logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=batch.logprobs.device)

    def clean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(valid, x.detach().to(dtype), zero)

    lp = torch.where(valid, batch.logprobs.to(dtype), zero)
    lengths = sequence_lengths(batch.mask).clamp(min=1).to(dtype)
    log_s = (sequence_log_ratio(batch.logprobs, batch.old_logprobs, batch.mask) / lengths).detach()
    log_s = log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    # Value log s_i on every token, gradient d lp_t: the GSPO-token construction.
    log_s_tok = torch.where(valid, log_s[:, None] + (lp - lp.detach()), zero)
    adv = clean(batch.advantages)
    pg, ratio = clipped_surrogate(log_s_tok, torch.zeros_like(log_s_tok), adv, cfg.clip_eps_low, cfg.clip_eps_high)

    metrics: dict[str, float] = {}
    per_token, pg = add_kl_and_is_weights(pg, lp, batch, cfg, valid, clean, metrics, who="gspo_loss")
    loss = aggregate(per_token, valid, GSPO_LOSS_AGG, batch.normalizer)

    with torch.no_grad():
        n = batch.normalizer.num_tokens
        ratio = ratio.detach()
        has = valid.any(dim=-1)
        metrics["train/pg_loss"] = aggregate(pg.detach(), valid, GSPO_LOSS_AGG, batch.normalizer).item()
        metrics["train/seq_ratio_mean"] = (torch.where(has, log_s.exp(), zero).sum() / batch.normalizer.num_seqs).item()
        metrics["train/clip_frac_low"] = (valid & (adv < 0) & (ratio < 1.0 - cfg.clip_eps_low)).sum().item() / n
        metrics["train/clip_frac_high"] = (valid & (adv > 0) & (ratio > 1.0 + cfg.clip_eps_high)).sum().item() / n
    return LossOutput(loss=loss, metrics=metrics)


register_algorithm(Algorithm(name="gspo", options=GSPOConfig, advantage=grpo_advantages, loss=gspo_loss,
                             paper="Zheng et al., Group Sequence Policy Optimization, arXiv 2507.18071, Sec. 5.1 (clip ranges 3e-4 / 4e-4)"))
