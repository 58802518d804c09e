"""trainer/lifecycle/preemption.py StartupStop: before the first step SIGINT / SIGTERM end the process at once, one line,
status 128 + N, the run lock released (fast; a real `parityrl train` under signals is in
tests/trainer/commands/test_signals.py)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.lifecycle.preemption import Preemption, StartupStop

REPO = Path(__file__).resolve().parents[3]

CHILD = """
import sys, time
from trainer.io.run_lock import claim
from trainer.lifecycle.preemption import StartupStop
lock = claim(sys.argv[1])
StartupStop(cleanup=lambda: (lock.release(), print("released", flush=True)),
            resume_command=sys.argv[2] if len(sys.argv) > 2 else "").install()
try:  # what third-party code at engine start does with an interrupt
    print("ready", flush=True)
    time.sleep(60)
except BaseException:
    pass
print("went on", flush=True)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_before_the_first_step_ends_the_process_at_once_with_one_line(signum, tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "run")], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum  # 130, 143: the documented statuses
    assert out == "released\n"  # the cleanup ran; nothing after the signal did
    assert err.splitlines() == [f"parityrl: {signal.Signals(signum).name} received before the first step: stopped at "
                                "once (nothing was trained in this launch, so there is nothing to checkpoint)"]
    assert (tmp_path / "run" / ".lock").read_text() == ""  # no holder left behind


def test_a_resumed_run_stopped_before_its_first_step_names_the_command_that_continues_it(tmp_path):
    command = "parityrl train recipes/grpo_tiny.yaml --set name=intr --resume"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path / "run"), command], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.splitlines() == ["parityrl: SIGINT received before the first step: stopped at once (nothing was trained "
                                "in this launch, so there is nothing to checkpoint); its checkpoints are untouched: "
                                f"continue with `{command}`"]


def test_the_loop_handler_takes_over_and_restores_the_defaults():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    startup = StartupStop(cleanup=lambda: None).install()
    assert signal.getsignal(signal.SIGTERM) == startup._handle
    p = Preemption().install()  # the loop's start ends the startup's handling
    try:
        assert signal.getsignal(signal.SIGTERM) == p._handle and startup._wakeup is None
    finally:
        p.restore()
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(-1) == -1  # the wake-up fd was given back too
    startup.end()  # idempotent
