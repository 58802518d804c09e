"""The Triton kernels' self-check on a CUDA device, run in a process of its own (``isolated_self_check``).

A kernel that faults on a GPU (an illegal memory access, a misaligned address) does not raise an exception the
check could turn into "use the torch path": the fault is sticky in the CUDA context, and every later kernel of that
process fails with it, the torch path's included (CUDA's error model: such errors "leave the process in an
inconsistent state", and only a new process gets a usable context). Checked in the trainer's own process, a kernel
that faults on this GPU would therefore end the run at its first log-prob. A child process has a context of its own:
whatever the kernels do there, the trainer's context stays clean, and a child that dies says so as the check's
verdict (the torch path then runs, with the usual warning).

Cost, once per process, device and dtype (``parity.logprobs.dispatch`` memoizes the verdict): a Python start that
imports torch and Triton, a CUDA context on the same GPU while it runs (a few hundred MiB), and the kernels' compile,
which lands in Triton's on-disk cache the trainer's own first launches then read. The alternative, checking in
process and asking CUDA whether the context survived, cannot help: a faulted context is not recoverable in place.

The child is this file run as a script (not ``-m``: the package's ``__init__`` imports torch, which a child running
a stand-in check does not need): ``python self_check_process.py DEVICE DTYPE MODULE:FUNCTION``, where
``FUNCTION(device, dtype)`` (both strings) returns ``{"verdict": None | str}`` or ``{"oom": str}``
(``parity.logprobs.self_check.triton_check_outcome``); the child prints it as its last line after ``RESULT``.

Stdlib imports only, for the same reason.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

RESULT = "PARITYRL_SELF_CHECK_RESULT "
TRITON_CHECK = "parity.logprobs.self_check:triton_check_outcome"
# Compiling the kernels for a new GPU takes tens of seconds; a child that has not answered after this is stuck.
TIMEOUT_S = 600
_REPO = Path(__file__).resolve().parents[2]


def isolated_self_check(device, dtype, *, check: str = TRITON_CHECK, timeout_s: float = TIMEOUT_S) -> dict:
    """``check`` on ``device`` in ``dtype``, in a child process: its outcome, ``{"verdict": None | str}`` or
    ``{"oom": str}``; a child that died, hung or answered nothing is a verdict saying so."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, str(Path(__file__).resolve()), str(device), str(dtype).removeprefix("torch."), check]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"verdict": f"the check's process did not end within {timeout_s:.0f} s"}
    answers = [line[len(RESULT):] for line in proc.stdout.splitlines() if line.startswith(RESULT)]
    if proc.returncode == 0 and answers:
        return json.loads(answers[-1])
    return {"verdict": f"the check's process {_ended(proc.returncode)}: {_last_line(proc.stderr)}"}


def _ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"died of {signal.Signals(-returncode).name}"
        except ValueError:
            return f"died of signal {-returncode}"
    return f"exited with status {returncode}" if returncode else "answered nothing"


def _last_line(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1][:200] if lines else "no message"


def _child(argv: list[str]) -> int:
    device, dtype, check = argv
    module, _, name = check.partition(":")
    outcome = getattr(importlib.import_module(module), name)(device, dtype)
    print(RESULT + json.dumps(outcome), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
