"""A resume moves the rows its record files hold past its checkpoint (a kill between a step's record and its
checkpoint, or between two checkpoints) to ``<name>.superseded.jsonl``, says so in one line, and the files then
hold each step once (trainer/io/superseded_rows.py)."""
import json
import sys
import types

import pytest

from trainer.io import superseded_rows
from trainer.io.run_logger import RunLogger
from trainer.io.superseded_rows import MARK, move_rows_past, move_superseded_rows, step_ranges, superseded_path
from trainer.lifecycle.summary import whole_run


@pytest.fixture(autouse=True)
def no_wandb(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the tests' default is offline (tests/conftest.py)


def write_rows(path, steps, **extra):
    path.write_text("".join(json.dumps({"step": s, **extra}) + "\n" for s in steps))


def steps_of(path):
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_the_rows_past_the_checkpoint_move_aside_marked_with_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, [0, 1, 2, 3, 4, 5], **{"reward/mean": 0.5})
    assert move_rows_past(path, 3) == [4, 5]
    assert steps_of(path) == [0, 1, 2, 3]
    aside = tmp_path / "metrics.superseded.jsonl"
    assert superseded_path(path) == aside
    rows = [json.loads(x) for x in aside.read_text().splitlines()]
    assert rows == [{"step": 4, "reward/mean": 0.5, MARK: 3}, {"step": 5, "reward/mean": 0.5, MARK: 3}]
    assert move_rows_past(path, 3) == [] and len(rows) == 2  # nothing past it any more: nothing moved


def test_an_older_resumes_repeats_in_between_are_moved_too_and_the_rest_keeps_its_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, [1, 2, 3, 2, 3, 4])  # a directory written before resumes moved rows
    path.write_text(path.read_text() + "not a row\n")
    assert move_rows_past(path, 2) == [3, 3, 4]
    assert path.read_text().splitlines()[-1] == "not a row"  # a line without a step is not this function's
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()[:-1]] == [1, 2, 2]
    assert steps_of(superseded_path(path)) == [3, 3, 4]
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_kill_between_the_copy_and_the_cut_loses_no_row(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    write_rows(path, [1, 2, 3])

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(superseded_rows.os, "truncate", killed)
    with pytest.raises(KeyboardInterrupt):
        move_rows_past(path, 1)
    monkeypatch.undo()
    assert steps_of(path) == [1, 2, 3] and steps_of(superseded_path(path)) == [2, 3]
    assert move_rows_past(path, 1) == [2, 3]  # the next resume moves them again
    assert steps_of(path) == [1]


def test_each_record_file_is_handled_and_only_those_with_rows_past_are_named(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [1, 2, 3, 4])
    write_rows(tmp_path / "samples.jsonl", [1, 1, 3, 3])
    write_rows(tmp_path / "parity_breakdown.jsonl", [1, 2])
    assert move_superseded_rows(tmp_path, 2) == {"metrics.jsonl": [3, 4], "samples.jsonl": [3, 3]}
    assert steps_of(tmp_path / "samples.jsonl") == [1, 1] and steps_of(tmp_path / "parity_breakdown.jsonl") == [1, 2]
    assert not (tmp_path / "parity_breakdown.superseded.jsonl").exists()


def test_step_ranges():
    assert step_ranges([13, 11, 12, 15, 15]) == "11-13, 15"
    assert step_ranges([4]) == "4"


def test_a_resumed_logger_moves_the_rows_says_so_in_one_line_and_each_step_is_then_logged_once(tmp_path, capsys):
    write_rows(tmp_path / "metrics.jsonl", [0, 1, 2, 3, 4], **{"reward/mean": 0.25})
    write_rows(tmp_path / "samples.jsonl", [1, 3])
    write_rows(tmp_path / "parity_breakdown.jsonl", [1, 2, 3, 4])
    log = RunLogger(tmp_path, config={}, wandb_mode="disabled", total_steps=5, resume=True, resumed_step=2)
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "superseded" in x]
    assert line.startswith("note: resuming from step 2: moved the rows of steps 3-4 ") and str(tmp_path) in line
    assert ("metrics.jsonl 2 rows -> metrics.superseded.jsonl, samples.jsonl 1 row -> samples.superseded.jsonl, "
            "parity_breakdown.jsonl 2 rows -> parity_breakdown.superseded.jsonl") in line, line
    assert "this run writes those steps again" in line and "wandb" not in line
    for step in (3, 4, 5):
        log.log(step, {"reward/mean": 1.0}, echo=False)
    log.close()
    assert steps_of(tmp_path / "metrics.jsonl") == [0, 1, 2, 3, 4, 5]
    assert [r["reward/mean"] for r in whole_run(tmp_path / "metrics.jsonl", [{"step": 5}])] == [0.25, 0.25, 1, 1, 1]


def test_a_logger_that_is_not_a_resume_moves_nothing(tmp_path, capsys):
    write_rows(tmp_path / "metrics.jsonl", [1, 2])
    RunLogger(tmp_path, config={}, wandb_mode="disabled", resume=True).close()
    RunLogger(tmp_path, config={}, wandb_mode="disabled", resumed_step=2).close()  # nothing past step 2
    assert steps_of(tmp_path / "metrics.jsonl") == [1, 2] and "superseded" not in capsys.readouterr().out
    assert not list(tmp_path.glob("*.superseded.jsonl"))


def test_a_non_main_process_moves_nothing(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [1, 2, 3])
    RunLogger(tmp_path, config={}, wandb_mode="disabled", enabled=False, resumed_step=1).close()
    assert steps_of(tmp_path / "metrics.jsonl") == [1, 2, 3]


def test_with_wandb_the_line_says_wandb_keeps_the_earlier_values_and_the_run_summary_names_the_steps(
        tmp_path, monkeypatch, capsys):
    runs = []

    def init(**kw):
        runs.append(types.SimpleNamespace(summary={}, finish=lambda **k: None, define_metric=lambda *a, **k: None))
        return runs[-1]

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=init, Settings=lambda **kw: types.SimpleNamespace(**kw)))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    write_rows(tmp_path / "metrics.jsonl", [1, 2, 3, 5])
    RunLogger(tmp_path, config={}, wandb_mode="offline", resume=True, resumed_step=1).close()
    (line,) = [x for x in capsys.readouterr().out.splitlines() if "superseded" in x]
    assert line.endswith("; the wandb run keeps the earlier values of steps 2-3, 5 (wandb drops a logged step below "
                         "the last one it holds, with its own warning)"), line
    assert runs[0].summary == {"resume/superseded_steps": "2-3, 5 (resumed from step 1)"}
