"""The Triton backend's place in parity.logprobs: which backend runs where, tile sizing, and the interpreter tier.

The kernels themselves are checked in ``test_logprobs_triton_interpret.py``, which needs
``TRITON_INTERPRET=1`` before ``parity`` is imported: ``test_interpreter_tier`` runs it in
a fresh process (see that module's docstring).
"""

import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from interpreter_tier import run_interpreter_tier  # this folder is on sys.path (pytest rootdir-less import)

import parity.logprobs as lpmod

lt = pytest.importorskip("parity.logprobs_triton")

REPO = Path(__file__).resolve().parents[2]
GiB = 2**30


def _fake(device_type: str, dtype: torch.dtype):
    # _backend_for reads only .is_cuda, .device and .dtype; a stand-in avoids needing a GPU.
    return SimpleNamespace(is_cuda=device_type == "cuda", device=f"{device_type}:0", dtype=dtype)


@pytest.fixture
def checked(monkeypatch):
    """The kernels' self-check (which needs the device) answers as the test says; the per-process memo is fresh."""
    answers, calls = {}, []
    monkeypatch.setattr(lpmod, "_TRITON_CHECKED", {})

    def check(device, dtype):
        calls.append((str(device), dtype))
        return answers.get(dtype)

    monkeypatch.setattr(lpmod, "_triton_self_check", check)
    return answers, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_tensors_go_to_triton(dtype, checked):
    assert lpmod._backend_for(_fake("cuda", dtype)) is lt.TritonLogProbs


def test_kernels_that_fail_their_check_leave_the_torch_path_with_one_warning(checked):
    answers, calls = checked
    answers[torch.bfloat16] = "CompilationError: out of shared memory"
    with pytest.warns(UserWarning, match=r"failed their check on cuda:0 in torch.bfloat16 \(CompilationError: out of "
                                          r"shared memory\); the chunked torch path runs instead"):
        assert lpmod._backend_for(_fake("cuda", torch.bfloat16)) is lpmod._ChunkedLogProbs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked once per device and dtype: no second warning
        assert lpmod._backend_for(_fake("cuda", torch.bfloat16)) is lpmod._ChunkedLogProbs
        assert lpmod._backend_for(_fake("cuda", torch.float16)) is lt.TritonLogProbs
    assert calls == [("cuda:0", torch.bfloat16), ("cuda:0", torch.float16)]


def test_cpu_float64_and_no_triton_go_to_torch(monkeypatch):
    assert lpmod._backend_for(torch.zeros(2, 3)) is lpmod._ChunkedLogProbs
    assert lpmod._backend_for(torch.zeros(2, 3, dtype=torch.bfloat16)) is lpmod._ChunkedLogProbs
    assert lpmod._backend_for(_fake("cuda", torch.float64)) is lpmod._ChunkedLogProbs
    monkeypatch.setattr(lpmod, "logprobs_triton", None)
    assert lpmod._backend_for(_fake("cuda", torch.bfloat16)) is lpmod._ChunkedLogProbs


def test_memory_budget_cpu_is_unchanged_and_cuda_follows_free_memory(monkeypatch):
    assert lpmod._memory_budget(torch.device("cpu")) == lpmod.DEFAULT_MEMORY_BUDGET_BYTES
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GiB, 80 * GiB))
    assert lpmod._memory_budget(cuda) == lpmod.CUDA_MEMORY_BUDGET_BYTES
    # 640 MiB of float32 at V = 152064: 1103 -> 1088 rows (multiple of 16)
    assert lpmod._auto_chunk_rows(152064, lpmod._memory_budget(cuda)) == 1088
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * GiB, 80 * GiB))
    assert lpmod._memory_budget(cuda) == 256 * 2**20  # free / 8
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**20, 80 * GiB))
    assert lpmod._memory_budget(cuda) == lpmod.DEFAULT_MEMORY_BUDGET_BYTES  # never below the CPU budget


def test_triton_backward_chunk_rows(monkeypatch):
    cuda = torch.device("cuda")
    assert lt._chunk_rows(5000, 152064, 2, torch.device("cpu"), 16) == 5000  # interpreter: one chunk
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GiB, 80 * GiB))
    assert lt._chunk_rows(16384, 152064, 2, cuda, 128) == lt.CUDA_CHUNK_ROWS
    assert lt._chunk_rows(300, 152064, 2, cuda, 128) == 300
    # 1 GiB free: a quarter is 256 MiB = 882 bf16 rows at V = 152064 -> 768 (multiple of 128)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (GiB, 80 * GiB))
    assert lt._chunk_rows(16384, 152064, 2, cuda, 128) == 768
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * GiB))
    assert lt._chunk_rows(16384, 152064, 2, cuda, 128) == 128  # at least one row block


def test_supported_dtypes():
    assert all(lt.supports(d) for d in (torch.float32, torch.bfloat16, torch.float16))
    assert not lt.supports(torch.float64)


def test_interpreter_tier():
    run_interpreter_tier("test_logprobs_triton_interpret.py")
