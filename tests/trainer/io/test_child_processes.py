"""Nothing `parityrl serve` starts outlives it (trainer/io/child_processes.py): processes are counted after killing
the parent. The fast test stands a two-level process tree in for vLLM's API server -> EngineCore -> worker; the
slow one runs the real `parityrl serve`."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
WAIT_S = 60  # a bound on how long the kernel + watchdog may take, not a timing claim
# the "server": starts a child (the "engine core") that starts a grandchild, prints all pids, sleeps
TREE = """
import subprocess, sys, time
core = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                         "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
                         "print(w.pid, flush=True); time.sleep(600)"], stdout=subprocess.PIPE, text=True)
worker = core.stdout.readline().strip()
print(core.pid, worker, flush=True)
time.sleep(600)
"""
SUPERVISE = ("import sys; from trainer.io.child_processes import run_supervised; "
             "sys.exit(run_supervised([sys.executable, '-c', sys.argv[1]], {}))")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def descendants(pid: int) -> list[int]:
    out = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out += [int(child), *descendants(int(child))]
    return out


def wait_gone(pids, timeout=WAIT_S) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if alive(p)]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_server_tree_dies_with_its_supervisor(tmp_path, sig):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISE, TREE], stdout=subprocess.PIPE, text=True, env=env,
                           start_new_session=True)
    try:
        core, worker = map(int, sup.stdout.readline().split())
        tree = descendants(sup.pid)  # the server, its "engine core" and "worker", the watchdog
        assert core in tree and worker in tree and len(tree) == 4, tree
        os.kill(sup.pid, sig)
        sup.wait(timeout=WAIT_S)
        assert wait_gone(tree) == [], "left alive after the supervisor's death"
        if sig == signal.SIGTERM:
            assert sup.returncode == 128 + signal.SIGTERM
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)


def test_the_servers_exit_status_is_passed_on():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", SUPERVISE, "import sys; sys.exit(7)"], env=env, timeout=WAIT_S * 5)
    assert out.returncode == 7
