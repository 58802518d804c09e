"""Two in-process engines and vLLM's one workspace manager (rollout.vllm_workspace), without a GPU.

vLLM's own ``vllm.v1.worker.workspace`` runs here on CPU tensors: its replacement rule (each new engine's
``init_workspace_manager`` replaces the process's manager), its lock after graph capture, and the fused-MoE
forward's request (``get_simultaneous``, as ``fused_moe/modular_kernel.py`` asks on CUDA). vLLM's ``LLM`` is
replaced by a recorder that makes its manager as vLLM's CUDA worker does (``gpu_worker.py:
_init_workspace_and_model_runner``), so the engine's wiring is checked without starting vLLM.
"""
import gc
import weakref

import pytest
import torch
from engine_on_cuda_standin import start_engines_as_on_cuda
from vllm.v1.worker import workspace

from rollout.vllm_engine import VLLMEngine
from rollout.vllm_workspace import engine_workspace, guard_generate, using_workspace

MOE_SCRATCH = ((4096,), torch.bfloat16), ((1024,), torch.bfloat16)  # what one fused-MoE forward asks for


def moe_forward() -> list[torch.Tensor]:
    """The fused-MoE forward's scratch request on CUDA (modular_kernel.py: current_workspace_manager())."""
    return workspace.current_workspace_manager().get_simultaneous(*MOE_SCRATCH)


def start_engine(moe: bool):
    """What vLLM's CUDA worker does with the workspace as an engine starts: a new manager, the profile run's MoE
    scratch (an MoE model), locked after CUDA graph capture (Model Runner V2's capture_model)."""
    workspace.init_workspace_manager(torch.device("cpu"))
    if moe:
        moe_forward()
    workspace.lock_workspace()


@pytest.fixture(autouse=True)
def keep_vllms_manager(monkeypatch):
    # a resize hands the old segment back to the CUDA caching allocator first; no accelerator here
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    saved = workspace._manager
    yield
    workspace._manager = saved


def test_the_next_engine_replaces_the_manager_and_refuses_the_first_engines_moe_scratch():
    start_engine(moe=True)  # the teacher (an MoE model), started first
    teacher = engine_workspace()
    start_engine(moe=False)  # the dense student: its manager locked with no scratch
    assert workspace.current_workspace_manager() is not teacher
    with pytest.raises(AssertionError, match="Workspace is locked"):
        moe_forward()  # the teacher's forward, unguarded: vLLM's own refusal


def test_the_first_engines_scratch_is_freed_unless_kept():
    start_engine(moe=True)
    first = weakref.ref(workspace._manager)
    start_engine(moe=False)
    gc.collect()
    assert first() is None  # what its captured CUDA graphs point at would be freed memory

    start_engine(moe=True)
    kept = engine_workspace()  # what VLLMEngine keeps
    buffer = kept._current_workspaces[0].data_ptr()
    start_engine(moe=False)
    gc.collect()
    assert kept._current_workspaces[0].data_ptr() == buffer  # alive, at the address the graphs captured


def test_each_engine_runs_on_its_own_scratch():
    start_engine(moe=True)
    teacher = engine_workspace()
    teacher_buffer = teacher._current_workspaces[0].data_ptr()
    start_engine(moe=True)  # an MoE student too: its own scratch, in its own pool (cumem under sleep mode)
    student = engine_workspace()
    with using_workspace(teacher):
        scratch = moe_forward()
    assert scratch[0].data_ptr() == teacher_buffer  # the teacher's buffer, never the (sleeping) student's
    assert workspace.current_workspace_manager() is student  # given back after the forward
    with using_workspace(None):  # an engine that made none (CPU): nothing changes
        assert workspace.current_workspace_manager() is student


def test_the_previous_manager_is_restored_when_a_forward_raises():
    start_engine(moe=False)
    student = engine_workspace()
    start_engine(moe=True)
    teacher = engine_workspace()
    workspace._manager = student
    with pytest.raises(RuntimeError), using_workspace(teacher):
        raise RuntimeError("a forward failed")
    assert workspace.current_workspace_manager() is student


# ---- the engine's wiring, vLLM's LLM a recorder ------------------------------------------------------------


class WorkspaceLLM:
    """vllm.LLM as far as the workspace goes: starting makes the engine's manager (MoE: scratch reserved), every
    generate runs an MoE forward's request on the current manager and records which manager it was."""

    moe = True
    seen: list = []

    def __init__(self, model, **kwargs):
        start_engine(moe=WorkspaceLLM.moe)

    def apply_model(self, fn):
        return [None]

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        WorkspaceLLM.seen.append(workspace._manager)
        moe_forward()
        return []


@pytest.fixture
def recorded_cuda_engines(monkeypatch):
    WorkspaceLLM.seen = []
    start_engines_as_on_cuda(monkeypatch, WorkspaceLLM)
    return WorkspaceLLM


def test_the_teacher_built_first_scores_on_its_own_scratch(recorded_cuda_engines, tiny_model_dir):
    recorded_cuda_engines.moe = True
    teacher = VLLMEngine(tiny_model_dir, max_model_len=64, gpu_memory_utilization=0.3)
    recorded_cuda_engines.moe = False
    student = VLLMEngine(tiny_model_dir, max_model_len=64, gpu_memory_utilization=0.3, enable_sleep_mode=True)
    assert teacher._workspace is not student._workspace
    teacher.llm.generate([], [])  # its forward: the student's locked manager would refuse it (first test)
    assert recorded_cuda_engines.seen == [teacher._workspace]
    assert workspace._manager is student._workspace  # the student's stays current between forwards
    with pytest.raises(AssertionError, match="Workspace is locked"):
        WorkspaceLLM.generate(teacher.llm, [], [])  # the same forward without the engine's guard


def test_guard_generate_does_nothing_without_a_manager():
    class Plain:
        def generate(self):
            return "ran"

    llm = Plain()
    guard_generate(llm, None)
    assert "generate" not in vars(llm) and llm.generate() == "ran"
