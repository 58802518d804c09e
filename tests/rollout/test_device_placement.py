"""rollout.device_placement: each rank's colocated engine on its own GPU, on CPU with a fake CUDA host.

The fake host: torch.cuda reports N GPUs and keeps a current device; torch.distributed reports a launched group. The
engine's side is vLLM's own decision, read from the real code: ``FakeLLM`` builds vLLM's config from the options
``VLLMEngine`` passes (``EngineArgs.create_engine_config``), picks the executor vLLM would (``Executor.get_class``),
asks it for the worker's local rank (``_distributed_args``, with ``device_config.device`` as the CUDA platform leaves
it: ``cuda``, no index) and then does what ``GPUWorker.init_device`` does with it: that GPU becomes current.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout import device_placement as P
from rollout.vllm_engine import VLLMEngine


class FakeCudaHost:
    def __init__(self, monkeypatch, gpus: int = 4, current: int = 0, world: int = 1, rank: int = 0):
        self.gpus, self.current = gpus, current
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: self.gpus)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        # the engine keeps the trainer's RNG streams (fork_rng over the current CUDA device)
        monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8))
        monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": None)
        if world > 1:
            monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
            monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: world)
            monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: rank)

    def set_device(self, device) -> None:
        self.current = device if isinstance(device, int) else torch.device(device).index


class FakeLLM:
    """vLLM's in-process engine up to its worker's ``init_device``, as far as the GPU is concerned."""
    host: FakeCudaHost
    options: dict

    def __init__(self, model, **options):
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.executor.abstract import Executor

        type(self).options = options
        config = EngineArgs(model=model, **options).create_engine_config()
        executor = object.__new__(Executor.get_class(config))
        executor.vllm_config = config
        config.device_config.device = torch.device("cuda")  # the CUDA platform's DeviceConfig: type only
        _, _, self.local_rank = executor._distributed_args()
        self.host.set_device(self.local_rank)  # GPUWorker.init_device: torch.accelerator.set_device_index

    def collective_rpc(self, fn, *args, **kwargs):
        return [fn(SimpleNamespace(device=torch.device("cuda", self.local_rank)))]

    def apply_model(self, fn):
        raise RuntimeError("no model in this fake")


@pytest.fixture
def fake_llm(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(VLLMEngine, "_live", 0)
    return FakeLLM


def _engine(model_dir):
    return VLLMEngine(model_dir, max_model_len=64, gpu_memory_utilization=0.3, enforce_eager=True)


def test_each_rank_engine_on_its_own_gpu_and_the_trainer_keeps_it(monkeypatch, fake_llm, tiny_model_dir):
    """Rank 3 of 4 (LOCAL_RANK 3, trainer on cuda:3): vLLM's executor takes GPU 3, not 0; the current device is
    cuda:3 afterwards."""
    fake_llm.host = FakeCudaHost(monkeypatch, gpus=4, current=3, world=4, rank=3)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    engine = _engine(tiny_model_dir)
    assert (engine.llm.local_rank, torch.cuda.current_device()) == (3, 3)
    assert fake_llm.options["distributed_executor_backend"] == "external_launcher"


def test_one_process_keeps_vllms_in_process_executor(monkeypatch, fake_llm, tiny_model_dir):
    fake_llm.host = FakeCudaHost(monkeypatch, gpus=2, current=0)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    engine = _engine(tiny_model_dir)
    assert "distributed_executor_backend" not in fake_llm.options and engine.llm.local_rank == 0


def test_an_engine_on_another_gpu_than_the_trainer_is_refused(monkeypatch, fake_llm, tiny_model_dir):
    """One process whose trainer is on cuda:1 (torch.cuda.set_device): vLLM's in-process engine takes GPU 0."""
    fake_llm.host = FakeCudaHost(monkeypatch, gpus=2, current=1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(P.PlacementError, match=r"started on cuda:0, this process trains on cuda:1.*CUDA_VISIBLE_DEVICES"):
        _engine(tiny_model_dir)
    assert torch.cuda.current_device() == 1


def test_a_rank_without_launcher_variables_or_a_gpu_of_its_own_is_refused(monkeypatch):
    FakeCudaHost(monkeypatch, gpus=2, world=4, rank=3)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(P.PlacementError, match="RANK not set: rank 3 of 4"):
        P.placement_options(True)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(P.PlacementError, match=r"LOCAL_RANK = 3: this process sees 2 GPU\(s\).*one process per visible"):
        P.placement_options(True)
    assert P.placement_options(False) == {}


def test_rank_gpu_index_reads_local_rank_then_the_current_device(monkeypatch):
    host = FakeCudaHost(monkeypatch, gpus=4, current=2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert P.rank_gpu_index() == 2
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert P.rank_gpu_index() == 1
    host.gpus = 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(P.PlacementError, match=r"LOCAL_RANK = 1: this process sees 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES=5\)"):
        P.rank_gpu_index()
