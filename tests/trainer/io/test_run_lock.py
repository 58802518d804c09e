"""One writer per run directory (trainer/io/run_lock.py): a live holder refuses the next run, a dead one's lock is
taken over with a note. Holders are real processes; the refusal is checked through the CLI as a user meets it."""
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.io.run_lock import LOCK_FILE, RunDirInUse, RunLock

REPO = Path(__file__).resolve().parents[3]
HOLD = ("import sys, time; from trainer.io.run_lock import RunLock; lock = RunLock(sys.argv[1]); print('held', flush=True); "
        "time.sleep(600)")


@pytest.fixture
def holder(tmp_path):
    run_dir = tmp_path / "runs" / "x"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout.readline().strip() == "held"
    yield run_dir, p
    if p.poll() is None:
        p.kill()
        p.wait()


def test_a_live_holder_refuses_the_next_run_naming_pid_and_host(holder):
    run_dir, p = holder
    with pytest.raises(RunDirInUse) as e:
        RunLock(run_dir)
    msg = str(e.value)
    assert str(run_dir) in msg and f"pid {p.pid}" in msg and socket.gethostname() in msg, msg


@pytest.mark.slow
def test_cli_resume_while_the_run_is_training_exits_2_with_one_line(holder, tmp_path):
    run_dir, p = holder
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    out = subprocess.run([sys.executable, "-m", "trainer.cli", "train", str(REPO / "recipes" / "grpo_tiny.yaml"),
                          "--set", "name=x", "--set", f"logging.run_dir={run_dir}", "--resume"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and str(run_dir) in lines[0] and f"pid {p.pid}" in lines[0], out.stderr


def test_a_dead_holders_lock_is_taken_over_with_a_note(holder):
    run_dir, p = holder
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    lock = RunLock(run_dir)
    try:
        assert lock.note and f"pid {p.pid}" in lock.note and "no longer running" in lock.note
        assert f'"pid": {os.getpid()}' in (run_dir / LOCK_FILE).read_text()
    finally:
        lock.release()
    # a clean release leaves nothing to take over
    again = RunLock(run_dir)
    assert again.note is None
    again.release()
