"""A checkpoint that cannot be written stops the run with one line and exit status 6 (CheckpointFailed), the older
checkpoint intact; a damaged folder at the stop's step is not taken for that step's checkpoint."""
import errno
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer.distributed.data_parallel import DataParallel
from trainer.io import checkpoint as ckpt
from trainer.lifecycle.stops import CheckpointFailed, RecordsNotWritten, RecordWrites, StepBoundary, checkpoint_on_stop
from trainer.rl.loop import save_step
from trainer.rl.run import TrainResult

REPO = Path(__file__).resolve().parents[3]


class Adapter:
    def __init__(self, fail: bool):
        self.fail = fail

    def save_pretrained(self, path):
        os.makedirs(path)
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        torch.save({"w": torch.arange(8.0)}, os.path.join(path, "adapter_model.bin"))


def _run(tmp_path, fail: bool):
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([p], lr=1e-3)
    return SimpleNamespace(cfg=SimpleNamespace(run_dir=tmp_path, checkpoint=SimpleNamespace(keep_last=2)), stage=0,
                           dp=DataParallel(), is_main=True, policy=Adapter(fail), optimizer=opt,
                           scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), modules={},
                           accelerator=SimpleNamespace(wait_for_everyone=lambda: None))


def test_a_full_disk_at_a_checkpoint_is_checkpoint_failed_with_status_6(tmp_path):
    older = save_step(_run(tmp_path, fail=False), 1, TrainResult(run_dir=tmp_path), {"batcher": {}})
    with pytest.raises(CheckpointFailed) as e:
        save_step(_run(tmp_path, fail=True), 2, TrainResult(run_dir=tmp_path), {"batcher": {}})
    assert e.value.exit_status == 6 and isinstance(e.value.__cause__, ckpt.CheckpointNotWritten)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("checkpoint 2 was not written: the disk is full at"), msg
    assert f"the newest checkpoint, {older}, is intact" in msg and "--resume" in e.value.checkpoint_note
    assert ckpt.verify_checkpoint(older) is None and [p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir()] == [
        "step_000001"]


def test_less_room_than_the_last_checkpoint_took_is_refused_before_any_rank_writes(tmp_path, monkeypatch):
    from trainer.io import write_failure

    older = save_step(_run(tmp_path, fail=False), 1, TrainResult(run_dir=tmp_path), {"batcher": {}})
    needed = ckpt._checkpoint_bytes(older)
    assert needed > 0
    monkeypatch.setattr(write_failure, "free_bytes", lambda path: needed - 1)
    for stage in (0, 2):  # under DeepSpeed (2) the engine, which would write the shards, is never reached
        run = _run(tmp_path, fail=False)
        run.stage, run.model = stage, None
        with pytest.raises(CheckpointFailed) as e:
            save_step(run, 2, TrainResult(run_dir=tmp_path), {"batcher": {}})
        msg = str(e.value)
        assert msg.startswith(f"checkpoint 2 was not written: the disk is full at {ckpt.checkpoints_dir(tmp_path)}")
        assert "free, about" in msg and f"the newest checkpoint, {older}, is intact" in msg, msg
    assert [p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir()] == ["step_000001"]
    monkeypatch.setattr(write_failure, "free_bytes", lambda path: needed)  # exactly enough: written
    assert save_step(_run(tmp_path, fail=False), 2, TrainResult(run_dir=tmp_path), {"batcher": {}}).name == "step_000002"


def test_a_stop_does_not_take_a_damaged_folder_for_its_steps_checkpoint(tmp_path):
    run = _run(tmp_path, fail=False)
    path = save_step(run, 2, TrainResult(run_dir=tmp_path), {"batcher": {}})
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps({**state, "step": 1}))  # its manifest no longer matches
    boundary = StepBoundary()
    boundary.begin(2, {"batcher": {}})
    boundary.update_applied()
    saved = []
    note = checkpoint_on_stop(tmp_path, boundary, lambda s, st: saved.append(s) or path)
    assert saved == [2] and "written to" in note, note


def test_parityrl_train_exits_6_with_one_line(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from trainer.commands.train import run_train_command
    from trainer.rl import loop

    def train(cfg, resume=False):
        raise CheckpointFailed(f"checkpoint 2 was not written: the disk is full at {tmp_path} (4.1 kB free)")

    monkeypatch.setattr(loop, "train", train)
    status = run_train_command(str(REPO / "recipes" / "grpo_tiny.yaml"), [f"logging.run_dir={tmp_path / 'r'}"],
                               resume=False)
    (line,) = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("parityrl:")]
    assert status == 6 and line.startswith("parityrl: stopped: checkpoint 2 was not written: the disk is full"), line
    assert line.endswith(f"fix that and continue with `parityrl train {REPO / 'recipes' / 'grpo_tiny.yaml'} --set "
                         f"logging.run_dir={tmp_path / 'r'} --resume` from the newest checkpoint"), line


