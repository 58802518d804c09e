"""Checks the child process of ``parity.logprobs.self_check_process`` runs in tests/parity/test_self_check_process.py
(``MODULE:FUNCTION(device, dtype)``), each ending as a check can: a verdict, no room, or the process itself dying as a
kernel's fault on a GPU ends it (CUDA aborts the process; here ``os.abort``, the same SIGABRT). Stdlib only: the
child starts in a fraction of a second."""
import os
import sys
import time


def passes(device, dtype):
    return {"verdict": None}


def differs(device, dtype):
    return {"verdict": f"log-probs differ from the torch path (on {device} in {dtype})"}


def no_room(device, dtype):
    return {"oom": "CUDA out of memory. Tried to allocate 2.00 MiB"}


def faults(device, dtype):
    print("CUDA error: an illegal memory access was encountered", file=sys.stderr, flush=True)
    os.abort()


def raises(device, dtype):
    raise RuntimeError("Triton Error [CUDA]: misaligned address")


def hangs(device, dtype):
    time.sleep(60)
