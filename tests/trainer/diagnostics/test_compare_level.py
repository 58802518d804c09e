"""`parityrl compare`'s level and verdict: the precision record's level (trainer.precision.levels) and the doctor's
PASS / WARN / FAIL rule (trainer.precision.verdict), printed in one line."""
from trainer.cli import level_line
from trainer.diagnostics.compare import expected_level
from trainer.precision import recipe_for
from trainer.precision.levels import parity_level


def test_the_level_is_the_records_and_the_verdict_the_doctors():
    bf16 = recipe_for("bf16")
    assert parity_level(bf16, "bfloat16", 4) == 4e-3  # the record's floor at the tiny model's depth
    assert expected_level(5.2e-3, bf16, "bfloat16", 4) == {"parity/mae": 4e-3, "num_layers": 4, "warn_factor": 3.0,
                                                           "verdict": "WARN"}
    assert expected_level(3e-3, bf16, "bfloat16", 4)["verdict"] == "PASS"
    assert expected_level(2e-2, bf16, "bfloat16", 4)["verdict"] == "FAIL"
    assert expected_level(5e-5, bf16, "float32", 30)["parity/mae"] == 1e-4  # float32's level does not grow


def test_the_console_line_says_the_verdict_and_the_ratio():
    level = expected_level(5.2e-3, recipe_for("bf16"), "bfloat16", 4)
    line = level_line(5.2e-3, level, "bfloat16", "bf16")
    assert line.startswith("WARN: mae 5.20e-03 against the level 4.0e-03 a healthy setup reads in bfloat16, "
                           "precision bf16, on a model of 4 layers (1.3x;"), line
    assert "within 3x of it" in line and "`parityrl doctor` says where the gap comes from" in line
    ok = level_line(1e-3, expected_level(1e-3, recipe_for("bf16"), "bfloat16", 4), "bfloat16", "bf16")
    assert ok.startswith("PASS: mae 1.00e-03") and "doctor" not in ok
    assert level_line(0.5, expected_level(0.5, recipe_for("bf16"), "bfloat16", 4), "bfloat16",
                      "bf16").startswith("FAIL: ")