@pytest.mark.slow
def test_a_run_whose_disk_fills_at_step_2_stops_with_status_6_and_resumes(tmp_path, tiny_model_dir, monkeypatch,
                                                                          capsys):
    from trainer.commands.train import run_train_command

    sets = [f"logging.run_dir={tmp_path / 'run'}", "logging.wandb.mode=disabled", "rollout.engine=hf",
            "rollout.prompts_per_step=2", "algorithm.group_size=2", "rollout.max_new_tokens=4", "train.steps=2",
            "checkpoint.every=1", "parity.probe_prompts=0", "data.num_examples=8"]
    real = torch.save

    def full_at_step_2(obj, f, *a, **kw):
        if "step_000002" in str(f) and str(f).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", full_at_step_2)
    recipe = str(REPO / "recipes" / "grpo_tiny.yaml")
    assert run_train_command(recipe, sets, resume=False) == 6
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("parityrl:")]
    assert "checkpoint 2 was not written: the disk is full at" in line and "step_000001, is intact" in line, line
    assert "failed too" not in line and "Traceback" not in err, err  # not written a second time on the way out
    checkpoints = ckpt.checkpoints_dir(tmp_path / "run")
    assert [p.name for p in checkpoints.iterdir()] == ["step_000001"]
    monkeypatch.undo()
    assert run_train_command(recipe, sets, resume=True) == 0
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run")] == [1, 2]


def test_a_record_that_cannot_be_written_is_kept_until_the_steps_end_then_raised_with_status_6(tmp_path):
    records = RecordWrites()
    path = tmp_path / "metrics.jsonl"
    with records.writing(path, 3):
        raise OSError(errno.ENOSPC, "No space left on device")
    with records.writing(tmp_path / "samples.jsonl", 3):  # a later failure of the same step: the first is kept
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "samples.jsonl"))
    with records.writing(path, 3):
        pass
    with pytest.raises(RecordsNotWritten) as e:
        records.raise_together(DataParallel())
    msg = str(e.value)
    assert e.value.exit_status == 6 and "\n" not in msg, msg
    assert msg.startswith(f"step 3's record could not be written to {path}: the disk is full at {tmp_path}"), msg
    with pytest.raises(ZeroDivisionError):  # not a write failure: not its business
        with records.writing(path, 4):
            raise ZeroDivisionError


def test_closing_the_logger_after_a_failed_write_does_not_raise_again(tmp_path):
    from trainer.io.run_logger import RunLogger

    log = RunLogger(tmp_path, config={}, wandb_mode="disabled")
    log.log(1, {"reward/mean": 0.5}, echo=False)

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    log._file.close()
    log._file = FullDisk()
    with pytest.raises(OSError):
        log.log(2, {"reward/mean": 0.5}, echo=False)
    log.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.slow
def test_a_run_whose_disk_fills_while_writing_metrics_stops_at_that_steps_end_with_status_6(tmp_path, tiny_model_dir,
                                                                                        monkeypatch, capsys):
    from trainer.commands.train import run_train_command
    from trainer.io.run_logger import RunLogger

    sets = [f"logging.run_dir={tmp_path / 'run'}", "logging.wandb.mode=disabled", "rollout.engine=hf",
            "rollout.prompts_per_step=2", "algorithm.group_size=2", "rollout.max_new_tokens=4", "train.steps=3",
            "checkpoint.every=0", "parity.probe_prompts=0", "data.num_examples=8", "eval.every=0"]
    real = RunLogger._write

    def full_at_step_2(self, step, metrics):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, step, metrics)

    monkeypatch.setattr(RunLogger, "_write", full_at_step_2)
    assert run_train_command(str(REPO / "recipes" / "grpo_tiny.yaml"), sets, resume=False) == 6
    err = capsys.readouterr().err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("parityrl:")]
    assert f"step 2's record could not be written to {tmp_path / 'run' / 'metrics.jsonl'}: " in line, line
    assert "checkpoint of the last completed step 2 written to" in line and "Traceback" not in err, err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path / "run")] == [2]
