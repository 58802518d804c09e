"""Whatever sits at a step's path: resume skips it naming why, the retrained step is written in its place (the thing
moved aside, not deleted), and a step that cannot be written says why and where -- a full disk with its free and
needed bytes -- leaving the older checkpoints intact."""
import errno
import json
import os

import pytest
import torch
from test_checkpoint_manifest import FakeAdapter, save  # the manifest tests' writer

from trainer.io import checkpoint as ckpt, write_failure
from trainer.lifecycle.run_state import choose_checkpoint


def _file(step_dir):
    step_dir.rename(step_dir.with_name("moved"))
    step_dir.write_text("not a checkpoint")


def _self_link(step_dir):
    step_dir.rename(step_dir.with_name("moved"))
    os.symlink(step_dir.name, step_dir)  # a link to itself: ELOOP on every access


def _dangling_link(step_dir):
    step_dir.rename(step_dir.with_name("moved"))
    os.symlink("nowhere", step_dir)


def _other_steps_state(step_dir):
    # state.json of step 1 in step 2's folder, the manifest recomputed to match: only the step tells
    state = json.loads((step_dir / "state.json").read_text())
    (step_dir / "state.json").write_text(json.dumps({**state, "step": 1}))
    (step_dir / "manifest.json").write_text(json.dumps(ckpt._manifest(step_dir)))


DAMAGES = {
    "a_file": (_file, "a file (16 bytes), not a checkpoint folder"),
    "a_symlink_to_itself": (_self_link, "a symlink that loops (to 'step_000002')"),
    "a_dangling_symlink": (_dangling_link, "a symlink to 'nowhere', which cannot be followed"),
    "state_of_another_step": (_other_steps_state, "its state.json says step 1, its folder step 2"),
}


def _unreadable(monkeypatch, path):
    # chmod 000 does not stop root (these tests may run as root): the refusal is simulated at the call that reads
    real = os.listdir

    def listdir(p="."):
        if os.fspath(p) == os.fspath(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(p))
        return real(p)

    monkeypatch.setattr(os, "listdir", listdir)


@pytest.mark.parametrize("damage", [*DAMAGES, "an_unreadable_folder"])
def test_a_damaged_step_is_skipped_by_name_and_the_retrained_step_takes_its_place(tmp_path, damage, monkeypatch,
                                                                                    capsys):
    older, newer = save(tmp_path, 1), save(tmp_path, 2)
    if damage == "an_unreadable_folder":
        _unreadable(monkeypatch, newer)
        why = "a folder that cannot be read (PermissionError: Permission denied)"
    else:
        DAMAGES[damage][0](newer)
        why = DAMAGES[damage][1]
    before = os.lstat(newer)
    assert ckpt.verify_checkpoint(newer).startswith(why)
    assert choose_checkpoint(tmp_path, verbose=True) == older
    assert f"skipped {newer} ({why}" in capsys.readouterr().out

    assert save(tmp_path, 2) == newer  # the retrained step: written, not a NotADirectoryError / PermissionError
    monkeypatch.undo()
    out = capsys.readouterr().out
    aside = [p for p in newer.parent.iterdir() if p.name.startswith("step_000002.damaged-")]
    assert len(aside) == 1 and f"moved it aside to {aside[0]}" in out and why in out, out
    assert os.lstat(aside[0]).st_ino == before.st_ino  # the same thing, renamed: nothing the user had is lost
    assert ckpt.verify_checkpoint(newer) is None and choose_checkpoint(tmp_path, verbose=True) == newer
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [1, 2]


