"""Sequence-level rejection (trust region masking): a whole sequence gets weight 0 when the sum, the mean or the
maximum of its tokens' KL estimates (``estimators``) leaves the trust region.

Li, Liu, Xu, Tong, Li, Liu, Wang (2025), "Trust Region Masking for Long-Horizon LLM Reinforcement Learning",
arXiv 2512.23075: token-level bounds do not bound a long sequence's divergence, and per-token mismatches cancel in a
sum, so the sequence is masked by an aggregate -- the mean (k3: an unbiased per-token KL) for a sequence that is off
policy throughout, the max (k2: symmetric) for one catastrophic token. verl implements them as ``rollout_rs:
seq_sum_k* | seq_mean_k* | seq_max_k*`` (rollout_corr_helper.py), with these presets:

* ``seq_sum_k1``: keep low <= exp(sum_t d_t) <= high, a band on the sequence's product ratio. Defaults 0.5, 2.0:
  verl's ``decoupled_seq_is_rs()`` (``rollout_rs: seq_sum_k1``, ``"0.5_2.0"``).
* ``seq_mean_k1``: keep low <= exp(mean_t d_t) <= high, a band on the geometric-mean token ratio: the mean is in
  log space, as its definition (TRL's "geometric sequence masking", huggingface/trl PR 4891; GSPO's length
  normalisation; TRL issue 5814 is about a sum shipped where this mean was meant). Unlike the product it neither
  shrinks nor grows with length. Defaults 0.999, 1.001: verl's ``decoupled_geo_rs()``.
* ``seq_sum_k2``, ``seq_sum_k3``: keep sum_t k <= max_kl. No published default (the TRM paper gives no threshold for
  the sum, verl no preset): ln 2 nats, a budget of summed per-token KL estimates per sequence. What it bounds,
  computed (tests/parity/corrections/test_rules.py): a one-token sequence is kept for a ratio in [0.30808, 3.24596]
  under k2 (|d| <= sqrt(2 ln 2) = 1.17741) and in [0.23196, 2.67835] under k3 (rho - 1 - d <= ln 2); a sequence of
  L tokens with one common ratio, under k2, for |d| <= sqrt(2 ln 2 / L): [0.88892, 1.12495] at L = 100. It is not the
  analogue of seq_sum_k1's [0.5, 2] band, which bounds |sum_t d_t| <= ln 2, a sum of log-ratios that can cancel;
  here every term is >= 0, so the same budget tightens per token as the sequence grows.
* ``seq_mean_k2``, ``seq_mean_k3``: keep mean_t k <= max_kl; 0.01: verl's ``decoupled_k3_rs()``.
* ``seq_max_k2``, ``seq_max_k3``: keep max_t k <= max_kl: any one token out of the region masks its sequence (the
  TRM paper's max criterion; slime's per-token "veto"). Defaults: the k of a ratio of 2 (``token_reject``), so
  seq_max_k2 masks every sequence holding a token that ``token_k1``'s default band would drop.

The bands on k1 are stated on rho = pi_train / pi_rollout; verl states them on -log rho (the inverse ratio),
which is the same band when the bounds are reciprocal, as all its presets' are up to rounding.
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
from parity.corrections.token_reject import K2_OF_RATIO_2, K3_OF_RATIO_2

LN2 = math.log(2.0)


@dataclass(frozen=True)
class SeqSumK1Options:
    """low, high: the kept band of prod_t rho_t, 0 < low < 1 < high (0.5, 2.0: verl's decoupled_seq_is_rs())."""

    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        check_options("seq_sum_k1", self, band_rules(self))


@dataclass(frozen=True)
class SeqSumK2Options:
    """max_kl: the largest kept sum_t d_t**2 / 2, > 0 (ln 2 nats; no published default: the module docstring says
    what it bounds)."""

    max_kl: float = LN2

    def __post_init__(self) -> None:
        check_options("seq_sum_k2", self, max_kl_rules(self))


@dataclass(frozen=True)
class SeqSumK3Options:
    """max_kl: the largest kept sum_t (rho_t - 1 - d_t), > 0 (ln 2 nats; no published default: the module docstring
    says what it bounds)."""

    max_kl: float = LN2

    def __post_init__(self) -> None:
        check_options("seq_sum_k3", self, max_kl_rules(self))


@dataclass(frozen=True)
class SeqMeanK1Options:
    """low, high: the kept band of exp(mean_t d_t), 0 < low < 1 < high (0.999, 1.001: verl's decoupled_geo_rs())."""

    low: float = 0.999
    high: float = 1.001

    def __post_init__(self) -> None:
        check_options("seq_mean_k1", self, band_rules(self))


@dataclass(frozen=True)
class SeqMeanK2Options:
    """max_kl: the largest kept mean_t d_t**2 / 2, > 0 (0.01: verl's k3 preset value; k2 ~ k3 for small d)."""

    max_kl: float = 0.01

    def __post_init__(self) -> None:
        check_options("seq_mean_k2", self, max_kl_rules(self))


@dataclass(frozen=True)
class SeqMeanK3Options:
    """max_kl: the largest kept mean_t (rho_t - 1 - d_t), > 0 (0.01: verl's decoupled_k3_rs())."""

    max_kl: float = 0.01

    def __post_init__(self) -> None:
        check_options("seq_mean_k3", self, max_kl_rules(self))


@dataclass(frozen=True)
class SeqMaxK2Options:
    """max_kl: the largest kept max_t d_t**2 / 2, > 0 ((ln 2)**2 / 2: the k2 of a ratio of 2)."""

    max_kl: float = K2_OF_RATIO_2

    def __post_init__(self) -> None:
        check_options("seq_max_k2", self, max_kl_rules(self))


@dataclass(frozen=True)
class SeqMaxK3Options:
    """max_kl: the largest kept max_t (rho_t - 1 - d_t), > 0 (1 - ln 2: the k3 of a ratio of 2)."""

    max_kl: float = K3_OF_RATIO_2

    def __post_init__(self) -> None:
        check_options("seq_max_k3", self, max_kl_rules(self))


def _band(inputs: CorrectionInputs, log_ratio, o) -> RuleOutput:
    return kept(inputs, inputs.per_token((log_ratio >= math.log(o.low)) & (log_ratio <= math.log(o.high))))


def seq_sum_k1(inputs: CorrectionInputs, o: SeqSumK1Options) -> RuleOutput:
    return _band(inputs, inputs.seq_sum(inputs.d), o)


def seq_mean_k1(inputs: CorrectionInputs, o: SeqMeanK1Options) -> RuleOutput:
    return _band(inputs, inputs.seq_mean(inputs.d), o)


def seq_sum_k2(inputs: CorrectionInputs, o: SeqSumK2Options) -> RuleOutput:
    return kept(inputs, inputs.per_token(inputs.seq_sum(k2(inputs.d)) <= o.max_kl))


def seq_sum_k3(inputs: CorrectionInputs, o: SeqSumK3Options) -> RuleOutput:
    return kept(inputs, inputs.per_token(inputs.seq_sum(k3(inputs.d)) <= o.max_kl))


def seq_mean_k2(inputs: CorrectionInputs, o: SeqMeanK2Options) -> RuleOutput:
    return kept(inputs, inputs.per_token(inputs.seq_mean(k2(inputs.d)) <= o.max_kl))


def seq_mean_k3(inputs: CorrectionInputs, o: SeqMeanK3Options) -> RuleOutput:
    return kept(inputs, inputs.per_token(inputs.seq_mean(k3(inputs.d)) <= o.max_kl))


def seq_max_k2(inputs: CorrectionInputs, o: SeqMaxK2Options) -> RuleOutput:
    return kept(inputs, inputs.per_token(inputs.seq_max(k2(inputs.d)) <= o.max_kl))


def seq_max_k3(inputs: CorrectionInputs, o: SeqMaxK3Options) -> RuleOutput:
    return kept(inputs, inputs.per_token(inputs.seq_max(k3(inputs.d)) <= o.max_kl))


_TRM = "Trust Region Masking, arXiv 2512.23075; verl rollout_rs "
for _name, _options, _fn, _formula in (
    ("seq_sum_k1", SeqSumK1Options, seq_sum_k1, "keep sequence if low <= prod_t rho_t <= high"),
    ("seq_sum_k2", SeqSumK2Options, seq_sum_k2, "keep sequence if sum_t d_t^2 / 2 <= max_kl"),
    ("seq_sum_k3", SeqSumK3Options, seq_sum_k3, "keep sequence if sum_t (rho_t - 1 - d_t) <= max_kl"),
    ("seq_mean_k1", SeqMeanK1Options, seq_mean_k1, "keep sequence if low <= exp(mean_t d_t) <= high"),
    ("seq_mean_k2", SeqMeanK2Options, seq_mean_k2, "keep sequence if mean_t d_t^2 / 2 <= max_kl"),
    ("seq_mean_k3", SeqMeanK3Options, seq_mean_k3, "keep sequence if mean_t (rho_t - 1 - d_t) <= max_kl"),
    ("seq_max_k2", SeqMaxK2Options, seq_max_k2, "keep sequence if max_t d_t^2 / 2 <= max_kl"),
    ("seq_max_k3", SeqMaxK3Options, seq_max_k3, "keep sequence if max_t (rho_t - 1 - d_t) <= max_kl"),
):
    register_rule(Rule(name=_name, kind="reject", level="sequence", options=_options, apply=_fn, formula=_formula,
                       source=_TRM + _name))
