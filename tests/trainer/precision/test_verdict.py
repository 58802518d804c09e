"""The one PASS / WARN / FAIL rule `parityrl compare` and `parityrl doctor` judge a parity figure by."""
import math

from trainer.doctor.records import at_most
from trainer.precision.verdict import FAIL, MAE_WARN_FACTOR, PASS, WARN, verdict


def test_pass_at_or_below_the_level_warn_up_to_the_factor_fail_beyond_and_on_nan():
    assert verdict(4e-3, 4e-3, 3.0) == PASS
    assert verdict(5.2e-3, 4e-3, 3.0) == WARN  # 1.3x the level
    assert verdict(1.2e-2, 4e-3, 3.0) == WARN
    assert verdict(1.21e-2, 4e-3, 3.0) == FAIL
    assert verdict(5.2e-3, 4e-3) == FAIL  # no warn band asked
    assert verdict(math.nan, 4e-3, 3.0) == FAIL
    assert verdict(0.0, 0.0) == PASS and verdict(1e-9, 0.0, 3.0) == FAIL  # exact mode's level 0
    assert MAE_WARN_FACTOR == 3.0


def test_the_doctors_findings_use_the_same_rule():
    for figure in (1e-3, 5.2e-3, 2e-2, math.nan):
        assert at_most("c", "x", figure, 4e-3, "why", warn_factor=MAE_WARN_FACTOR).verdict == \
            verdict(figure, 4e-3, MAE_WARN_FACTOR)
