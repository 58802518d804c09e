"""The recipes check on the tiny model: every precision recipe its dtype allows, side by side; exact mode reads 0,
the others within their own levels; a recipe the dtype refuses is a SKIP naming the record's reason."""
import pytest

from trainer.doctor.checks.recipes import run
from trainer.doctor.finding import PASS, SKIP


@pytest.mark.slow
def test_every_allowed_recipe_has_its_row_and_exact_mode_reads_zero(make_doctor, tiny_engine):
    doc = make_doctor(engine=tiny_engine)
    rows = {f.item.split(":")[0]: f for f in run(doc)}
    for f in rows.values():
        print(f.item, f.figure, f.expected, f.verdict, f.cause)
    assert set(rows) == {"bf16", "exact", "fp16", "fp8_rollout", "fp8_unified"}
    assert rows["exact"].verdict == PASS and rows["exact"].figure == 0.0
    assert all(rows[r].verdict == PASS and 0 < rows[r].figure for r in ("bf16", "fp8_rollout", "fp8_unified"))
    assert rows["fp8_rollout"].figure > rows["bf16"].figure  # FP8 weights on the engine side only
    assert rows["fp16"].verdict == SKIP and "expected float16 with precision.recipe fp16" in rows["fp16"].cause
