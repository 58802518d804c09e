"""A dead extension build's lock is named before a DeepSpeed launch would wait on it forever."""
import os
import time

import pytest

from trainer.config import RecipeError
from trainer.lifecycle.extension_locks import STALE_AFTER_S, check_extension_locks, stale_extension_locks


def _lock(root, name, age_s):
    d = root / name
    d.mkdir(parents=True)
    lock = d / "lock"
    lock.write_text("")
    t = time.time() - age_s
    os.utime(lock, (t, t))
    return lock


def test_only_locks_older_than_the_threshold_are_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = _lock(tmp_path, "deepspeed_shm_comm", STALE_AFTER_S + 120)
    _lock(tmp_path, "building_now", 30)
    (tmp_path / "no_lock").mkdir()
    stale = stale_extension_locks()
    assert [p for p, _ in stale] == [old]
    assert stale[0][1] == pytest.approx(STALE_AFTER_S + 120, abs=5)


def test_a_deepspeed_launch_is_refused_with_the_file_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    old = _lock(tmp_path, "deepspeed_shm_comm", 3600)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(RecipeError) as e:
        check_extension_locks("recipes/ppo_tiny.yaml")
    msg = str(e.value)
    assert msg.startswith("recipes/ppo_tiny.yaml: ") and str(old) in msg and "60 min old" in msg
    assert f"rm {old}" in msg and old.exists()  # named, not removed


def test_without_deepspeed_or_without_a_stale_lock_nothing_is_said(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    _lock(tmp_path, "deepspeed_shm_comm", 3600)
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    check_extension_locks("r.yaml")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "empty"))
    check_extension_locks("r.yaml")
