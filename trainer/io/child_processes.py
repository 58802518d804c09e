"""A child process tree that dies with its parent: nothing `parityrl serve` (trainer/commands/serve.py) starts
outlives it.

vLLM's API server starts an EngineCore process, which starts workers; a SIGKILL of the API
server (or of `parityrl serve`) leaves them running, holding the model and the KV cache.
So `parityrl serve` does not become the server: it starts it as a child in a session (and
process group) of its own and stays its parent:

- the server ends (any way): whatever is left of its group is killed, and `parityrl serve`
  exits with the server's status (128 + N for signal N);
- `parityrl serve` gets SIGTERM / SIGINT / SIGHUP: forwarded to the whole group;
- `parityrl serve` is SIGKILLed (nothing of it runs): a watchdog process, in a session of its
  own, holds the read end of a pipe whose only write end is `parityrl serve`'s; the kernel
  closes it when `parityrl serve` dies, and the watchdog kills the group (SIGTERM, then
  SIGKILL after ``GRACE_S``).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

GRACE_S = 5.0
WATCHDOG = """
import os, signal, sys, time
sys.stdin.buffer.read()  # EOF: the supervisor is gone, however it ended
pgid = int(sys.argv[1])
for sig, wait in ((signal.SIGTERM, float(sys.argv[2])), (signal.SIGKILL, 0.0)):
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        break
    time.sleep(wait)
"""


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def run_supervised(argv: list[str], env: dict[str, str]) -> int:
    """Run ``argv`` as the leader of a new process group that dies with this process; its exit status."""
    pending: list[int] = []  # signals received before the server exists
    proc = None

    def forward(signum, _frame):
        if proc is None:
            pending.append(signum)
        else:
            _kill_group(proc.pid, signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    read_end, write_end = os.pipe()  # not inherited by children (PEP 446): this process holds the only write end
    watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(proc.pid), str(GRACE_S)], stdin=read_end,
                                start_new_session=True)
    os.close(read_end)
    for signum in pending:
        _kill_group(proc.pid, signum)
    try:
        rc = proc.wait()
    finally:
        _kill_group(proc.pid, signal.SIGKILL)  # EngineCore and workers the server left behind
        os.close(write_end)  # the watchdog finds the group gone and exits
        watchdog.wait()
    return 128 - rc if rc < 0 else rc