def test_what_cannot_be_moved_aside_stops_the_write_with_one_line_naming_it(tmp_path, monkeypatch, capsys):
    older, newer = save(tmp_path, 1), save(tmp_path, 2)
    _file(newer)

    def rename(src, dst):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(ckpt.CheckpointNotWritten) as e:
        save(tmp_path, 2)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint 2 cannot be written: {newer} is in the way (a file"), msg
    assert "could not be moved aside (PermissionError: Permission denied); move or delete it" in msg
    assert newer.read_text() == "not a checkpoint" and ckpt.verify_checkpoint(older) is None
    assert not list(ckpt.checkpoints_dir(tmp_path).glob(".tmp_*"))


def test_a_newer_damaged_checkpoint_never_prunes_the_one_just_written(tmp_path, monkeypatch):
    save(tmp_path, 1)
    _other_steps_state(save(tmp_path, 3))  # complete-looking (it has a manifest) but not usable
    real = ckpt.save_checkpoint
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda *a, **kw: real(*a, **{**kw, "keep_last": 1}))
    path = save(tmp_path, 2)
    assert ckpt.verify_checkpoint(path) is None
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [2, 3]  # step 1 pruned; step 3 left for the user


def test_a_full_disk_names_the_path_the_free_and_needed_bytes_and_keeps_the_older_checkpoint(tmp_path, monkeypatch):
    older = save(tmp_path, 1)
    needed = sum(f["bytes"] for f in json.loads((older / "manifest.json").read_text())["files"].values())
    monkeypatch.setattr(write_failure, "free_bytes", lambda path: 4096)
    with pytest.raises(ckpt.CheckpointNotWritten) as e:
        save(tmp_path, 2, model=FakeAdapter(fail=True))  # OSError ENOSPC from the adapter's writer
    msg = str(e.value)
    assert "\n" not in msg, msg
    assert msg.startswith(f"checkpoint 2 was not written: the disk is full at {ckpt.checkpoints_dir(tmp_path)} "
                          f"(4.1 kB free, about {write_failure.size(needed)} needed)"), msg
    assert msg.endswith(f"the newest checkpoint, {older}, is intact"), msg
    assert ckpt.verify_checkpoint(older) is None and [p.name for p in ckpt.checkpoints_dir(tmp_path).iterdir()] == [
        "step_000001"]


def _torch_writer_fails(monkeypatch):
    # torch.save's zip writer on a full disk: a short write it reports without the errno
    real = torch.save

    def short_write(obj, f, *a, **kw):
        if str(f).endswith("optimizer.pt"):
            with open(f, "wb") as out:
                out.write(b"PK" * 100)
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 470")
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(torch, "save", short_write)


def test_torchs_unexplained_write_failure_is_a_full_disk_only_when_the_disk_is_full(tmp_path, monkeypatch):
    older = save(tmp_path, 1)
    _torch_writer_fails(monkeypatch)
    monkeypatch.setattr(write_failure, "free_bytes", lambda path: 1 << 20)
    with pytest.raises(ckpt.CheckpointNotWritten, match=r"the disk is full at .*\(1.0 MB free, about .* needed, "
                                                        r".* written before it failed\)"):
        save(tmp_path, 2)
    monkeypatch.setattr(write_failure, "free_bytes", lambda path: 50 << 30)
    with pytest.raises(ckpt.CheckpointNotWritten) as e:
        save(tmp_path, 2)
    assert "disk is full" not in str(e.value) and "RuntimeError at" in str(e.value) and "unexpected pos" in str(e.value)
    assert "53.7 GB free" in str(e.value) and ckpt.verify_checkpoint(older) is None


def test_a_bug_in_the_writer_is_not_disguised_as_a_write_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "save", lambda *a, **kw: (_ for _ in ()).throw(TypeError("cannot pickle 'x'")))
    with pytest.raises(TypeError, match="cannot pickle"):
        save(tmp_path, 1)
    assert list(ckpt.checkpoints_dir(tmp_path).iterdir()) == []


@pytest.mark.parametrize("error, free, full", [
    (OSError(errno.ENOSPC, "No space left on device"), 50 << 30, True),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), 50 << 30, True),
    (Exception('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left" })'),
     None, True),  # safetensors (PEFT's adapter file)
    (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"), 0, True),
    (RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"), None, False),
    (PermissionError(errno.EACCES, "Permission denied"), 0, False),
])
def test_what_counts_as_a_full_disk(error, free, full):
    assert write_failure.is_write_failure(error)
    assert write_failure.is_disk_full(error, free) is full
