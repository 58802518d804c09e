"""PASS / WARN / FAIL of a parity figure against the level a healthy setup reaches (``levels.parity_level``): the one
rule `parityrl compare` prints and `parityrl doctor`'s checks judge by, so the two never call the same figure
differently.

- PASS: at or below the level;
- WARN: above it, up to ``warn_factor`` times it: more than the level says a healthy setup reads, less than any fault
  measured (``MAE_WARN_FACTOR`` for the parity mae);
- FAIL: beyond, or not a number.
"""
from __future__ import annotations

from typing import Optional

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"

# For the parity mae against its level: the level is the upper end of the healthy readings it comes from (BF16's 4e-3
# on the tiny model: probes of healthy runs read 1.6e-4 to 6.8e-3, one at lr 2e-2 read 1.16e-2 = 2.9x;
# trainer/precision/bf16.py), while a fault reads far above it (a skipped sync 0.16 = 40x; the doctor's planted faults
# in docs/doctor.md). Up to 3x: a healthy run can read it, a warning; beyond 3x: no healthy run measured did.
MAE_WARN_FACTOR = 3.0


def verdict(figure: float, level: float, warn_factor: Optional[float] = None) -> str:
    """PASS when ``figure <= level``; with ``warn_factor`` WARN up to ``warn_factor * level``; FAIL beyond (a NaN
    fails)."""
    if figure == figure and figure <= level:
        return PASS
    if warn_factor is not None and figure == figure and figure <= warn_factor * level:
        return WARN
    return FAIL
