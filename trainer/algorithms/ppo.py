"""PPO for language models: KL-shaped token rewards, GAE, whitening, clipped policy and value losses.

References:
- PPO: Schulman et al., arXiv 1707.06347 -- clipped surrogate (Eq. 7), value loss and entropy
  bonus combined (Eq. 9).
- GAE: Schulman et al., arXiv 1506.02438, Eq. 16: A_t = sum_l (gamma lam)^l delta_{t+l},
  delta_t = r_t + gamma V_{t+1} - V_t.
- RLHF setup: Ziegler et al., arXiv 1909.08593 (sequence score at the end, -beta KL per token to the
  reference, adaptive KL controller, Sec. 2.2); Stiennon et al., arXiv 2009.01325; as implemented by
  TRL's PPOTrainer (StackLLaMA): KL estimator k1 by default, value clip ``cliprange_value``, advantages
  whitened over the batch, returns = GAE advantages + values, loss = pg + vf_coef * vf.
- Value clipping: OpenAI baselines ``ppo2``, kept by TRL (Huang et al., "The N Implementation Details of
  RLHF with PPO", 2023).

Registered as ``"ppo"`` in ``ADVANTAGES`` (GAE from ``AdvantageInputs.token_rewards`` and
``AdvantageInputs.values``) and ``POLICY_LOSSES`` (policy + vf_coef * value - ent_coef * entropy).
The loop owns the critic, calls ``ppo_token_rewards`` with the controller's current beta, and
``ppo_returns`` for the value targets.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from trainer.algorithms.aggregation import aggregate
from trainer.algorithms.grpo import grpo_loss
from trainer.algorithms.kl import kl_k1, kl_k2, kl_k3
from trainer.algorithms.record import Algorithm, check_options, clip_rules, loss_agg_rule
from trainer.algorithms.registry import AdvantageInputs, LossInputs, LossOutput, register_algorithm
from trainer.algorithms.sequence import whiten

KL_ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


@dataclass
class PPOConfig:
    """The attributes PPO reads from its (duck-typed) ``cfg``; defaults follow TRL's PPOConfig.

    Read by ``ppo_advantages`` / ``ppo_returns``:
      gamma: GAE discount over completion tokens, in [0, 1] (TRL 1.0: the score is not discounted).
      lam: GAE lambda, in [0, 1] (TRL 0.95).
      whiten_advantages: whiten advantages over the batch's valid tokens (TRL always does).
      whiten_rewards: scale the KL-shaped token rewards to unit variance over the batch, mean kept
        (TRL's whiten_rewards: masked_whiten(..., shift_mean=False)); off as in TRL. Read by the loop
        (``trainer.rl.critic.ppo_targets``).
    Read by ``ppo_loss``:
      clip_eps_low / clip_eps_high: policy ratio clip (TRL ``cliprange`` 0.2).
      loss_agg: aggregation of all three terms (TRL: token mean).
      kl_coef: optional k3 KL-to-reference in the LOSS, as GRPO's; 0 = off (PPO's KL lives in the reward).
      vf_coef: weight of the value loss, >= 0 (TRL 0.1).
      value_clip: the value prediction is clipped to old_values +- value_clip; None = unclipped (TRL 0.2).
      ent_coef: weight of the entropy bonus, >= 0 (0: TRL has none).
    Read by ``make_kl_controller`` (the loop's reward shaping):
      reward_kl_coef: beta, or the adaptive controller's initial beta, >= 0 (TRL 0.05).
      reward_kl_target: None = fixed beta; a number = AdaptiveKLController target (Ziegler: 6.0 nats).
      reward_kl_horizon: AdaptiveKLController horizon, in samples (Ziegler/TRL 10000).
      reward_kl_estimator: per-token KL estimator for the reward, one of k1, k2, k3 (TRL: k1).
    """

    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    loss_agg: str = "token_mean"
    kl_coef: float = 0.0
    vf_coef: float = 0.1
    value_clip: Optional[float] = 0.2
    ent_coef: float = 0.0
    reward_kl_coef: float = 0.05
    reward_kl_target: Optional[float] = None
    reward_kl_horizon: int = 10000
    reward_kl_estimator: str = "k1"

    def __post_init__(self) -> None:
        check_options(self, [
            (0 <= self.gamma <= 1, "gamma", "in [0, 1]"),
            (0 <= self.lam <= 1, "lam", "in [0, 1]"),
            (isinstance(self.whiten_advantages, bool), "whiten_advantages", "a bool"),
            (isinstance(self.whiten_rewards, bool), "whiten_rewards", "a bool"),
            *clip_rules(self),
            loss_agg_rule(self),
            (self.vf_coef >= 0, "vf_coef", ">= 0"),
            (self.value_clip is None or self.value_clip > 0, "value_clip", "None or > 0"),
            (self.ent_coef >= 0, "ent_coef", ">= 0"),
            (self.reward_kl_coef >= 0, "reward_kl_coef", ">= 0"),
            (self.reward_kl_target is None or self.reward_kl_target > 0, "reward_kl_target", "None or > 0"),
            (isinstance(self.reward_kl_horizon, int) and self.reward_kl_horizon >= 1, "reward_kl_horizon", "an int >= 1"),
            (self.reward_kl_estimator in KL_ESTIMATORS, "reward_kl_estimator", "one of " + ", ".join(KL_ESTIMATORS)),
        ])


def _check_shapes(who: str, mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    if mask.dim() != 2:
        raise ValueError(f"{who}: mask must be 2-D [S, T], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(f"{who}: {name} has shape {tuple(t.shape)}, expected {tuple(mask.shape)} (mask's)")


def _check_finite_on_valid(who: str, name: str, x: torch.Tensor, valid: torch.Tensor) -> None:
    bad = valid & ~torch.isfinite(x)
    if bad.any():
        rows = torch.nonzero(bad.any(dim=-1)).flatten().tolist()
        raise ValueError(f"{who}: {name} are not finite on valid tokens of sequences {rows[:10]}")


# --------------------------------------------------------------------------- rewards and GAE


def _on_valid(valid: torch.Tensor, *tensors: torch.Tensor, also: torch.dtype = torch.float32):
    """(dtype, zero, tensors): detached, in their common dtype (float32 at least), exactly 0 off ``valid``."""
    dtype = also
    for x in tensors:
        dtype = torch.promote_types(dtype, x.dtype)
    dtype = torch.promote_types(dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=valid.device)
    return dtype, zero, [torch.where(valid, x.detach().to(dtype), zero) for x in tensors]


def ppo_token_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    beta: float,
    kl_estimator: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rewards of RLHF-PPO: -beta * KL_t on every valid token, plus the score on the last.

    scores [S]; logprobs, ref_logprobs, mask [S, T] (logprobs of the policy that sampled the tokens).
        kl[i, t] = KL_ESTIMATORS[kl_estimator](logprobs, ref_logprobs)[i, t]     (valid t, else 0)
        rewards[i, t] = -beta * kl[i, t] + (scores[i] if t is i's last valid token else 0)
    (Ziegler et al. arXiv 1909.08593 Sec. 2.2; TRL PPOTrainer.) Returns (rewards [S, T], kl [S, T]),
    detached, 0 on padding, in float32 at least. The adaptive controller's ``current_kl`` is the mean
    per-sequence KL: ``kl.sum(-1).mean()``.

    Raises ValueError naming the index for a NaN/inf score, a sequence without valid tokens (its
    score would have nowhere to go), NaN/inf log-probs on valid tokens, or an unknown estimator.
    """
    who = "ppo_token_rewards"
    _check_shapes(who, mask, logprobs=logprobs, ref_logprobs=ref_logprobs)
    if scores.shape != (mask.shape[0],):
        raise ValueError(f"{who}: scores has shape {tuple(scores.shape)}, expected ({mask.shape[0]},) [S]")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"{who}: unknown kl_estimator {kl_estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")
    if not (isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 0):
        raise ValueError(f"{who}: beta must be a finite number >= 0, got {beta!r}")
    finite = torch.isfinite(scores)
    if not finite.all():
        bad = torch.nonzero(~finite).flatten().tolist()
        raise ValueError(f"{who}: scores are not finite at sequence indices {bad[:10]}")
    valid = mask != 0
    empty = ~valid.any(dim=-1)
    if empty.any():
        rows = torch.nonzero(empty).flatten().tolist()
        raise ValueError(f"{who}: sequences {rows[:10]} have no valid token for their score")
    _check_finite_on_valid(who, "logprobs", logprobs, valid)
    _check_finite_on_valid(who, "ref_logprobs", ref_logprobs, valid)

    dtype, zero, (lp, ref) = _on_valid(valid, logprobs, ref_logprobs, also=scores.dtype)
    kl = torch.where(valid, KL_ESTIMATORS[kl_estimator](lp, ref), zero)
    rewards = -beta * kl
    t = mask.shape[1]
    last = (t - 1) - valid.flip(-1).to(torch.int32).argmax(dim=-1)  # index of each row's last valid token
    rewards = rewards.scatter_add(1, last[:, None], scores.detach().to(dtype)[:, None])
    return rewards, kl


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each completion.

    All [S, T]. Over the valid positions t_1 < ... < t_L of a row (masked positions are skipped,
    as if absent; the episode ends after t_L, so V after it is 0):
        delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}
        A_{t_k} = delta_k + gamma * lam * A_{t_{k+1}},     A_{t_{L+1}} = V_{t_{L+1}} = 0
        returns = A + V
    (arXiv 1506.02438 Eq. 16; verl ``compute_gae_advantage_return`` skips masked tokens the same way.)
    Returns (advantages, returns), detached, 0 on padding, in float32 at least. Padding values are
    ignored even if NaN/inf; NaN/inf on valid tokens raise. A reverse loop over T, vectorised over S.
    """
    who = "gae"
    _check_shapes(who, mask, token_rewards=token_rewards, values=values)
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not (isinstance(x, (int, float)) and 0 <= x <= 1):
            raise ValueError(f"{who}: {name} must be a number in [0, 1], got {x!r}")
    valid = mask != 0
    _check_finite_on_valid(who, "token_rewards", token_rewards, valid)
    _check_finite_on_valid(who, "values", values, valid)
    dtype, zero, (r, v) = _on_valid(valid, token_rewards, values)
    s, t_len = mask.shape
    adv = torch.zeros(s, t_len, dtype=dtype, device=mask.device)
    next_value = torch.zeros(s, dtype=dtype, device=mask.device)
    next_adv = torch.zeros(s, dtype=dtype, device=mask.device)
    gamma_lam = gamma * lam
    for t in reversed(range(t_len)):
        m = valid[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma_lam * next_adv
        adv[:, t] = torch.where(m, a, zero)
        next_value = torch.where(m, v[:, t], next_value)
        next_adv = torch.where(m, a, next_adv)
    return adv, torch.where(valid, adv + v, zero)


def _gae_inputs(who: str, batch: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    if batch.values is None:
        raise ValueError(f"{who}: AdvantageInputs.values is None; GAE needs the critic's values [S, T]")
    if batch.token_rewards is None:
        raise ValueError(
            f"{who}: AdvantageInputs.token_rewards is None; build them with ppo_token_rewards(scores, "
            "logprobs, ref_logprobs, mask, beta, kl_estimator)"
        )
    return batch.token_rewards, batch.values


def ppo_advantages(batch: AdvantageInputs, cfg: Any) -> torch.Tensor:
    """GAE advantages [S, T] from ``batch.token_rewards`` and ``batch.values``, whitened if configured.

    ``gae(token_rewards, values, mask, cfg.gamma, cfg.lam)[0]``, then ``sequence.whiten`` over the
    batch's valid tokens (mean and std; TRL's ``masked_whiten``) when cfg.whiten_advantages.
    ``batch.rewards`` is not read (the score is already in ``token_rewards``); group_size may be 1.
    Reads cfg.gamma, cfg.lam, cfg.whiten_advantages. Raises naming ``values`` / ``token_rewards``
    when missing. Value targets come from ``ppo_returns`` (unwhitened advantages + values).
    """
    rewards, values = _gae_inputs("ppo_advantages", batch)
    adv, _ = gae(rewards, values, batch.mask, cfg.gamma, cfg.lam)
    return whiten(adv, batch.mask, all_sum=batch.all_sum) if cfg.whiten_advantages else adv


def ppo_returns(batch: AdvantageInputs, cfg: Any) -> torch.Tensor:
    """Value targets [S, T]: GAE advantages (before whitening) + values; 0 on padding. Reads cfg.gamma, cfg.lam."""
    rewards, values = _gae_inputs("ppo_returns", batch)
    return gae(rewards, values, batch.mask, cfg.gamma, cfg.lam)[1]


# --------------------------------------------------------------------------- losses


def clipped_value_loss(
    values: torch.Tensor, old_values: Optional[torch.Tensor], returns: torch.Tensor, value_clip: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's value loss per token, all [S, T]:

        V_c = clip(V, V_old - value_clip, V_old + value_clip)
        l   = max((V - R)^2, (V_c - R)^2) / 2            (value_clip None: (V - R)^2 / 2)
    Returns (l, clipped) where ``clipped`` marks tokens whose clipped term is strictly larger (the
    gradient is then 0: V is outside the clip range on the wrong side). No masking here.
    """
    unclipped = (values - returns).square()
    if value_clip is None:
        return unclipped / 2, torch.zeros_like(unclipped, dtype=torch.bool)
    v_c = torch.clamp(values, old_values - value_clip, old_values + value_clip)
    clipped_sq = (v_c - returns).square()
    return torch.maximum(unclipped, clipped_sq) / 2, clipped_sq > unclipped


