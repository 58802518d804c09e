"""A checkpoint is complete when its manifest (sizes + SHA-256, written last) matches its files; resume takes the
newest complete one and names what it skipped. The damaged-checkpoint corpus (bench/checks/damaged_checkpoints.py) in
miniature: ten damages, each detected before anything is loaded."""
import errno
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from trainer.io import checkpoint as ckpt
from trainer.lifecycle.run_state import choose_checkpoint, claim_run_dir

REPO = Path(__file__).resolve().parents[3]


class FakeAdapter:
    def __init__(self, fail: bool = False):
        self.fail = fail

    def save_pretrained(self, path):
        os.makedirs(path)
        if self.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        torch.save({"w": torch.arange(64.0)}, os.path.join(path, "adapter_model.bin"))
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            f.write('{"r": 4}')


def save(run_dir, step, **kw):
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(3)
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return ckpt.save_checkpoint(run_dir, step, model=kw.pop("model", FakeAdapter()), optimizer=opt, scheduler=sched,
                                state={"batcher": {}}, keep_last=5, **kw)


def _corpus():
    """The damages of bench/checks/damaged_checkpoints.py, and two of the manifest itself."""
    spec = importlib.util.spec_from_file_location("damaged_checkpoints", REPO / "bench" / "checks" / "damaged_checkpoints.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {**mod.DAMAGES, "manifest_missing": lambda c: (c / "manifest.json").unlink(),
            "manifest_unreadable": lambda c: (c / "manifest.json").write_text("{")}


DAMAGES = _corpus()


def test_a_written_checkpoint_verifies_and_its_manifest_is_the_last_file(tmp_path):
    path = save(tmp_path, 1)
    assert ckpt.verify_checkpoint(path) is None
    newest = max(path.rglob("*"), key=lambda p: p.stat().st_mtime_ns)
    assert newest.name == "manifest.json"
    assert ckpt.latest_checkpoint(tmp_path) == path


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_each_damage_is_detected_and_resume_takes_the_older_one_saying_why(tmp_path, damage, capsys):
    older, newer = save(tmp_path, 1), save(tmp_path, 2)
    DAMAGES[damage](newer)
    why = ckpt.verify_checkpoint(newer)
    assert why, damage
    assert choose_checkpoint(tmp_path, verbose=True) == older
    out = capsys.readouterr().out
    assert f"skipped {newer}" in out and why in out and "step_000001" in out, out


def test_no_usable_checkpoint_is_one_line_naming_each_reason(tmp_path):
    for step, damage in ((1, "rng_missing"), (2, "weights_random_bytes")):
        DAMAGES[damage](save(tmp_path, step))
    with pytest.raises(FileNotFoundError) as e:
        choose_checkpoint(tmp_path, verbose=True)
    msg = str(e.value)
    assert "\n" not in msg and "step_000001: rng.pt missing" in msg and "step_000002: adapter/adapter_model.bin does not match" in msg


def test_a_failed_write_removes_its_partial_folder(tmp_path, capsys):
    with pytest.raises(ckpt.CheckpointNotWritten, match="checkpoint 1 was not written: the disk is full"):
        save(tmp_path, 1, model=FakeAdapter(fail=True))
    assert list(ckpt.checkpoints_dir(tmp_path).iterdir()) == []
    assert "partial folder" in capsys.readouterr().out


def test_partial_folders_of_a_killed_write_are_removed_at_start_with_a_note(tmp_path, capsys):
    from trainer.lifecycle.preflight import load_recipe

    cfg = load_recipe("recipes/grpo_tiny.yaml", [f"logging.run_dir={tmp_path}"], check_paths=False)
    save(tmp_path, 1)
    partial = ckpt.checkpoints_dir(tmp_path) / ".tmp_step_000002_12345"
    (partial / "adapter").mkdir(parents=True)
    lock = claim_run_dir(cfg, resume=False)
    lock.release()
    assert not partial.exists() and (ckpt.checkpoints_dir(tmp_path) / "step_000001").is_dir()
    assert f"removed {partial}" in capsys.readouterr().out
