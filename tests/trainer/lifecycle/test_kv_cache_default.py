"""The colocated engine's KV cache when the recipe does not size it (``rollout.kv_cache_memory_bytes: null``): 256 MiB
on CPU, and on CUDA what vLLM's start-up profile leaves in the engine's share (no fixed 256 MiB: ~4.7k tokens of a 7B
model); the capacity check's bounds for both, and vLLM's own cache config taking what the engine passes."""
from pathlib import Path

import pytest
from vllm.config import CacheConfig

from rollout.vllm_engine import DEFAULT_CPU_KV_CACHE_BYTES, memory_options
from trainer.config import RecipeError, RolloutConfig
from trainer.lifecycle.capacity import Machine, ModelSize, capacity_problems
from trainer.lifecycle.preflight import load_recipe

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "grpo_tiny.yaml"
GiB = 1024**3
# Qwen2.5-7B: 28 layers, 4 KV heads of dim 128: 2 x 28 x 4 x 128 x 2 bytes = 56 KiB per token in bf16
QWEN7B = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
          "num_key_value_heads": 4, "vocab_size": 152064}
SEVEN_B = ModelSize(parameters=7_615_616_512, config=QWEN7B)


def cfg_with(*sets):
    return load_recipe(RECIPE, list(sets), check_paths=False)


def test_no_size_in_the_recipe_is_vllms_sizing_on_cuda_and_256_mib_on_cpu():
    assert RolloutConfig().kv_cache_memory_bytes is None
    cuda = memory_options(True, None, 0.3)
    assert cuda == {"gpu_memory_utilization": 0.3}  # was {"kv_cache_memory_bytes": 256 MiB, ...}
    assert memory_options(False, None, None) == {"kv_cache_memory_bytes": DEFAULT_CPU_KV_CACHE_BYTES}
    assert DEFAULT_CPU_KV_CACHE_BYTES == 256 * 2**20
    # vLLM's own cache config takes it: no size, the share it profiles (gpu_worker.determine_available_memory)
    assert CacheConfig(**cuda).kv_cache_memory_bytes is None
    assert memory_options(True, 4 * GiB, 0.3)["kv_cache_memory_bytes"] == 4 * GiB  # a recipe's size stays exact


def test_a_size_in_the_recipe_is_still_checked():
    with pytest.raises(RecipeError, match=r"rollout.kv_cache_memory_bytes.*null \(CPU: 256 MiB; CUDA: sized by vLLM"):
        cfg_with("rollout.kv_cache_memory_bytes=1024")
    assert cfg_with("rollout.kv_cache_memory_bytes=null").rollout.kv_cache_memory_bytes is None


def test_a_7b_model_on_an_80_gib_gpu_fits_without_a_size():
    gpu = Machine(host_available=512 * GiB, gpu_total=80 * GiB)
    assert capacity_problems(cfg_with(), "r", gpu, SEVEN_B) == []


def test_on_cuda_one_sequence_must_fit_in_what_the_share_leaves():
    # 14.2 GiB of weights; a share of 0.18 of 80 GiB (14.4 GiB) leaves ~0.2 GiB: 3.6k tokens of 56 KiB at the most
    gpu = Machine(host_available=512 * GiB, gpu_total=80 * GiB)
    long = cfg_with("rollout.gpu_memory_utilization=0.18", "data.max_prompt_tokens=4096", "rollout.max_new_tokens=4096")
    (p,) = capacity_problems(long, "r", gpu, SEVEN_B)
    assert p.startswith("r: rollout.gpu_memory_utilization = 0.18: with rollout.kv_cache_memory_bytes null vLLM gives "
                        "the KV cache what that share of the GPU leaves after the engine's weights (14.2 GiB)"), p
    assert p.endswith("expected a share of at least 0.183"), p
    assert capacity_problems(cfg_with("rollout.gpu_memory_utilization=0.18"), "r", gpu, SEVEN_B) == []


def test_on_cpu_no_size_counts_the_engines_256_mib():
    small = ModelSize(parameters=1000, config={"model_type": "llama"})
    weights = 2 * 2000  # the engine's and the trainer's, 2 bytes each
    fits = Machine(host_available=DEFAULT_CPU_KV_CACHE_BYTES + weights, gpu_total=None)
    assert capacity_problems(cfg_with(), "r", fits, small) == []
    (p,) = capacity_problems(cfg_with(), "r", Machine(host_available=fits.host_available - 1, gpu_total=None), small)
    assert p.startswith(f"r: rollout.kv_cache_memory_bytes = {DEFAULT_CPU_KV_CACHE_BYTES}: the KV cache"), p
