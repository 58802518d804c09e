"""The doctor's frame without an engine: findings and their verdicts, the battery's handling of checks that cannot
run or break, the exit statuses, the table, and the command's refusals of bad input before anything loads."""
import json
import math
from types import SimpleNamespace

import pytest

from trainer.diagnostics.doctor_report import table, write_json
from trainer.doctor.battery import (
    EXIT_ENGINE,
    EXIT_FAILED,
    EXIT_PASSED,
    EXIT_UNCHECKED,
    exit_status,
    run_checks,
    select,
    summary,
)
from trainer.doctor.context import EngineCannotStart
from trainer.doctor.records import FAIL, PASS, SKIP, WARN, Check, CheckCannotRun, Finding, at_most, skipped


def test_a_verdict_other_than_pass_must_say_its_cause():
    with pytest.raises(ValueError, match="a FAIL must say its cause"):
        Finding("c", "x", 1.0, "<= 0", FAIL)
    with pytest.raises(ValueError, match="verdict = 'OK'"):
        Finding("c", "x", 1.0, "<= 0", "OK")


def test_at_most_passes_warns_and_fails_at_its_limits():
    assert at_most("c", "x", 1e-3, 1e-3, "why").verdict == PASS
    assert at_most("c", "x", 2e-3, 1e-3, "why", warn_factor=3).verdict == WARN
    assert at_most("c", "x", 3.5e-3, 1e-3, "why", warn_factor=3).verdict == FAIL
    assert at_most("c", "x", 2e-3, 1e-3, "why").verdict == FAIL  # no warn band asked
    nan = at_most("c", "x", math.nan, 1e-3, "why", warn_factor=3)
    assert nan.verdict == FAIL and nan.cause == "why"
    assert at_most("c", "x", 0.5, 1e-3, "why").expected == "<= 0.001"


def _check(name, result):
    def run(_doc):
        if isinstance(result, BaseException):
            raise result
        return result

    return Check(name, f"{name}?", run)


def test_the_battery_runs_every_check_whatever_the_others_did():
    doc = SimpleNamespace(say=lambda _m: None)
    checks = [_check("ok", [Finding("ok", "x", 0.0, "<= 0", PASS)]),
              _check("engine", EngineCannotStart("vLLM cannot load the model m: AssertionError: no")),
              _check("cannot", CheckCannotRun("the HF engine has no KV cache")),
              _check("broken", ZeroDivisionError("division by zero")),
              _check("after", [Finding("after", "y", 1.0, "<= 2", PASS)])]
    found, seconds = run_checks(doc, checks)
    by = {f.check: f for f in found}
    assert list(by) == ["ok", "engine", "cannot", "broken", "after"] and set(seconds) == set(by)
    assert by["engine"].verdict == SKIP and "the engine cannot load this model: vLLM cannot load" in by["engine"].cause
    assert by["cannot"].verdict == SKIP and by["cannot"].cause == "the HF engine has no KV cache"
    assert by["broken"].verdict == FAIL and by["broken"].cause == ("the check could not complete: "
                                                                   "ZeroDivisionError: division by zero")
    assert exit_status(found, None) == EXIT_FAILED
    clean = [f for f in found if f.check != "broken"]
    assert exit_status(clean, "vLLM cannot load the model m") == EXIT_ENGINE
    assert exit_status([f for f in clean if f.check in ("ok", "after")], None) == EXIT_PASSED
    assert exit_status([skipped("c", "x", "no engine"), at_most("c", "y", 0.5, 1, "w"),
                        at_most("c", "z", 2, 1, "w", warn_factor=3)], None) == EXIT_PASSED


