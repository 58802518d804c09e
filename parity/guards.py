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


# Below this mae a ratio says nothing: float32 on both sides measures ~1e-5 on a 30-layer model
# (docs/parity-metrics.md "What is normal"), where a 5x move is still far below any BF16 level,
# and an exact recipe's 0 would make every later non-zero value an infinite ratio.
RATIO_MAE_FLOOR = 1e-4


class MaeRatioLimit:
    """``parity.max_mae_ratio``: a mae more than ``max_ratio`` times the run's first one is a breach.

    Which absolute mae is normal depends on the model's depth and the dtype (2e-3 for the
    4-layer tiny model in BF16, 5e-2 for a 30-layer one), so a fixed limit either misses
    a broken sync on a deep model or fires on every step of it. The run's own first
    measurement (the probe before step 1, or step 1's ``parity/mae`` without a probe) is the
    baseline; later ``parity/mae`` and ``probe/mae`` values are compared with
    ``max_ratio * max(baseline, RATIO_MAE_FLOOR)``. A NaN counts as a breach. ``max_ratio``
    None disables it. State: the baseline (every rank sees the same pooled values).

    When the baseline came from the probe, step 1's ``parity/mae`` -- the same weights on both
    sides, no sync yet, the decode path at the rollout temperature -- raises it if larger: one
    probe of 4 fixed sequences is a noisy start (the demo's measured 7.5e-4, against 1.06e-3 for
    step 1's 600 tokens, put a 4.4e-3 step of a healthy run over 5x).
    """

    def __init__(self, max_ratio: Optional[float], floor: float = RATIO_MAE_FLOOR) -> None:
        self.max_ratio, self.floor = max_ratio, floor
        self.baseline: Optional[float] = None
        self._from_probe = False  # the baseline is the probe's: step 1's own mae may still raise it

    def violations(self, metrics: Mapping[str, float], prefix: str = "parity/") -> list[str]:
        key = prefix + "mae"
        if self.max_ratio is None or key not in metrics:
            return []
        value = float(metrics[key])
        if self.baseline is None:
            if math.isfinite(value):
                self.baseline, self._from_probe = value, prefix == "probe/"
            return []
        if self._from_probe and prefix == "parity/":  # step 1, before the first sync
            self._from_probe = False
            if math.isfinite(value):
                self.baseline = max(self.baseline, value)
                return []
        limit = self.max_ratio * max(self.baseline, self.floor)
        if math.isnan(value) or value > limit:
            return [f"{key} = {value:.3g} is more than parity.max_mae_ratio = {self.max_ratio:g} times the run's first "
                    f"mae {self.baseline:.3g} (limit {limit:.3g})"]
        return []
