"""Token-level rejection: a token whose KL estimate (``estimators``) leaves the trust region gets weight 0.

verl's ``rollout_rs: token_k1 | token_k2 | token_k3`` (verl/trainer/ppo/rollout_corr_helper.py,
``compute_rollout_rejection_mask``), with weight 1 on the kept tokens (a mask, no reweighting; combine with an
importance-weight rule for both, as verl's ``rollout_is`` x ``rollout_rs``).

* ``token_k1``: keep low <= rho_t <= high (a band on the ratio: k1 = -d = -log rho). Stated on rho = pi_train /
  pi_rollout as TRL and slime state their bands; verl states k1 bounds on -log rho, the inverse ratio, which is the
  same band when the bounds are reciprocal. Defaults 0.5 and 2.0: slime's bounds (mis.yaml) and this project's
  former ``mis`` mode; verl has no default.
* ``token_k2``: keep d_t**2 / 2 <= max_kl; ``token_k3``: keep rho_t - 1 - d_t <= max_kl. No published default:
  max_kl is that of a ratio of 2, the [0.5, 2] band's edge ((ln 2)**2 / 2 = 0.2402 for k2, exactly the band
  [0.5, 2]; 1 - ln 2 = 0.3069 for k3, which keeps [0.41, 2] since k3 is asymmetric).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from parity.corrections.estimators import k2, k3
from parity.corrections.record import (
    CorrectionInputs,
    Rule,
    RuleOutput,
    band_rules,
    check_options,
    kept,
    max_kl_rules,
)
from parity.corrections.registry import register_rule

K2_OF_RATIO_2 = math.log(2.0) ** 2 / 2  # 0.2402: d**2 / 2 at rho = 2 (and at rho = 0.5)
K3_OF_RATIO_2 = 1.0 - math.log(2.0)  # 0.3069: rho - 1 - log rho at rho = 2


@dataclass(frozen=True)
class TokenK1Options:
    """low, high: the kept band of rho_t, 0 < low < 1 < high (0.5, 2.0: slime's mis.yaml bounds)."""

    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        check_options("token_k1", self, band_rules(self))


@dataclass(frozen=True)
class TokenK2Options:
    """max_kl: the largest kept d_t**2 / 2, > 0 ((ln 2)**2 / 2: the k2 of a ratio of 2; no published default)."""

    max_kl: float = K2_OF_RATIO_2

    def __post_init__(self) -> None:
        check_options("token_k2", self, max_kl_rules(self))


@dataclass(frozen=True)
class TokenK3Options:
    """max_kl: the largest kept rho_t - 1 - d_t, > 0 (1 - ln 2: the k3 of a ratio of 2; no published default)."""

    max_kl: float = K3_OF_RATIO_2

    def __post_init__(self) -> None:
        check_options("token_k3", self, max_kl_rules(self))


def token_k1(inputs: CorrectionInputs, o: TokenK1Options) -> RuleOutput:
    return kept(inputs, (inputs.d >= math.log(o.low)) & (inputs.d <= math.log(o.high)))


def token_k2(inputs: CorrectionInputs, o: TokenK2Options) -> RuleOutput:
    return kept(inputs, k2(inputs.d) <= o.max_kl)


def token_k3(inputs: CorrectionInputs, o: TokenK3Options) -> RuleOutput:
    return kept(inputs, k3(inputs.d) <= o.max_kl)


_SOURCE = "verl rollout_rs token_k* (rollout_corr_helper.compute_rollout_rejection_mask)"
register_rule(Rule(name="token_k1", kind="reject", level="token", options=TokenK1Options, apply=token_k1,
                   formula="keep token if low <= rho_t <= high", source=_SOURCE + "; slime mis.yaml bounds"))
register_rule(Rule(name="token_k2", kind="reject", level="token", options=TokenK2Options, apply=token_k2,
                   formula="keep token if d_t^2 / 2 <= max_kl", source=_SOURCE))
register_rule(Rule(name="token_k3", kind="reject", level="token", options=TokenK3Options, apply=token_k3,
                   formula="keep token if rho_t - 1 - d_t <= max_kl", source=_SOURCE))
