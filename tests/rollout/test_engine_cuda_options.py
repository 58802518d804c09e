"""What the colocated vLLM engine asks of vLLM on CUDA, checked without a GPU.

- vLLM's own option handling and config validation (``LLM`` -> ``EngineArgs.create_engine_config``) run on the
  options training passes, on a stand-in CUDA platform in a process of its own (cuda_standin.py): routes keep
  prefix caching (vLLM's AuxOutput connector refuses routes without it), CUDA graphs by default, sleep mode, the
  recipe's KV cache size and GPU share.
- Sleep mode's order around an update, with vLLM's ``LLM`` replaced by a recorder: sleep (level 1) -> the
  trainer's update -> wake the weights -> load -> wake the KV cache; a rollout wakes whatever still sleeps.
- Refusals before vLLM starts: ``VLLM_ENABLE_V1_MULTIPROCESSING`` other than 0, no GPU share on CUDA.
"""
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rollout.vllm_engine
from rollout.types import SamplingSpec
from rollout.vllm_engine import VLLMEngine
from trainer.builtin.zoo import ensure_arch_model
from trainer.config import LoraConfig, RolloutConfig
from trainer.models.policy import add_lora, load_base_model
from trainer.sampling.engines import sync_weights

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"


@pytest.fixture(scope="module")
def built(tiny_model_dir):
    """vLLM's configs of a dense and an MoE engine as training starts them on CUDA (one stand-in process)."""
    cases = [{"name": "dense", "recipe": str(RECIPE), "sets": [], "model": tiny_model_dir, "routes": False},
             {"name": "moe", "recipe": str(RECIPE), "sets": ["parity.routing_replay=on"],
              "model": str(ensure_arch_model("qwen3_moe", dtype="bfloat16")), "routes": True}]
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "cuda_standin.py"), json.dumps(cases)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    out = {c["name"]: c for c in (json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CASE "))}
    assert set(out) == {"dense", "moe"}, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_an_engine_returning_routes_on_cuda_passes_vllms_own_validation(built):
    moe = built["moe"]
    assert "error" not in moe, moe["error"]  # was: "AuxOutput Connector requires prefix caching."
    c = moe["config"]
    assert c["return_routed_experts"] and c["use_v2_model_runner"]  # vLLM's own capture, Model Runner V2
    assert c["enable_prefix_caching"]  # routes are kept per KV block; a cache hit keeps its routes


def test_the_cuda_engine_runs_graphs_sleeps_and_sizes_its_kv_cache_from_the_share(built):
    c = built["dense"]["config"]
    r = RolloutConfig()
    assert c["enforce_eager"] is False and c["compilation_mode"] != 0  # graphs (and compile) by default on CUDA
    assert c["enable_sleep_mode"] and c["enable_cumem_allocator"]  # sleep needs vLLM's cumem allocator
    # no size in the recipe: vLLM sizes the cache from the GPU share (was a fixed 256 MiB, ~4.7k tokens of a 7B model)
    assert r.kv_cache_memory_bytes is None and c["kv_cache_memory_bytes"] is None
    assert c["gpu_memory_utilization"] == r.gpu_memory_utilization  # the recipe's one default (was VLLMEngine's 0.5)


# ---- sleep mode around an update, vLLM replaced by a recorder ------------------------------------------------


class Stop(Exception):
    pass


class RecordingLLM:
    """vllm.LLM's calls the engine makes around an update, in order."""

    log: list = []

    def __init__(self, model, **kwargs):
        RecordingLLM.log.append(("LLM", {k: kwargs.get(k) for k in ("enable_sleep_mode", "enforce_eager")}))

    def apply_model(self, fn):
        return [None]

    def sleep(self, level=1):
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("wake_up", tags))
        return True

    def collective_rpc(self, method, kwargs=None, args=()):
        self.log.append((method, len(kwargs["weights_iterator"])))

    def reset_prefix_cache(self):
        self.log.append(("reset_prefix_cache",))
        return True

    @property
    def llm_engine(self):
        return self  # LLMEngine.reset_encoder_cache: the engine core's scheduler and worker

    def reset_encoder_cache(self):
        self.log.append(("reset_encoder_cache",))

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        self.log.append(("generate", len(prompts)))
        raise Stop


@pytest.fixture
def on_cuda(monkeypatch):
    """``torch.cuda.is_available()`` True for the engine, vLLM's LLM a recorder (nothing of vLLM starts)."""
    import vllm

    RecordingLLM.log = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # one GPU (rollout.device_placement asks)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(rollout.vllm_engine, "check_engine_device", lambda llm, expected: None)  # no worker
    monkeypatch.setattr(rollout.vllm_engine, "_preserve_rng", contextlib.nullcontext)  # it reads the CUDA RNG
    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    monkeypatch.setattr(VLLMEngine, "_live", VLLMEngine._live)  # restored: this engine is never closed
    return RecordingLLM.log


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    p = add_lora(load_base_model(tiny_model_dir, "float32", "cpu"), LoraConfig())
    with torch.no_grad():
        for i, (name, t) in enumerate(p.named_parameters()):
            if "lora_B" in name:
                t.normal_(0, 0.02, generator=torch.Generator().manual_seed(i))
    return p


def test_sleep_around_the_update_weights_woken_before_the_sync_kv_cache_after(on_cuda, policy, tiny_model_dir):
    log = on_cuda
    engine = VLLMEngine(tiny_model_dir, max_model_len=64, gpu_memory_utilization=0.3, enable_sleep_mode=True)
    assert log == [("LLM", {"enable_sleep_mode": True, "enforce_eager": False})]
    log.clear()
    engine.release_memory()  # the loop, after the rollout
    log.append(("update",))  # the trainer's update, while the engine sleeps
    layers = policy.config.num_hidden_layers
    sync_weights(engine, policy, dtype=torch.bfloat16, chunk_bytes=1)  # one decoder layer per chunk
    loads = [e for e in log if e[0] == "reload_weights"]
    assert len(loads) == layers
    assert log[:3] == [("sleep", 1), ("update",), ("wake_up", ["weights"])]
    each = [("reset_encoder_cache",), ("reset_prefix_cache",)]  # every reload forgets cached image features and KV
    assert log[3:3 + 3 * layers] == [x for load in loads for x in (load, *each)]
    assert log[3 + 3 * layers:] == [("wake_up", ["kv_cache"]), ("reset_prefix_cache",)]
    # awake now: a second sync wakes nothing
    log.clear()
    sync_weights(engine, policy, dtype=torch.bfloat16)
    assert {e[0] for e in log} == {"reload_weights", "reset_encoder_cache", "reset_prefix_cache"}


def test_a_rollout_wakes_a_sleeping_engine_first(on_cuda, tiny_model_dir):
    log = on_cuda
    engine = VLLMEngine(tiny_model_dir, max_model_len=64, gpu_memory_utilization=0.3, enable_sleep_mode=True)
    engine.release_memory()
    engine.release_memory()  # asleep already: nothing more
    log.clear()
    with pytest.raises(Stop):  # with rollout.sync_weights false nothing else wakes it
        engine.generate([[1, 5, 9]], SamplingSpec(n=1, max_new_tokens=4))
    assert log == [("wake_up", ["weights", "kv_cache"]), ("reset_prefix_cache",), ("generate", 1)]


def test_without_sleep_mode_the_engine_keeps_its_memory(on_cuda, policy, tiny_model_dir):
    log = on_cuda
    engine = VLLMEngine(tiny_model_dir, max_model_len=64, gpu_memory_utilization=0.3)
    log.clear()
    engine.release_memory()
    sync_weights(engine, policy, dtype=torch.bfloat16)
    assert {e[0] for e in log} == {"reload_weights", "reset_encoder_cache", "reset_prefix_cache"}


# ---- refused before vLLM starts ------------------------------------------------------------------------------


def test_a_cuda_engine_needs_the_recipes_gpu_share(on_cuda, tiny_model_dir):
    with pytest.raises(ValueError, match=r"gpu_memory_utilization = None on CUDA: .*rollout.gpu_memory_utilization"):
        VLLMEngine(tiny_model_dir, max_model_len=64)
    assert on_cuda == []  # refused before vLLM


def test_vllm_multiprocessing_is_refused_with_the_reason(monkeypatch, tiny_model_dir):
    import vllm

    started = []
    monkeypatch.setattr(vllm, "LLM", lambda *a, **k: started.append(k))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(ValueError, match=r"VLLM_ENABLE_V1_MULTIPROCESSING = '1': expected 0 .*weight sync"):
        VLLMEngine(tiny_model_dir, max_model_len=64)
    assert started == []
