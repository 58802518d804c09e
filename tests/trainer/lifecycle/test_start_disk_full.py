"""A disk that is full when the run starts (the run directory, its lock, engine.log, recipe.yaml, metrics.jsonl, the
wandb id) stops the start with the sentence a full disk gets mid-run and exit status 6
(``write_failure.StartNotWritten``), not as an unexpected failure (status 1)."""
import errno
import json
import os
import pathlib
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainer.io import run_lock, superseded_rows, third_party_output, write_failure
from trainer.io.run_logger import WANDB_ID_FILE, RunLogger
from trainer.io.write_failure import StartNotWritten, writing_at_start
from trainer.lifecycle.preflight import load_recipe
from trainer.lifecycle.run_state import RECIPE_FILE, claim_run_dir, record_recipe

REPO = Path(__file__).resolve().parents[3]


def full(path):
    return OSError(errno.ENOSPC, "No space left on device", str(path))


def full_below(monkeypatch, run_dir: Path, method: str = "mkdir"):
    """``Path.<method>`` raises ENOSPC for ``run_dir`` and the paths under it."""
    real = getattr(pathlib.Path, method)

    def fails(self, *a, **kw):
        if self == run_dir or run_dir in self.parents:
            raise full(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, method, fails)


def test_parityrl_train_on_a_full_disk_exits_6_with_one_line_before_anything_loads(tmp_path, tiny_model_dir,
                                                                                  monkeypatch, capsys):
    from trainer.commands.train import run_train_command
    from trainer.rl import loop

    def setup(*a, **kw):
        raise AssertionError("the model loads only after the run directory is written")

    monkeypatch.setattr(loop, "setup", setup)
    monkeypatch.setattr(write_failure, "free_bytes", lambda path: 4096)
    run = tmp_path / "run"
    full_below(monkeypatch, run)
    status = run_train_command(str(REPO / "recipes" / "grpo_tiny.yaml"),
                               [f"logging.run_dir={run}", "logging.wandb.mode=disabled"], resume=False)
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("parityrl:")]
    assert status == 6, err
    assert line == (f"parityrl: stopped: {run / '.lock'} could not be written at the run's start: the disk is full "
                    f"at {run} (4.1 kB free); nothing was trained: fix that and start it again"), line
    assert not run.exists()


def test_the_lock_that_cannot_be_written_is_not_left_held(tmp_path, monkeypatch):
    c = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [f"logging.run_dir={tmp_path}"], check_paths=False)

    def fsync(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_lock.os, "fsync", fsync)
    with pytest.raises(StartNotWritten) as e:
        claim_run_dir(c, resume=False)
    assert e.value.exit_status == 6 and str(e.value).startswith(
        f"{tmp_path / '.lock'} could not be written at the run's start: the disk is full at {tmp_path}"), e.value
    assert isinstance(e.value.__cause__, OSError)
    monkeypatch.undo()
    run_lock.check_free(tmp_path)  # no handle of this process holds it
    claim_run_dir(c, resume=False).release()


def test_recipe_yaml_on_a_full_disk(tmp_path, monkeypatch):
    c = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", [f"logging.run_dir={tmp_path}"], check_paths=False)
    full_below(monkeypatch, tmp_path, "write_text")
    run = SimpleNamespace(cfg=c, optimizer=SimpleNamespace(param_groups=[]), scheduler=None, is_main=True,
                          start_step=0)
    with pytest.raises(StartNotWritten, match=f"^{tmp_path / RECIPE_FILE} could not be written at the run's start: "
                                              f"the disk is full at {tmp_path}"):
        record_recipe(run, resumed=False)


def test_the_loggers_first_files_on_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run = tmp_path / "new"
    full_below(monkeypatch, run)
    with pytest.raises(StartNotWritten, match=f"^{run} could not be written at the run's start: the disk is full"):
        RunLogger(run, config={}, wandb_mode="disabled")
    monkeypatch.undo()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2}) + "\n")

    def move(run_dir, step):
        raise full(run_dir / "metrics.superseded.jsonl")

    monkeypatch.setattr(superseded_rows, "move_superseded_rows", move)
    with pytest.raises(StartNotWritten, match=f"^{tmp_path} could not be written at the run's start: the disk"):
        RunLogger(tmp_path, config={}, wandb_mode="disabled", resume=True, resumed_step=1)


def test_the_wandb_id_on_a_full_disk(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(
        init=lambda **kw: pytest.fail("wandb starts after its id is written"), Settings=lambda **kw: None))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    real = pathlib.Path.write_text

    def write_text(self, *a, **kw):
        if self.name == WANDB_ID_FILE:
            raise full(self)
        return real(self, *a, **kw)

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)
    with pytest.raises(StartNotWritten, match=f"^{tmp_path / WANDB_ID_FILE} could not be written at the run's start"):
        RunLogger(tmp_path, config={}, wandb_mode="offline")


def test_engine_log_on_a_full_disk_keeps_the_lines_waiting(tmp_path, monkeypatch):
    class FullFile:
        def writelines(self, lines):
            raise full(tmp_path / "engine.log")

        def close(self):
            raise full(tmp_path / "engine.log")

    console = third_party_output.ConsoleFilter()  # not installed: no pipes, only the attach under test
    console._pending = ["an expected line\n"]
    monkeypatch.setattr(third_party_output, "_ACTIVE", console)
    monkeypatch.setattr(third_party_output, "open", lambda *a, **kw: FullFile(), raising=False)
    with pytest.raises(StartNotWritten, match=f"^{tmp_path / 'engine.log'} could not be written at the run's start"):
        third_party_output.attach(tmp_path)
    assert console._log is None and console._pending == ["an expected line\n"]  # later lines keep waiting


def test_no_permission_reads_as_such_and_the_run_directorys_state_is_not_taken_for_a_write_failure(tmp_path):
    with pytest.raises(StartNotWritten) as e:
        with writing_at_start(tmp_path, tmp_path / "x"):
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "x"))
    assert str(e.value).startswith(f"{tmp_path / 'x'} could not be written at the run's start: PermissionError at "
                                   f"{tmp_path / 'x'}: Permission denied ("), e.value
    for state in (run_lock.RunDirInUse("in use"), FileNotFoundError(errno.ENOENT, "gone")):
        with pytest.raises(type(state)):
            with writing_at_start(tmp_path):
                raise state
    assert os.listdir(tmp_path) == []
