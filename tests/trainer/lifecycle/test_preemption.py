"""trainer/lifecycle/preemption.py and trainer/lifecycle/stops.py: the signal handler, stopping every rank together, and the
checkpoint of the last completed step (fast; the whole run under a signal is in test_stops_integration.py)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.distributed.data_parallel import DataParallel
from trainer.io import checkpoint as ckpt
from trainer.lifecycle.preemption import Preemption
from trainer.lifecycle.stops import Preempted, RewardFailed, StepBoundary, checkpoint_on_stop, stop_together

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_first_signal_is_recorded_not_acted_on(signum, capsys):
    before = signal.getsignal(signum)
    p = Preemption().install()
    try:
        assert p.requested(DataParallel()) is None
        os.kill(os.getpid(), signum)  # the handler runs before the next bytecode: the process lives on
        assert p.signum == signum and p.requested(DataParallel()) == signum
        assert f"{signal.Signals(signum).name} received: stopping after this step" in capsys.readouterr().err
    finally:
        p.restore()
    assert signal.getsignal(signum) is before


def test_quiet_on_other_ranks(capsys):
    p = Preemption(announce=False).install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        p.restore()
    assert p.signum == signal.SIGTERM and capsys.readouterr().err == ""


def test_second_signal_exits_at_once():
    code = ("import os, signal, time\nfrom trainer.lifecycle.preemption import Preemption\nPreemption().install()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\nprint('after the first', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\nprint('survived')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -signal.SIGTERM
    assert proc.stdout == "after the first\n" and proc.stderr.count("SIGTERM received") == 1


def test_stop_together_on_one_process_raises_the_error_itself():
    stop_together(DataParallel(), None)
    err = RewardFailed("step 2: reward function 'r' returned nan at sample 0")
    with pytest.raises(RewardFailed) as got:
        stop_together(DataParallel(), err)
    assert got.value is err and got.value.exit_status == 5


def test_preempted_status_is_128_plus_the_signal_and_survives_pickling():
    import pickle

    e = pickle.loads(pickle.dumps(Preempted("SIGTERM after step 3 of 9", signal.SIGTERM)))
    assert e.exit_status == 143 and str(e) == "SIGTERM after step 3 of 9"
    assert Preempted("x", signal.SIGINT).exit_status == 130


def test_an_abandoned_step_checkpoints_the_previous_one_with_its_rng(tmp_path):
    torch.manual_seed(0)
    b = StepBoundary()
    b.begin(4, {"batcher": {"position": 12}})
    expected = torch.rand(3)  # what step 4 would have drawn first
    torch.rand(5)  # the abandoned step consumed the RNG
    saved = []
    note = checkpoint_on_stop(tmp_path, b, lambda step, state: saved.append((step, state, torch.rand(3))) or "P")
    assert saved[0][0] == 3 and saved[0][1] == {"batcher": {"position": 12}}
    torch.testing.assert_close(saved[0][2], expected, rtol=0, atol=0)
    assert note == "checkpoint of the last completed step 3 written to P; continue with --resume"


def test_an_applied_step_checkpoints_itself_with_the_current_state(tmp_path):
    b = StepBoundary()
    b.begin(4, {"batcher": {"position": 12}})
    b.update_applied()
    saved = []
    checkpoint_on_stop(tmp_path, b, lambda step, state: saved.append((step, state)) or "P")
    assert saved == [(4, None)]


def test_nothing_to_write_before_the_first_step_or_when_already_saved(tmp_path, monkeypatch):
    b = StepBoundary()
    b.begin(1, {})
    never = lambda step, state: pytest.fail("nothing should be written")  # noqa: E731
    assert "no step was completed" in checkpoint_on_stop(tmp_path, b, never)
    done = ckpt.checkpoints_dir(tmp_path) / "step_000003"
    monkeypatch.setattr(ckpt, "list_checkpoints", lambda run_dir: [(3, done)] if run_dir == tmp_path else [])
    monkeypatch.setattr(ckpt, "verify_checkpoint", lambda path: None if path == done else "damaged")  # complete
    b.begin(4, {})
    assert f"step 3 is checkpointed at {done}" in checkpoint_on_stop(tmp_path, b, never)


def test_a_failing_save_does_not_hide_the_stop(tmp_path):
    b = StepBoundary()
    b.begin(3, {})

    def broken(step, state):
        raise OSError("disk full")

    assert "writing the checkpoint of step 2 failed too (OSError: disk full)" in checkpoint_on_stop(tmp_path, b, broken)
