"""Sequence-level importance weights: one weight per sequence, the product of its token ratios, truncated or masked.

With S = sum_t d_t over a sequence's valid tokens, its ratio is rho_seq = exp(S) = prod_t rho_t: the importance
weight of the whole sampled sequence (the unbiased one: the length-normalised geometric mean exp(S / L) is a
rejection criterion, ``seq_mean_k1``, not a weight).

* ``seq_tis``: w_i = min(exp(S_i), cap) on every token of sequence i. verl's ``rollout_is: sequence`` (product of
  ratios, "unbiased, high variance") with its default threshold 2.0 (``decoupled_seq_is()``); TRL's
  ``vllm_importance_sampling_mode: sequence_truncate``.
* ``seq_mis``: w_i = exp(S_i) if low <= exp(S_i) <= high, else 0. verl's sequence IS with a ``"lower_upper"``
  threshold; slime's ``mis_level: sequence, mis_mode: mask`` with its bounds 0.5 and 2.0
  (examples/train_infer_mismatch_helper/mis.yaml).

S is compared in log space (``S > log(cap)``), so exp(S) is never formed beyond the cap: no overflow at any length.
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
class SeqTISOptions:
    """cap: C in min(prod_t rho_t, C), >= 1 (2.0: verl's default ``rollout_is_threshold``, ``decoupled_seq_is()``)."""

    cap: float = 2.0

    def __post_init__(self) -> None:
        check_options("seq_tis", self, cap_rules(self))


@dataclass(frozen=True)
class SeqMISOptions:
    """low, high: the kept band of prod_t rho_t, 0 < low < 1 < high (0.5 and 2.0: slime's mis.yaml bounds)."""

    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        check_options("seq_mis", self, band_rules(self))


def seq_tis(inputs: CorrectionInputs, o: SeqTISOptions) -> RuleOutput:
    """w_i = min(exp(S_i), cap) broadcast over sequence i's valid tokens; ``clipped`` where S_i > log(cap)."""
    s = inputs.seq_sum(inputs.d)
    log_cap = math.log(o.cap)
    clipped = inputs.per_token(s > log_cap)
    return RuleOutput(weights=inputs.per_token(torch.exp(s.clamp(max=log_cap))), clipped=clipped,
                      masked=torch.zeros_like(clipped))


def seq_mis(inputs: CorrectionInputs, o: SeqMISOptions) -> RuleOutput:
    """w_i = exp(S_i) where log(low) <= S_i <= log(high), else 0 (every token of the sequence ``masked``)."""
    s = inputs.seq_sum(inputs.d)
    keep = (s >= math.log(o.low)) & (s <= math.log(o.high))
    w = inputs.per_token(torch.where(keep, torch.exp(s.clamp(max=math.log(o.high))), torch.zeros_like(s)))
    return RuleOutput(weights=w, clipped=torch.zeros_like(inputs.mask), masked=inputs.per_token(~keep))


register_rule(Rule(name="seq_tis", kind="weight", level="sequence", options=SeqTISOptions, apply=seq_tis,
                   formula="w_i = min(prod_t rho_t, cap)",
                   source="verl rollout_is: sequence (decoupled_seq_is); TRL sequence_truncate"))
register_rule(Rule(name="seq_mis", kind="weight", level="sequence", options=SeqMISOptions, apply=seq_mis,
                   formula="w_i = prod_t rho_t if low <= prod_t rho_t <= high else 0",
                   source="verl sequence IS with a lower_upper threshold; slime mis_level: sequence, mis_mode: mask"))