def test_nothing_checked_is_never_a_pass_and_warnings_are_said_as_warnings():
    skips = [skipped("layers", "-", "the HF engine runs Transformers' own model")]
    warn = at_most("sampling", "generation_config", 2, 1, "a server would add a repetition penalty", warn_factor=3)
    ok = at_most("tokens", "double BOS", 0, 0, "an extra BOS")
    assert exit_status(skips, None) == EXIT_UNCHECKED == 9
    assert exit_status([*skips, warn], None) == EXIT_UNCHECKED  # a warning alone passes nothing
    assert exit_status([], None) == EXIT_UNCHECKED
    assert exit_status(skips, "vLLM cannot load the model m") == EXIT_ENGINE  # the engine's reason says more
    assert summary(skips, EXIT_UNCHECKED) == "nothing was checked: no check passed or failed (1 SKIP)"
    assert summary([ok, warn, *skips], EXIT_PASSED) == ("no check failed (1 PASS, 1 WARN, 1 SKIP); 1 warning "
                                                        "(sampling: generation_config)")
    assert summary([ok], EXIT_PASSED) == "every check that ran passed (1 PASS)"
    failed = at_most("layers", "logits", 9, 1, "softcap")
    assert summary([failed, warn], EXIT_FAILED) == ("a check failed (1 WARN, 1 FAIL); 1 warning "
                                                    "(sampling: generation_config)")


def test_only_selects_checks_by_name_and_refuses_unknown_ones():
    names = [c.name for c in select(None)]
    assert names and len(set(names)) == len(names)
    assert [c.name for c in select([names[-1], names[0]])] == [names[0], names[-1]]  # the table's order
    with pytest.raises(ValueError, match=r"--only 'nope': expected one of " + names[0]):
        select(["nope"])


def test_the_table_and_doctor_json(tmp_path):
    found = [Finding("tokens", "double BOS: prompts", 0.0, "<= 0", PASS),
             Finding("sampling", "temperature", 0.25, "<= 0.001", FAIL, "raw log-probs", {"mae_at_1": 1e-4})]
    text = table(found).splitlines()
    assert text[0].split() == ["check", "item", "figure", "expected", "verdict"]
    assert text[3].split()[-1] == "FAIL" and text[4].strip() == "-> raw log-probs"
    path = write_json(tmp_path, found, status=8, header={"model": "m"}, seconds={"tokens": 0.1})
    doc = json.loads(path.read_text())
    assert doc["exit_status"] == 8 and doc["verdicts"] == {"PASS": 1, "WARN": 0, "FAIL": 1, "SKIP": 0}
    assert doc["findings"][1]["details"] == {"mae_at_1": 1e-4} and "cause" not in doc["findings"][0]


def test_bad_input_is_refused_with_status_2_before_anything_loads(tmp_path, capsys):
    from trainer.cli import main

    assert main(["doctor"]) == 2
    assert "expected a recipe, or --model PATH" in capsys.readouterr().err
    assert main(["doctor", "recipes/grpo_tiny.yaml", "--only", "nope", "--out", str(tmp_path / "a")]) == 2
    assert "--only 'nope': expected one of" in capsys.readouterr().err
    assert main(["doctor", "recipes/grpo_tiny.yaml", "--set", "rollout.top_p=2", "--out", str(tmp_path / "b")]) == 2
    assert "rollout.top_p = 2" in capsys.readouterr().err
    full = tmp_path / "full"
    full.mkdir()
    (full / "mine.txt").write_text("keep")
    assert main(["doctor", "recipes/grpo_tiny.yaml", "--out", str(full)]) == 2
    assert "already exists and is not empty" in capsys.readouterr().err and (full / "mine.txt").read_text() == "keep"
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_battery_where_every_check_skips_says_nothing_was_checked_and_exits_9(tmp_path, capsys):
    """`parityrl doctor recipes/grpo_tiny.yaml --set rollout.engine=hf --only layers`: the layers check cannot compare
    the HF engine (the trainer's own model) with the trainer."""
    from trainer.cli import main

    out = tmp_path / "doc"
    status = main(["doctor", "recipes/grpo_tiny.yaml", "--set", "rollout.engine=hf", "--set",
                   f"logging.run_dir={tmp_path / 'run'}", "--only", "layers", "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == EXIT_UNCHECKED, printed
    assert "nothing was checked: no check passed or failed (1 SKIP); exit status 9" in printed
    assert "passed (" not in printed.splitlines()[-1].split(":")[0]
    assert json.loads((out / "doctor.json").read_text())["exit_status"] == EXIT_UNCHECKED