def ppo_loss(batch: LossInputs, cfg: Any) -> LossOutput:
    """PPO loss on one micro-batch: clipped policy surrogate + vf_coef * value loss - ent_coef * entropy.

        loss = P + vf_coef * aggregate(l_v) - ent_coef * aggregate(entropy)
    P is ``grpo_loss`` unchanged: the clipped surrogate on ``advantages`` (asymmetric clip, optional
    k3 KL in the loss, ``is_weights`` on these policy terms only), aggregated with cfg.loss_agg;
    l_v is ``clipped_value_loss(values, old_values, returns, cfg.value_clip)``; every term uses
    cfg.loss_agg and the global normaliser, so micro-batch losses sum to the full-batch loss.

    Reads cfg.clip_eps_low, cfg.clip_eps_high, cfg.kl_coef, cfg.loss_agg, cfg.vf_coef,
    cfg.value_clip, cfg.ent_coef. Requires (ValueError naming the field if None):
    ``values`` and ``returns`` when vf_coef > 0, plus ``old_values`` when value_clip is not None;
    ``entropy`` when ent_coef > 0. ``values`` and ``entropy`` carry gradient; ``old_values`` and
    ``returns`` are detached. Padding is ignored even if NaN/inf.

    Metrics (micro-batch contributions) -- those of ``grpo_loss`` plus:
      train/vf_loss: aggregate(l_v) (not times vf_coef), when values are given.
      train/vf_clip_frac: share of valid tokens whose clipped value term is the larger one.
      train/entropy: mean entropy over valid tokens, when given.
      train/approx_kl: mean k3 estimate of KL(pi_old || pi) over valid tokens (CleanRL's approx_kl).
    """
    who = "ppo_loss"
    out = grpo_loss(batch, cfg)
    loss, metrics = out.loss, dict(out.metrics)
    valid = batch.mask != 0
    dtype = torch.promote_types(batch.logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=batch.logprobs.device)

    def clean(x: torch.Tensor, detach: bool = True) -> torch.Tensor:
        return torch.where(valid, (x.detach() if detach else x).to(dtype), zero)

    def required(name: str, why: str) -> torch.Tensor:
        x = getattr(batch, name)
        if x is None:
            raise ValueError(f"{who}: LossInputs.{name} is None but {why}")
        return x

    if cfg.vf_coef > 0 or batch.values is not None:
        why = f"cfg.vf_coef={cfg.vf_coef} needs a value loss" if cfg.vf_coef > 0 else "values are given"
        values = clean(required("values", why), detach=False)
        returns = clean(required("returns", why))
        old_values = None
        if cfg.value_clip is not None:
            old_values = clean(required("old_values", f"cfg.value_clip={cfg.value_clip} clips around them"))
        l_v, clipped = clipped_value_loss(values, old_values, returns, cfg.value_clip)
        vf = aggregate(l_v, valid, cfg.loss_agg, batch.normalizer)
        if cfg.vf_coef > 0:
            loss = loss + cfg.vf_coef * vf
        metrics["train/vf_loss"] = vf.item()
        metrics["train/vf_clip_frac"] = (valid & clipped).sum().item() / batch.normalizer.num_tokens
    if cfg.ent_coef > 0 or batch.entropy is not None:
        ent_in = required("entropy", f"cfg.ent_coef={cfg.ent_coef} needs an entropy bonus")
        ent = aggregate(clean(ent_in, detach=False), valid, cfg.loss_agg, batch.normalizer)
        if cfg.ent_coef > 0:
            loss = loss - cfg.ent_coef * ent
        metrics["train/entropy"] = aggregate(clean(ent_in), valid, "token_mean", batch.normalizer).item()
    with torch.no_grad():
        # tokens were sampled from pi_old: k3 with log r = log(pi / pi_old) estimates KL(pi_old || pi)
        k3 = kl_k3(clean(batch.old_logprobs), clean(batch.logprobs))
        metrics["train/approx_kl"] = aggregate(k3, valid, "token_mean", batch.normalizer).item()
    return LossOutput(loss=loss, metrics=metrics)


