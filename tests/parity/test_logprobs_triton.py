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

import parity.logprobs.dispatch as dispatch  # where _backend_for looks up its check, its memo and the Triton module
import parity.logprobs.self_check as self_check
import parity.logprobs.sizing as sizing
from parity.logprobs.torch_path import _ChunkedLogProbs

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
    monkeypatch.setattr(dispatch, "_TRITON_CHECKED", {})

    def check(device, dtype):
        calls.append((str(device), dtype))
        return {"verdict": answers.get(dtype)}

    monkeypatch.setattr(dispatch, "isolated_self_check", check)
    return answers, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_tensors_go_to_triton(dtype, checked):
    assert dispatch._backend_for(_fake("cuda", dtype)) is lt.TritonLogProbs


def test_kernels_that_fail_their_check_leave_the_torch_path_with_one_warning(checked):
    answers, calls = checked
    answers[torch.bfloat16] = "CompilationError: out of shared memory"
    with pytest.warns(UserWarning, match=r"failed their check on cuda:0 in torch.bfloat16 \(CompilationError: out of "
                                          r"shared memory\); the chunked torch path runs instead"):
        assert dispatch._backend_for(_fake("cuda", torch.bfloat16)) is _ChunkedLogProbs
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked once per device and dtype: no second warning
        assert dispatch._backend_for(_fake("cuda", torch.bfloat16)) is _ChunkedLogProbs
        assert dispatch._backend_for(_fake("cuda", torch.float16)) is lt.TritonLogProbs
    assert calls == [("cuda:0", torch.bfloat16), ("cuda:0", torch.float16)]


def test_cpu_float64_and_no_triton_go_to_torch(monkeypatch):
    assert dispatch._backend_for(torch.zeros(2, 3)) is _ChunkedLogProbs
    assert dispatch._backend_for(torch.zeros(2, 3, dtype=torch.bfloat16)) is _ChunkedLogProbs
    assert dispatch._backend_for(_fake("cuda", torch.float64)) is _ChunkedLogProbs
    monkeypatch.setattr(dispatch, "logprobs_triton", None)
    assert dispatch._backend_for(_fake("cuda", torch.bfloat16)) is _ChunkedLogProbs


def test_memory_budget_cpu_is_unchanged_and_cuda_follows_free_memory(monkeypatch):
    assert sizing._memory_budget(torch.device("cpu")) == sizing.DEFAULT_MEMORY_BUDGET_BYTES
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GiB, 80 * GiB))
    assert sizing._memory_budget(cuda) == sizing.CUDA_MEMORY_BUDGET_BYTES
    # 640 MiB of float32 at V = 152064: 1103 -> 1088 rows (multiple of 16)
    assert sizing._auto_chunk_rows(152064, sizing._memory_budget(cuda)) == 1088
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * GiB, 80 * GiB))
    assert sizing._memory_budget(cuda) == 256 * 2**20  # free / 8
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 * 2**20, 80 * GiB))
    assert sizing._memory_budget(cuda) == sizing.DEFAULT_MEMORY_BUDGET_BYTES  # never below the CPU budget


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


H100 = dict(sms=132, l2_bytes=50 * 2**20)


@pytest.mark.parametrize("n", [256, 4096, 16384, 65536])
def test_launch_plan_keeps_the_hidden_slabs_in_flight_within_l2_and_fills_waves(n):
    tiles = lt.CUDA_TILES
    h, vocab = 3584, 152064
    plan = lt.launch_plan(n, vocab, h, 2, tiles, **H100)
    row_blocks = -(-n // tiles.block_m)
    slab = tiles.block_m * h * 2
    # A wave of programs spans at most two groups: their slabs fit in the L2 with room for the weight tiles.
    assert plan.group_m * slab <= H100["l2_bytes"] * lt.L2_SHARE_FOR_HIDDEN
    assert plan.group_m * plan.splits >= H100["sms"] or plan.group_m == row_blocks
    assert plan.splits * plan.span >= vocab > (plan.splits - 1) * plan.span and plan.span % tiles.block_v == 0
    assert plan.programs == row_blocks * plan.splits >= 2 * H100["sms"]
    waves = -(-plan.programs // H100["sms"])
    assert plan.programs / (waves * H100["sms"]) >= 0.9  # the last wave is (nearly) full


def test_launch_plan_row_order_was_the_l2_problem():
    # Row blocks varying fastest over the whole grid keep every row block's slab in flight: at N = 16384 that is
    # 128 slabs of 128 x 3584 bf16 (117 MB) for a 50 MB L2. The plan's groups hold a bounded number.
    plan = lt.launch_plan(16384, 152064, 3584, 2, lt.CUDA_TILES, **H100)
    assert 128 * lt.CUDA_TILES.block_m * 3584 * 2 > H100["l2_bytes"]
    assert plan.group_m < 128


def test_interpreter_plan_exercises_merge_and_groups():
    plan = lt.launch_plan(37, 70, 40, 4, lt.INTERPRETER_TILES, sms=None)
    assert plan == lt.LaunchPlan(splits=2, span=48, group_m=2, programs=6)


def test_a_self_check_that_ran_out_of_memory_is_tried_again(monkeypatch):
    monkeypatch.setattr(dispatch, "_TRITON_CHECKED", {})
    monkeypatch.setattr(dispatch, "_TRITON_CHECK_OOM", set())
    answers = [{"oom": "CUDA out of memory. Tried to allocate 2.00 MiB"}, {"verdict": None}]

    def check(device, dtype):
        return answers.pop(0)

    monkeypatch.setattr(dispatch, "isolated_self_check", check)
    with pytest.warns(UserWarning, match="ran out of memory .*until a later call can check them"):
        assert dispatch._backend_for(_fake("cuda", torch.bfloat16)) is _ChunkedLogProbs
    assert dispatch._backend_for(_fake("cuda", torch.bfloat16)) is lt.TritonLogProbs
    assert answers == []


def test_the_self_check_turns_out_of_memory_into_a_retry(monkeypatch):
    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(lt.TritonLogProbs, "apply", oom)
    with pytest.raises(self_check._CheckOutOfMemory, match="out of memory"):
        self_check._triton_self_check(torch.device("cpu"), torch.float32)
    # what the child process answers for it (self_check_process): an outcome, not a verdict
    assert "out of memory" in self_check.triton_check_outcome("cpu", "float32")["oom"]


def test_the_self_check_shape_forces_every_loop_of_the_kernels(monkeypatch):
    props = SimpleNamespace(multi_processor_count=132, L2_cache_size=50 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    for dtype in (torch.bfloat16, torch.float32):
        tiles = lt.tiles_for(torch.device("cuda"), dtype)
        n, h, v, chunk = self_check.self_check_shape("cuda", dtype)
        plan = lt.launch_plan(n, v, h, torch.tensor([], dtype=dtype).element_size(), tiles, sms=132,
                              l2_bytes=50 * 2**20)
        assert -(-n // tiles.block_m) >= 3 and n % tiles.block_m  # several row blocks, a ragged one
        assert -(-h // tiles.block_k) >= 3 and h % tiles.block_k  # several K steps, a ragged one
        assert plan.span >= 2 * tiles.block_v and v % tiles.block_v  # several tiles per program, a ragged one
        assert -(-n // chunk) >= 3  # several backward chunks
