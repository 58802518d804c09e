"""Sizes refused before the engine starts (trainer/lifecycle/capacity.py), and the model checks of preflight: a model
directory's config, the LoRA rank against its layers, an encoder refused with one line."""
import json
import math
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from trainer.builtin.resolve import resolve_model_path
from trainer.config import RecipeError
from trainer.lifecycle.capacity import REQUEST_BYTES, Machine, ModelSize, capacity_problems, kv_bytes_per_token
from trainer.lifecycle.preflight import check_lora_targets, check_model_files, check_model_source, load_recipe

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"
GiB = 1024**3
# 2 layers, 4 query heads of dim 16 sharing 2 KV heads: 2 (K, V) x 2 x 2 x 16 = 128 elements per token
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 512}


def cfg_with(*overrides):
    return load_recipe(RECIPE, list(overrides), check_paths=False)


def test_kv_bytes_per_token_from_the_config():
    assert kv_bytes_per_token(LLAMA, 2) == 2 * 2 * 2 * 16 * 2
    assert kv_bytes_per_token({**LLAMA, "head_dim": 8}, 4) == 2 * 2 * 2 * 8 * 4
    assert kv_bytes_per_token({"text_config": LLAMA}, 2) == 256  # a multimodal config's decoder
    # not full attention everywhere, or not said: no estimate
    assert kv_bytes_per_token({**LLAMA, "sliding_window": 128}, 2) is None
    assert kv_bytes_per_token({**LLAMA, "sliding_window": 128, "use_sliding_window": False}, 2) == 256
    assert kv_bytes_per_token({**LLAMA, "kv_lora_rank": 64}, 2) is None
    assert kv_bytes_per_token({"model_type": "x"}, 2) is None


def test_a_group_size_the_memory_cannot_hold_names_the_keys_and_the_limit():
    cfg = cfg_with("algorithm.group_size=100000000")  # x 16 prompts per step
    (p,) = capacity_problems(cfg, "r.yaml", Machine(host_available=16 * GiB, gpu_total=None), None)
    assert p.startswith("r.yaml: algorithm.group_size = 100000000: rollout.prompts_per_step x algorithm.group_size "
                        "= 1600000000 samples per step"), p
    assert "rollout.max_num_seqs = 256" in p and "1.5 TiB" in p and "16.0 GiB" in p
    assert p.endswith(f"expected at most {16 * GiB // REQUEST_BYTES} samples per step")


def test_the_largest_step_that_fits_passes():
    cfg = cfg_with("rollout.prompts_per_step=4", "algorithm.group_size=256")  # 1024 samples: 1 MiB of requests
    assert capacity_problems(cfg, "r", Machine(host_available=1024 * REQUEST_BYTES, gpu_total=None), None) == []
    assert len(capacity_problems(cfg, "r", Machine(host_available=1024 * REQUEST_BYTES - 1, gpu_total=None), None)) == 1


def test_a_kv_cache_too_small_for_one_sequence():
    # the smallest cache validate allows is 16 MiB: a model of 64 layers with 32 KV heads of dim 128 needs
    # 2 x 64 x 32 x 128 x 2 bytes = 1 MiB per token, 88 MiB for 64 + 24 = 88 tokens
    big = {**LLAMA, "num_hidden_layers": 64, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128}
    cfg = cfg_with("rollout.kv_cache_memory_bytes=16777216")
    per_token = 2 * 64 * 32 * 128 * 2
    (p,) = capacity_problems(cfg, "r", Machine(host_available=None, gpu_total=None), ModelSize(1000, big))
    assert p == (f"r: rollout.kv_cache_memory_bytes = 16777216: one sequence of data.max_prompt_tokens + "
                 f"rollout.max_new_tokens = 88 tokens needs 88.0 MiB of KV cache ({per_token} bytes per token in "
                 f"bfloat16), more than the cache holds, so the engine would not start; expected at least "
                 f"{88 * per_token}")


