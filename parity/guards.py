"""Parity thresholds: the run's promise that rollout and training stay in step.

``threshold_violations`` compares a step's parity metrics with the recipe's
limits and returns one message per breach, naming the metric, its value and the
limit. The trainer checks it before the optimizer step, so with
``on_violation: stop`` the update computed from mismatched rollouts is never
applied and the last checkpoint is the last good state.
"""
from __future__ import annotations

import math
from typing import Mapping, Optional


def threshold_violations(metrics: Mapping[str, float], *, max_mae: Optional[float] = None,
                         max_kl_k3: Optional[float] = None, prefix: str = "parity/") -> list[str]:
    """Messages for each limit exceeded (a NaN metric counts as a breach); [] when within limits or unset.

    ``prefix``: the metric family checked, ``parity/`` (the step's rollouts) or ``probe/``
    (the fixed-prompt probe after a weight sync, ``trainer.rl.probe``).
    """
    out = []
    for key, limit in ((prefix + "mae", max_mae), (prefix + "kl_k3", max_kl_k3)):
        if limit is None or key not in metrics:
            continue  # no limit, or no valid tokens this step (compare omits the key)
        value = float(metrics[key])
        if math.isnan(value) or value > limit:
            out.append(f"{key} = {value:.3g} exceeds the recipe's limit {limit:.3g}")
    return out
