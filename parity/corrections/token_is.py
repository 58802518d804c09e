"""Token-level importance weights: rho_t = exp(d_t) = pi_train / pi_rollout of each sampled token, truncated or masked.

* ``token_tis``: w_t = min(rho_t, cap). Truncated importance sampling, Yao, Liu et al. (2025), "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl (their C = 2);
  verl's ``rollout_is: token`` with ``rollout_is_threshold: 2.0`` (its default, ``decoupled_token_is()``).
* ``token_mis``: w_t = rho_t if low <= rho_t <= high, else 0. IcePop, Ling Team (2025), "Every Step Evolves:
  Scaling Reinforcement Learning for Trillion-Scale Thinking Model" (Ring-1T), arXiv 2510.18855, its M(k; alpha,
  beta) = k * 1[alpha <= k <= beta] with alpha = 0.5, beta = 5 (verl's ``decoupled_token_icepop()`` preset,
  ``rollout_is_threshold: "0.5_5.0"``): a token whose ratio leaves the band is dropped from the gradient instead of
  being reweighted, since truncating an unbounded weight still lets it bias the update.

Comparisons are made on d in float64 (``d > log(cap)``, ``log(low) <= d <= log(high)``), so a ratio within a few
ulps of a bound may fall either side of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from parity.corrections.record import (
    CorrectionInputs,
    Rule,
    RuleOutput,
    band_rules,
    cap_rules,
    check_options,
)
from parity.corrections.registry import register_rule


@dataclass(frozen=True)
class TokenTISOptions:
    """cap: C in min(rho_t, C), >= 1 (2.0: Yao et al.'s C and verl's default ``rollout_is_threshold``)."""

    cap: float = 2.0

    def __post_init__(self) -> None:
        check_options("token_tis", self, cap_rules(self))


@dataclass(frozen=True)
class TokenMISOptions:
    """low, high: the kept band [alpha, beta] of rho_t, 0 < low < 1 < high (0.5 and 5.0: IcePop's, arXiv 2510.18855)."""

    low: float = 0.5
    high: float = 5.0

    def __post_init__(self) -> None:
        check_options("token_mis", self, band_rules(self))


def token_tis(inputs: CorrectionInputs, o: TokenTISOptions) -> RuleOutput:
    """w_t = min(exp(d_t), cap) on valid tokens; ``clipped`` where d_t > log(cap)."""
    clipped = (inputs.d > math.log(o.cap)) & inputs.mask
    w = torch.where(clipped, torch.full_like(inputs.d, float(o.cap)), torch.exp(inputs.d)) * inputs.mask
    return RuleOutput(weights=w, clipped=clipped, masked=torch.zeros_like(clipped))


def token_mis(inputs: CorrectionInputs, o: TokenMISOptions) -> RuleOutput:
    """w_t = exp(d_t) where log(low) <= d_t <= log(high), else 0 (``masked``)."""
    keep = (inputs.d >= math.log(o.low)) & (inputs.d <= math.log(o.high)) & inputs.mask
    w = torch.where(keep, torch.exp(inputs.d), torch.zeros_like(inputs.d))
    return RuleOutput(weights=w, clipped=torch.zeros_like(keep), masked=inputs.mask & ~keep)


register_rule(Rule(name="token_tis", kind="weight", level="token", options=TokenTISOptions, apply=token_tis,
                   formula="w_t = min(rho_t, cap)",
                   source="Yao et al. 2025, https://fengyao.notion.site/off-policy-rl; verl decoupled_token_is"))
register_rule(Rule(name="token_mis", kind="weight", level="token", options=TokenMISOptions, apply=token_mis,
                   formula="w_t = rho_t if low <= rho_t <= high else 0",
                   source="IcePop (Ring-1T), arXiv 2510.18855; verl decoupled_token_icepop"))
