"""The Triton kernels' self-check runs in a child process (``parity.logprobs.self_check_process``), so that a kernel
whose fault poisons the CUDA context cannot take the trainer's process (and its torch fallback) down with it. The
children here run stand-in checks (tests/parity/self_check_children.py), each ending as a check on a GPU can."""
from pathlib import Path

import pytest
import torch

from parity.logprobs.self_check import triton_check_outcome
from parity.logprobs.self_check_process import TRITON_CHECK, isolated_self_check

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def children(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(HERE))  # the child imports self_check_children (kept after the repo's root)


def _run(name: str) -> dict:
    return isolated_self_check("cuda:1", torch.bfloat16, check=f"self_check_children:{name}")


def test_a_child_that_dies_of_a_fault_is_a_verdict_and_this_process_goes_on():
    outcome = _run("faults")
    assert outcome == {"verdict": "the check's process died of SIGABRT: CUDA error: an illegal memory access was "
                                  "encountered"}
    assert float(torch.ones(3).sum()) == 3.0  # the torch path still runs here


def test_the_childs_answer_is_the_verdict():
    assert _run("passes") == {"verdict": None}
    assert _run("differs") == {"verdict": "log-probs differ from the torch path (on cuda:1 in bfloat16)"}
    assert _run("no_room") == {"oom": "CUDA out of memory. Tried to allocate 2.00 MiB"}


def test_a_check_that_raises_or_hangs_is_a_verdict():
    assert _run("raises")["verdict"].startswith("the check's process exited with status 1: RuntimeError: Triton "
                                                "Error [CUDA]: misaligned address")
    hung = isolated_self_check("cuda:1", torch.bfloat16, check="self_check_children:hangs", timeout_s=1)
    assert hung == {"verdict": "the check's process did not end within 1 s"}


def test_the_default_check_is_the_kernels_own():
    assert TRITON_CHECK == f"{triton_check_outcome.__module__}:{triton_check_outcome.__name__}"
