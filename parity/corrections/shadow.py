"""The shadow table: every rule's weights on the same batch, side by side, without using any of them.

Each registered rule runs alone on the step's (d, mask, advantages) -- no model forward, the step's own numbers --
with the run's options for a rule the run uses and its defaults otherwise; when the run combines several rules (or
batch-normalises), the combination gets its own row. A row holds what ``stats.finalize`` says of that rule's
weights, so the row of the plan in use is, by construction and by test, the step's live ``correction/*`` values.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from parity.corrections.plan import CorrectionPlan
from parity.corrections.record import CorrectionInputs
from parity.corrections.registry import rules
from parity.corrections.stats import Pool, Stats, correction_stats, finalize

# The columns of a row after ``rule``, ``in_use`` and ``options`` (each the correction/<column> metric).
COLUMNS = ("frac_masked", "frac_clipped", "frac_seqs_masked", "ess", "weight_mean", "loss_change", "signal_kept")


def shadow_plans(live: CorrectionPlan, with_advantages: bool = True) -> list[tuple[str, CorrectionPlan]]:
    """(row label, plan) for every registered rule, then the live combination when it is more than one rule alone.

    A rule that needs the advantages is left out when there are none (``with_advantages`` false)."""
    out = []
    for rule in rules():
        if rule.needs_advantages and not with_advantages:
            continue
        options = {rule.name: live.options[rule.name]} if rule.name in live.rules else {}
        out.append((rule.name, CorrectionPlan((rule.name,), options)))
    if len(live.rules) > 1 or live.batch_normalize:
        out.append((" x ".join(live.rules) + (" (batch-normalised)" if live.batch_normalize else ""), live))
    return out


def shadow_rows(inputs: CorrectionInputs, live: CorrectionPlan,
                all_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                pool: Optional[Pool] = None) -> list[dict]:
    """One row per ``shadow_plans`` entry: {rule, in_use, options, *COLUMNS}, pooled over ranks by ``pool`` (one
    call for every row's statistics) and ``all_sum`` (a batch-normalised plan's mean)."""
    plans = shadow_plans(live, with_advantages=inputs.advantages is not None)
    merged: Stats = {}
    for i, (_, plan) in enumerate(plans):
        for k, v in correction_stats(inputs, plan.apply(inputs, all_sum=all_sum), plan).items():
            merged[f"{i}:{k}"] = v
    if pool is not None:
        merged = pool(merged)
    rows = []
    for i, (label, plan) in enumerate(plans):
        m = finalize({k.split(":", 1)[1]: v for k, v in merged.items() if k.startswith(f"{i}:")})
        row = {"rule": label, "in_use": plan == live, "options": plan.describe()}
        row.update({c: m.get(f"correction/{c}", float("nan")) for c in COLUMNS})
        rows.append(row)
    return rows
