"""GRPO: group-relative advantages and the clipped surrogate loss, as registered pure functions.

References:
- GRPO: Shao et al., DeepSeekMath, arXiv 2402.03300, Sec. 4.1 (Eq. 3 objective, Eq. 4 k3 KL penalty).
- DAPO: Yu et al., arXiv 2503.14476 (decoupled clip_eps_low / clip_eps_high "clip-higher";
  token-level aggregation).
- Dr. GRPO: Liu et al., arXiv 2503.20783 (no std normalisation: ``scale_rewards=False``;
  constant-length normaliser: ``loss_agg="seq_mean_token_sum_norm"``).
- PPO clipped surrogate: Schulman et al., arXiv 1707.06347, Eq. 7.

Registered as the ``"grpo"`` record (bottom of this file).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from trainer.algorithms.aggregation import aggregate
from trainer.algorithms.kl import behaviour_ratio, kl_k3
from trainer.algorithms.record import Algorithm, check_options, clip_rules, group_scale_rules, loss_agg_rule
from trainer.algorithms.registry import AdvantageInputs, LossInputs, LossOutput, register_algorithm
from trainer.algorithms.sequence import broadcast_to_tokens, constant_groups, grouped_rewards

# exp(20) ~ 4.9e8: keeps the ratio finite in float32 when the policy and the data's
# policy disagree wildly on a token (verl clamps the log-ratio the same way). Beyond it the
# token's gradient is zero, which only matters for a batch that is already broken.
LOG_RATIO_CLAMP = 20.0


@dataclass
class GRPOConfig:
    """The attributes GRPO reads from its (duck-typed) ``cfg``.

    The options of the ``grpo`` record: the recipe's ``algorithm:`` keys of a GRPO run are parsed
    into it. Defaults: the PPO clip range 0.2 (Schulman et al. arXiv 1707.06347, Sec. 6.1; DeepSeekMath
    uses the same objective), no KL penalty (DeepSeekMath used 0.04; DAPO Sec. 2.3 and Dr. GRPO drop it,
    as TRL's GRPOConfig default beta=0.0 does), token-mean aggregation (DAPO Sec. 3.3).

    Read by ``grpo_advantages``:
      scale_rewards: divide group-centred rewards by the group std (GRPO); False = Dr. GRPO.
      eps: added to the std before dividing (TRL's default 1e-4; verl uses 1e-6).
    Read by ``grpo_loss``:
      clip_eps_low: ratio clipped below at 1 - clip_eps_low, in [0, 1).
      clip_eps_high: ratio clipped above at 1 + clip_eps_high, >= 0 (DAPO uses 0.28).
      kl_coef: weight of the k3 KL penalty to the reference policy; 0 turns it off
        (DeepSeekMath used 0.04; DAPO and Dr. GRPO drop it).
      loss_agg: one of ``aggregation.AGG_MODES``.
    """

    scale_rewards: bool = True
    eps: float = 1e-4
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    kl_coef: float = 0.0
    loss_agg: str = "token_mean"

    def __post_init__(self) -> None:
        check_options(self, [*group_scale_rules(self), *clip_rules(self), loss_agg_rule(self)])


def grpo_advantages(batch: AdvantageInputs, cfg: Any) -> torch.Tensor:
    """Group-relative advantages broadcast to tokens: returns [S, T], zero on padding.

    For each group g of ``group_size`` consecutive samples with rewards r (shape [G]):
        A_i = (r_i - mean(r)) / (std(r) + eps)     if cfg.scale_rewards
        A_i =  r_i - mean(r)                           otherwise (Dr. GRPO)
    std is the UNBIASED sample std (divisor G - 1), as ``torch.std`` in TRL's GRPOTrainer
    and verl's ``compute_grpo_outcome_advantage``. A group whose rewards are all equal
    gives exactly 0 (no signal), never eps-amplified rounding noise or NaN.

    Reads cfg.scale_rewards, cfg.eps. Requires group_size >= 2 (a group of one has
    no baseline and no std). Computed in float64, returned in float32 (or wider rewards dtype).
    """
    r = grouped_rewards("grpo_advantages", batch.rewards, batch.group_size)
    centred = r - r.mean(dim=-1, keepdim=True)
    # mean() of equal float64 rewards can miss them by an ulp (0.1 x 3: -1.4e-17) while their
    # std is 0: the quotient would be ulp/eps noise, as large as ~1e3 for eps = 1e-20.
    centred = torch.where(constant_groups(r), torch.zeros_like(centred), centred)
    if cfg.scale_rewards:
        centred = centred / (r.std(dim=-1, keepdim=True, correction=1) + cfg.eps)
    return broadcast_to_tokens(centred.flatten(), batch.mask, torch.promote_types(batch.rewards.dtype, torch.float32))


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token with decoupled clip range (DAPO "clip-higher").

    All [S, T]. rho = exp(logprobs - old_logprobs) (log-ratio clamped to +-LOG_RATIO_CLAMP);
        loss = -min(rho * A, clip(rho, 1 - clip_eps_low, 1 + clip_eps_high) * A).
    Returns (loss [S, T], rho [S, T]). Gradient reaches ``logprobs`` only where the clip is
    inactive. No masking here: give finite inputs (``grpo_loss`` zeroes padding first).
    """
    ratio = torch.exp((logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped = ratio.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return -torch.minimum(ratio * advantages, clipped * advantages), ratio


def add_kl_and_is_weights(pg: torch.Tensor, lp: torch.Tensor, batch: LossInputs, cfg: Any, valid: torch.Tensor,
                          clean, metrics: dict, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-token tail shared by the clipped losses: pg * is_weights + kl_coef * k3(ref, lp) * (its weight).

    The KL term's weight is ``is_weights`` (as the policy term's), or with ``batch.behaviour_logprobs`` the ratio
    pi_theta / pi_behaviour of its unbiased form (``kl.behaviour_ratio``). Returns (per_token loss, is-weighted pg);
    logs ``train/kl_ref`` (unweighted token mean of k3) into ``metrics`` when a reference is given. ``clean``
    zeroes padding and detaches. A configured penalty without a reference is an error, never silently skipped.
    """
    w = clean(batch.is_weights) if batch.is_weights is not None else None
    pg = pg * w if w is not None else pg
    per_token = pg
    if batch.ref_logprobs is not None:
        kl = kl_k3(lp, clean(batch.ref_logprobs))
        metrics["train/kl_ref"] = aggregate(kl.detach(), valid, "token_mean", batch.normalizer).item()
        if cfg.kl_coef > 0:
            if batch.behaviour_logprobs is not None:
                kl = kl * behaviour_ratio(lp, clean(batch.behaviour_logprobs))
            elif w is not None:
                kl = kl * w
            per_token = per_token + cfg.kl_coef * kl
    elif cfg.kl_coef > 0:
        raise ValueError(f"{who}: cfg.kl_coef={cfg.kl_coef} > 0 but LossInputs.ref_logprobs is None")
    return per_token, pg


def grpo_loss(batch: LossInputs, cfg: Any) -> LossOutput:
    """GRPO policy loss on one micro-batch (DeepSeekMath Eq. 3 with DAPO/Dr. GRPO options).

    Per valid token, with rho = exp(logprobs - old_logprobs):
        l = -min(rho*A, clip(rho, 1-clip_eps_low, 1+clip_eps_high)*A) * w + kl_coef * k3(ref, logprobs) * w_kl
    w = is_weights (1 if None); w_kl = w, or pi_theta / pi_behaviour with ``behaviour_logprobs`` (the
    penalty's unbiased form, ``add_kl_and_is_weights``).
    loss = aggregate(l, mask, cfg.loss_agg, batch.normalizer) -- a scalar whose sum over
    the micro-batches of the step is the full-batch loss (see ``aggregation``).

    Reads cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_coef, cfg.loss_agg.
    ``old_logprobs``, ``advantages``, ``ref_logprobs``, ``is_weights`` and ``behaviour_logprobs`` are detached here;
    padding is ignored even if it holds NaN/inf. ``kl_coef > 0`` without ``ref_logprobs`` is an
    error (a configured penalty is never silently skipped). Computed in float32 at least.

    Metrics (each a micro-batch contribution: sum them over micro-batches and ranks):
      train/pg_loss: the clipped-surrogate part of ``loss`` (is-weighted), same aggregation.
      train/kl_ref: mean k3 over valid tokens (unweighted, not times kl_coef); only when
        ``ref_logprobs`` is given.
      train/ratio_mean: mean rho over valid tokens.
      train/clip_frac_low: share of valid tokens with A < 0 and rho < 1 - clip_eps_low.
      train/clip_frac_high: share of valid tokens with A > 0 and rho > 1 + clip_eps_high.
    """
    valid = batch.mask != 0
    dtype = torch.promote_types(batch.logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=batch.logprobs.device)

    def clean(x: torch.Tensor, detach: bool = True) -> torch.Tensor:
        # Zero the padding BEFORE any exp: masking only afterwards still leaves exp's backward
        # computing 0 * inf = NaN at a padded -inf/NaN, which reaches the gradient.
        return torch.where(valid, (x.detach() if detach else x).to(dtype), zero)

    lp = clean(batch.logprobs, detach=False)
    adv = clean(batch.advantages)
    pg, ratio = clipped_surrogate(lp, clean(batch.old_logprobs), adv, cfg.clip_eps_low, cfg.clip_eps_high)

    metrics: dict[str, float] = {}
    per_token, pg = add_kl_and_is_weights(pg, lp, batch, cfg, valid, clean, metrics, who="grpo_loss")
    loss = aggregate(per_token, valid, cfg.loss_agg, batch.normalizer)

    with torch.no_grad():
        n = batch.normalizer.num_tokens
        ratio = ratio.detach()
        metrics["train/pg_loss"] = aggregate(pg.detach(), valid, cfg.loss_agg, batch.normalizer).item()
        metrics["train/ratio_mean"] = (torch.where(valid, ratio, zero).sum() / n).item()
        low = valid & (adv < 0) & (ratio < 1.0 - cfg.clip_eps_low)
        high = valid & (adv > 0) & (ratio > 1.0 + cfg.clip_eps_high)
        metrics["train/clip_frac_low"] = low.sum().item() / n
        metrics["train/clip_frac_high"] = high.sum().item() / n
    return LossOutput(loss=loss, metrics=metrics)


register_algorithm(Algorithm(name="grpo", options=GRPOConfig, advantage=grpo_advantages, loss=grpo_loss,
                             paper="Shao et al., DeepSeekMath, arXiv 2402.03300, Sec. 4.1"))