def test_a_kv_cache_and_weights_beyond_the_host_memory():
    cfg = cfg_with("rollout.kv_cache_memory_bytes=4294967296")  # 4 GiB
    size = ModelSize(parameters=GiB // 2, config=LLAMA)  # 1 GiB per bf16 copy: the engine's and the trainer's
    (p,) = capacity_problems(cfg, "r", Machine(host_available=5 * GiB, gpu_total=None), size)
    assert p.startswith("r: rollout.kv_cache_memory_bytes = 4294967296: the KV cache, the engine's weights (1.0 GiB) "
                        "and the trainer's (1.0 GiB: 536870912 parameters in bfloat16) need 6.0 GiB, more than the "
                        "5.0 GiB of memory available"), p
    assert p.endswith(f"expected at most {3 * GiB}")
    assert capacity_problems(cfg, "r", Machine(host_available=6 * GiB, gpu_total=None), size) == []


def test_on_a_gpu_what_vllm_reserves_is_counted_beside_the_trainers_weights():
    # vLLM on CUDA reserves its weights and rollout.kv_cache_memory_bytes (not gpu_memory_utilization of the GPU),
    # all resident during a rollout beside the trainer's weights: 36 GiB + 36 GiB + 16 GiB > 80 GiB
    cfg = cfg_with("rollout.kv_cache_memory_bytes=17179869184")
    size = ModelSize(parameters=18 * GiB, config=LLAMA)
    gpu = Machine(host_available=None, gpu_total=80 * GiB)
    (p,) = capacity_problems(cfg, "r", gpu, size)
    assert p == ("r: rollout.kv_cache_memory_bytes = 17179869184: the engine's weights (36.0 GiB) and KV cache, beside "
                 "the trainer's weights (36.0 GiB), need 88.0 GiB, more than the GPU's 80.0 GiB; expected at most "
                 f"{8 * GiB}"), p
    assert capacity_problems(cfg_with("rollout.kv_cache_memory_bytes=8589934592"), "r", gpu, size) == []
    # FP8 engine weights: 18 GiB, so the 16 GiB cache fits
    assert capacity_problems(cfg, "r", gpu, size, engine_weight_bytes_per_param=1) == []
    # the one-sequence rule holds on a GPU too: the cache is the recipe's there as well
    big = {**LLAMA, "num_hidden_layers": 64, "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128}
    (p,) = capacity_problems(cfg_with("rollout.kv_cache_memory_bytes=16777216"), "r", gpu, ModelSize(1000, big))
    assert p.startswith("r: rollout.kv_cache_memory_bytes = 16777216: one sequence of"), p


def test_on_a_gpu_vllms_start_up_share_must_be_free_beside_the_trainers_weights():
    size = ModelSize(parameters=18 * GiB, config=LLAMA)  # 36 GiB of trainer weights, loaded before the engine
    gpu = Machine(host_available=None, gpu_total=80 * GiB)
    (p,) = capacity_problems(cfg_with("rollout.gpu_memory_utilization=0.6"), "r", gpu, size)
    assert p == ("r: rollout.gpu_memory_utilization = 0.6: vLLM starts only when that share of the GPU (48.0 GiB of "
                 "80.0 GiB) is free, and the trainer's weights (36.0 GiB), loaded first, leave at most 44.0 GiB; "
                 "expected at most 0.550"), p
    assert capacity_problems(cfg_with("rollout.gpu_memory_utilization=0.55"), "r", gpu, size) == []


def test_sleep_mode_needs_host_memory_for_the_engines_weights():
    size = ModelSize(parameters=GiB, config=LLAMA)  # 2 GiB in bf16
    gpu = Machine(host_available=GiB, gpu_total=80 * GiB)
    (p,) = capacity_problems(cfg_with(), "r", gpu, size)
    assert p == ("r: rollout.sleep_mode = true: the sleeping engine keeps its weights (2.0 GiB) in host memory during "
                 "every update, more than the 1.0 GiB available; expected false (the engine then keeps its GPU memory "
                 "through the update)"), p
    assert capacity_problems(cfg_with("rollout.sleep_mode=false"), "r", gpu, size) == []
    assert capacity_problems(cfg_with(), "r", Machine(host_available=3 * GiB, gpu_total=80 * GiB), size) == []


def test_the_gpu_share_is_checked_on_this_ranks_gpu(monkeypatch):
    """A fake host of 4 GPUs of different sizes: the share is of the GPU this rank runs on (LOCAL_RANK under a
    launcher, else the current device), not of GPU 0; a rank with no visible GPU of its own is refused by name."""
    import torch

    from trainer.lifecycle.preflight import check_capacity

    totals = [80 * GiB, 80 * GiB, 24 * GiB, 80 * GiB]
    current = {"index": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(totals))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["index"])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("Props", (), {"total_memory": totals[i]}))
    cfg = cfg_with("rollout.gpu_memory_utilization=0.3", "rollout.kv_cache_memory_bytes=268435456")
    size = ModelSize(parameters=6 * GiB, config=LLAMA)  # 12 GiB in bf16, twice (engine + trainer): fits 80 GiB, not 24
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    check_capacity(cfg, "r", size)
    current["index"] = 2  # one process, on GPU 2
    with pytest.raises(RecipeError, match=r"more than the GPU's 24.0 GiB"):
        check_capacity(cfg, "r", size)
    current["index"] = 0  # a launched rank before its device is set
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RecipeError, match=r"more than the GPU's 24.0 GiB"):
        check_capacity(cfg, "r", size)
    monkeypatch.setenv("LOCAL_RANK", "1")
    check_capacity(cfg, "r", size)
    monkeypatch.setenv("LOCAL_RANK", "4")  # a fifth process on a machine of 4 GPUs
    with pytest.raises(RecipeError, match=r"^r: LOCAL_RANK = 4: this process sees 4 GPU\(s\), so it has no GPU 4"):
        check_capacity(cfg, "r", size)


