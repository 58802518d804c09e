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
    (the fixed-prompt probe after a weight sync, ``trainer.measurement.probe``).
    """
    out = []
    for key, limit in ((prefix + "mae", max_mae), (prefix + "kl_k3", max_kl_k3)):
        if limit is None or key not in metrics:
            continue  # no limit, or no valid tokens this step (compare omits the key)
        value = float(metrics[key])
        if math.isnan(value) or value > limit:
            out.append(f"{key} = {value:.3g} exceeds the recipe's limit {limit:.3g}")
    return out


# The default floor (float32's: trainer/precision/record.py FLOAT32_FLOOR); a run takes its
# precision recipe's floor for its dtype instead.
RATIO_MAE_FLOOR = 1e-4

# Probes that make up the level: the highest of the last 5 healthy ones. The highest, not the median:
# a sharpening policy moves the probe up step after step (HF engine, CPU, lr 2e-2: 2.4e-3, 4.6e-3,
# 9.9e-3, 1.9e-2 -- the last 4.1x the median of those before it, 1.9x their highest), and a probe of
# 4 fixed sequences is noisy downwards (the demo's: 1.6e-4 between 1.6e-3 and 2.6e-3), which a low
# level would turn into false alarms. 5 probes: 10 steps at the default cadence, so the level
# follows the drift and forgets an old high value; a broken sync costs 15x and more.
LEVEL_WINDOW = 5


class MaeRatioLimit:
    """``parity.max_mae_ratio``: a probe whose mae jumps above ``max_ratio`` times the run's level is a fault.

    What is judged, and why: the probe (``trainer.measurement.probe``) scores the same fixed sequences after
    every weight sync, so a jump in ``probe/mae`` at one probe is a change in the numerics -- a
    skipped or partial sync, a kernel or forward that computes another function -- not a change of
    tokens. The step's ``parity/mae`` is on fresh samples and drifts as the policy sharpens (the
    demo: 1e-3 at the start, 5e-3 by step 13, 1.5e-2 late in a run at lr 2e-2, all healthy): a
    ratio on it cried wolf, so it is judged by the absolute limits (``parity.max_mae``) only; a NaN
    in either is a breach here too.

    The level: the highest of the last ``LEVEL_WINDOW`` healthy probes after a weight sync; until the
    first one, the probe before step 1. A probe is a fault when its mae is above ``max_ratio *
    max(level, floor)``; a fault never joins the level (a broken sync is not a new normal). The
    probe before step 1 compares identical weights on both sides (on CUDA with the HF engine 2.5e-7,
    then 8e-4 to 1.3e-3 after every update: the engine's merged BF16 weights against the trainer's
    LoRA branch), which is why ``floor`` -- the precision recipe's level on the smallest model,
    ``trainer.precision.record.MaeFloor`` -- bounds the level from below. ``judge_start``: the
    probe before step 1, with no level yet, is judged against the floor alone (dtypes whose level
    does not grow with depth: float32, exact mode). ``max_ratio`` None disables all of it.

    State (``state_dict``): the probe before step 1 and the window, checkpointed so that a resumed
    run judges as the uninterrupted one would; every rank sees the same pooled values.
    """

    def __init__(self, max_ratio: Optional[float], floor: float = RATIO_MAE_FLOOR, *, judge_start: bool = False,
                 floor_source: str = "") -> None:
        self.max_ratio, self.floor, self.judge_start = max_ratio, floor, judge_start
        self.floor_source = floor_source or "the precision recipe's"
        self.start: Optional[float] = None  # the probe before step 1
        self.recent: list[float] = []  # the last LEVEL_WINDOW healthy probes after a sync

    def level(self) -> Optional[float]:
        """The run's probe level, None before any probe."""
        return max(self.recent) if self.recent else self.start

    def violations(self, metrics: Mapping[str, float], prefix: str = "parity/", *, start: bool = False) -> list[str]:
        """Messages for a breach of ``metrics[prefix + "mae"]``; [] when within the limit, absent or off.

        ``start``: the probe before training (the run's first, or the first after a resume: a resumed
        run's level is already there, and that probe is judged against it without joining it).
        """
        key = prefix + "mae"
        if self.max_ratio is None or key not in metrics:
            return []
        value = float(metrics[key])
        if math.isnan(value):
            return [f"{key} = nan (parity.max_mae_ratio: a NaN is never a healthy mismatch)"]
        if prefix != "probe/":
            return []  # fresh samples: drift is not a fault (class docstring)
        level = self.level()
        if level is None and not self.judge_start:
            self.start = value
            return []
        base = self.floor if level is None else max(level, self.floor)
        limit = self.max_ratio * base
        if value > limit:
            if level is None or level <= self.floor:
                what = f"{self.floor_source} floor {self.floor:.3g}"
            elif self.recent:
                what = (f"the probe's level {level:.3g} (the highest of its last {len(self.recent)} healthy values "
                        "after a sync)")
            else:
                what = f"the probe before step 1, {level:.3g}"
            return [f"{key} = {value:.3g} is more than parity.max_mae_ratio = {self.max_ratio:g} times {what} "
                    f"(limit {limit:.3g})"]
        if level is None:
            self.start = value
        elif not start:
            self.recent = (self.recent + [value])[-LEVEL_WINDOW:]
        return []

    def state_dict(self) -> dict:
        return {"start": self.start, "recent": list(self.recent)}

    def load_state_dict(self, state: Optional[Mapping]) -> None:
        """``state`` from ``state_dict``; None (a checkpoint from before the limit kept state): a fresh level."""
        state = state or {}
        self.start, self.recent = state.get("start"), list(state.get("recent", []))