# --------------------------------------------------------------------------- KL controllers


class FixedKLController:
    """A constant reward-KL coefficient beta. ``update`` returns it unchanged."""

    def __init__(self, kl_coef: float) -> None:
        if not (isinstance(kl_coef, (int, float)) and math.isfinite(kl_coef) and kl_coef >= 0):
            raise ValueError(f"FixedKLController: kl_coef must be a finite number >= 0, got {kl_coef!r}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Ziegler et al. (arXiv 1909.08593, Sec. 2.2) adaptive beta, steering the policy's KL to ``target``.

        e = clip(current_kl / target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)
    current_kl: mean per-sequence KL(pi || pi_ref) of the last batch (nats); n_steps: samples in that
    batch. (The paper's K_beta = 0.1 per step is horizon-free; TRL's form, used here, scales by
    n_steps / horizon.)
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if not (isinstance(init_kl_coef, (int, float)) and math.isfinite(init_kl_coef) and init_kl_coef >= 0):
            raise ValueError(f"AdaptiveKLController: init_kl_coef must be a finite number >= 0, got {init_kl_coef!r}")
        if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
            raise ValueError(f"AdaptiveKLController: target must be a finite number > 0, got {target!r}")
        if isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 1:
            raise ValueError(f"AdaptiveKLController: horizon must be an int >= 1, got {horizon!r}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update and return beta."""
        if not math.isfinite(current_kl):
            raise ValueError(f"AdaptiveKLController.update: current_kl must be finite, got {current_kl!r}")
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
            raise ValueError(f"AdaptiveKLController.update: n_steps must be an int >= 0, got {n_steps!r}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def make_kl_controller(cfg: Any) -> FixedKLController | AdaptiveKLController:
    """The reward-KL controller a recipe asks for: reads cfg.reward_kl_coef, cfg.reward_kl_target
    (None = fixed) and cfg.reward_kl_horizon."""
    if cfg.reward_kl_target is None:
        return FixedKLController(cfg.reward_kl_coef)
    return AdaptiveKLController(cfg.reward_kl_coef, cfg.reward_kl_target, cfg.reward_kl_horizon)


# --------------------------------------------------------------------------- metric helpers (full batch)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var[R - V] / Var[R] over valid tokens (population variances); NaN if Var[R] = 0.

    1: the critic predicts the returns perfectly; 0: no better than their mean; < 0: worse.
    (CleanRL ppo.py ``explained_var``.) Padding ignored even if NaN/inf.
    """
    _check_shapes("explained_variance", mask, values=values, returns=returns)
    valid = mask != 0
    if not valid.any():
        raise ValueError("explained_variance: mask has no valid tokens")
    v = values.detach().double()[valid]
    r = returns.detach().double()[valid]
    var_r = r.var(correction=0)
    if var_r == 0:
        return float("nan")
    return (1.0 - (r - v).var(correction=0) / var_r).item()


register_algorithm(Algorithm(name="ppo", options=PPOConfig, advantage=ppo_advantages, loss=ppo_loss, critic=True,
                             min_group_size=1, dynamic_sampling=False,
                             paper="Schulman et al., arXiv 1707.06347; RLHF form of Ziegler et al. arXiv 1909.08593 "
                                   "with TRL's PPOConfig defaults (StackLLaMA)"))
