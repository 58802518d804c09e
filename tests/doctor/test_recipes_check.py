"""The recipes check on the tiny model: every precision recipe its dtype allows, side by side; exact mode reads 0,
the others within their own levels; a recipe the dtype refuses is a SKIP naming the record's reason."""
import pytest

from trainer.doctor.checks.recipes import run
from trainer.doctor.records import PASS, SKIP


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


def test_a_recipe_above_its_level_is_sent_to_a_check_that_runs_with_it():
    """The layers check where it judges the recipe; for an FP8 engine, which it does not, prefill_decode."""
    from types import SimpleNamespace

    from trainer.doctor.checks.layers import precision_refusal
    from trainer.doctor.checks.recipes import follow_up
    from trainer.precision import recipe_for

    doc = SimpleNamespace(dtype="bfloat16")
    for name in ("bf16", "exact"):
        assert precision_refusal(recipe_for(name), "bfloat16") is None
        assert follow_up(doc, recipe_for(name)) == (f"rerun with `--set precision.recipe={name} --only layers` "
                                                    "(where it leaves its noise floor)")
    for name in ("fp8_rollout", "fp8_unified"):
        assert "FP8 GEMMs" in precision_refusal(recipe_for(name), "bfloat16")
        assert follow_up(doc, recipe_for(name)).startswith(f"rerun with `--set precision.recipe={name} --only "
                                                           "prefill_decode` (its engine's decode and prefill")


@pytest.mark.slow
def test_the_fp8_follow_up_runs_its_check(tmp_path, capsys):
    """`parityrl doctor recipes/grpo_tiny.yaml --set precision.recipe=fp8_rollout --only prefill_decode`, the follow-up
    the recipes check names for FP8, judges the FP8 engine (no SKIP), where `--only layers` would skip it."""
    import json

    from trainer.cli import main

    out = tmp_path / "doc"
    status = main(["doctor", "recipes/grpo_tiny.yaml", "--set", "precision.recipe=fp8_rollout", "--set",
                   f"logging.run_dir={tmp_path / 'run'}", "--only", "prefill_decode", "--out", str(out)])
    printed = capsys.readouterr().out
    print(printed)
    found = json.loads((out / "doctor.json").read_text())["findings"]
    assert status in (0, 8) and found and all(f["verdict"] != SKIP for f in found), printed
