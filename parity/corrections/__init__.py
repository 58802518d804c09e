"""Corrections for the engine/trainer mismatch as records, one per rule (docs/corrections.md).

Importing this package registers every rule (``registry.rule_names()``): the importance weights token_tis,
token_mis, seq_tis, seq_mis; the rejections token_k1..k3, seq_sum_k1..k3, seq_mean_k1..k3, seq_max_k2, seq_max_k3 and
DeepSeek-V3.2's opsm. A run's choice is a
``plan.CorrectionPlan``; ``stats`` says what it did (``correction/*``), ``shadow`` what every rule would have done on
the same batch, ``breakdown`` where the corrected tokens sit. Every function is pure, on [B, T] tensors of
d = lp_t - lp_r as the caller computed it.
"""
from parity.corrections import (  # noqa: F401  (register the rules)
    opsm,
    sequence_is,
    token_is,
    token_reject,
    trust_region,
)
from parity.corrections.plan import CorrectionPlan, PlanError, PlanOutput
from parity.corrections.presets import PRESETS, Preset, get_preset
from parity.corrections.record import CorrectionInputs, OptionError, Rule, RuleOutput
from parity.corrections.registry import get_rule, is_rule, register_rule, rule_names, rules
from parity.corrections.shadow import shadow_rows
from parity.corrections.stats import correction_metrics, correction_stats, finalize, reduction

__all__ = [
    "PRESETS", "CorrectionInputs", "CorrectionPlan", "OptionError", "PlanError", "PlanOutput", "Preset", "Rule",
    "RuleOutput", "correction_metrics", "correction_stats", "finalize", "get_preset", "get_rule", "is_rule",
    "reduction", "register_rule", "rule_names", "rules", "shadow_rows",
]