def test_the_hf_engine_and_a_server_have_no_kv_cache_to_check():
    size = ModelSize(parameters=100 * GiB, config=LLAMA)
    for engine in (["rollout.engine=hf"], ["rollout.mode=server"]):
        assert capacity_problems(cfg_with(*engine), "r", Machine(GiB, None), size) == []


def model_dir(tmp_path, conf=LLAMA) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(conf))
    return d


def test_lora_rank_up_to_the_smallest_adapted_dimension(tmp_path):
    d = model_dir(tmp_path)
    # the smallest adapted layer: k_proj / v_proj, 2 KV heads x 16 = 32 outputs from 64 inputs
    check_lora_targets(cfg_with(f"model.path={d}", "model.lora.r=32"), "r")
    with pytest.raises(RecipeError) as e:
        check_lora_targets(cfg_with(f"model.path={d}", "model.lora.r=33"), "r")
    assert str(e.value).startswith("r: model.lora.r = 33: expected at most 32, the smallest dimension of the layers it "
                                   "adapts (model.layers.0.self_attn.k_proj: 32 x 64")
    # only the layers adapted count: q_proj alone is 64 x 64
    check_lora_targets(cfg_with(f"model.path={d}", "model.lora.r=64", "model.lora.target_modules=[q_proj]"), "r")


def test_an_encoder_is_refused_from_its_config(tmp_path):
    d = model_dir(tmp_path, {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 32,
                             "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64,
                             "vocab_size": 100})
    with pytest.raises(RecipeError) as e:
        check_model_source(cfg_with(f"model.path={d}"), "r")
    assert str(e.value) == (f"r: model.path = '{d}': config.json: architectures ['BertForMaskedLM']: not a causal "
                            "language model (expected a decoder-only *ForCausalLM checkpoint, such as LlamaForCausalLM)")


def test_an_encoder_without_architectures_is_refused_by_its_layers(tmp_path, capsys):
    d = model_dir(tmp_path, {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 1,
                             "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 100})
    with pytest.raises(RecipeError) as e:
        check_lora_targets(cfg_with(f"model.path={d}"), "r")
    assert str(e.value).startswith(f"r: model.path = '{d}': BertLMHeadModel: no decoder layers at .bert.layers")
    assert capsys.readouterr().err == ""  # Transformers' build notes are not printed around the one line


def test_a_model_directory_is_read_from_its_headers(tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(resolve_model_path("builtin:tiny-base"), d)
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:  # safetensors' own reader, as reference
        elements = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    size = check_model_files(cfg_with(f"model.path={d}"), "r")
    assert size.parameters == elements and size.config["model_type"] == "llama"
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])
    with pytest.raises(RecipeError, match=rf"^r: model.path = '{d}': model.safetensors is truncated: .* the file "
                                          r"holds \d+$"):
        check_model_files(cfg_with(f"model.path={d}"), "r")
