"""rollout.lora_sync resolved (trainer.precision.lora_sync): adapter wherever the engine can serve it, merged where
the recipe needs the effective weight, the reason said once, an explicit adapter there refused before loading."""
from types import SimpleNamespace

import pytest
import torch

from trainer.config import RecipeError
from trainer.lifecycle.preflight import load_recipe
from trainer.precision.lora_sync import engine_lora_sync, lora_sync_mode, merged_reasons


def cfg_with(*sets):
    return load_recipe("recipes/grpo_tiny.yaml", list(sets), check_paths=False)


def test_auto_serves_the_adapter_in_bf16_and_merges_for_the_fp8_recipes_and_exact_mode():
    assert lora_sync_mode(cfg_with()) == ("adapter", None)
    assert lora_sync_mode(cfg_with("rollout.engine=hf")) == ("adapter", None)
    for recipe, word in (("fp8_rollout", "quantizes the effective weight"), ("fp8_unified", "quantizes the effective"),
                         ("exact", "engine's own weights")):
        sets = [f"precision.recipe={recipe}"] + (["model.dtype=float32"] if recipe == "exact" else [])
        mode, why = lora_sync_mode(cfg_with(*sets))
        assert mode == "merged" and f"precision.recipe {recipe}" in why and word in why
    assert lora_sync_mode(cfg_with("rollout.lora_sync=merged")) == ("merged", None)


def test_an_explicit_adapter_where_it_cannot_be_served_is_refused_at_load_naming_key_reason_and_fallback():
    with pytest.raises(RecipeError) as e:
        cfg_with("precision.recipe=fp8_rollout", "rollout.lora_sync=adapter")
    msg = str(e.value)
    assert "rollout.lora_sync = 'adapter'" in msg and "'merged'" in msg and "quantizes the effective weight" in msg
    cfg = cfg_with("rollout.lora_sync=adapter")  # bf16: loads
    assert lora_sync_mode(cfg) == ("adapter", None)


def test_embedding_targets_and_ranks_above_vllms_limit_take_the_merged_weights():
    cfg = cfg_with()
    cfg.model.lora.target_modules = ["q_proj", "embed_tokens"]
    assert merged_reasons(cfg) == ["model.lora.target_modules ['embed_tokens']: the engine serves adapters of "
                                   "linear layers only"]
    cfg = cfg_with()
    cfg.model.lora.r = 1024
    assert lora_sync_mode(cfg)[0] == "merged" and "rank <= 512" in lora_sync_mode(cfg)[1]
    cfg.rollout.lora_sync = "adapter"
    with pytest.raises(RecipeError, match="rank <= 512"):
        lora_sync_mode(cfg)


def test_an_engine_started_without_lora_takes_merged_weights_or_refuses_an_explicit_adapter():
    plain, served = SimpleNamespace(adapter_dtype=None), SimpleNamespace(adapter_dtype=torch.bfloat16)
    assert engine_lora_sync(cfg_with(), served) == ("adapter", None)
    mode, why = engine_lora_sync(cfg_with(), plain)
    assert mode == "merged" and "started without LoRA support" in why
    with pytest.raises(RecipeError, match="rollout.lora_sync = 'adapter': the engine .* without LoRA support"):
        engine_lora_sync(cfg_with("rollout.lora_sync=adapter"), plain)


def test_a_mixture_of_experts_model_on_a_cpu_vllm_takes_the_merged_weights(monkeypatch):
    """vLLM 0.32 runs every MoE layer on its Triton kernel once LoRA is enabled (fused_moe/oracle/unquantized.py),
    which its CPU backend lacks: a colocated engine or `parityrl serve` on CPU serves such a model merged weights;
    on CUDA (faked here) and with the HF engine (PEFT) the adapter."""
    from trainer.builtin.zoo import ensure_arch_model

    moe = str(ensure_arch_model("qwen3_moe", dtype="bfloat16"))
    mode, why = lora_sync_mode(cfg_with(f"model.path={moe}"))
    assert mode == "merged" and f"model.path {moe}: a mixture-of-experts model on a CPU vLLM" in why
    with pytest.raises(RecipeError, match="rollout.lora_sync = 'adapter': .*mixture-of-experts model on a CPU vLLM"):
        cfg_with(f"model.path={moe}", "rollout.lora_sync=adapter")
    assert lora_sync_mode(cfg_with(f"model.path={moe}", "rollout.engine=hf")) == ("adapter", None)
    assert lora_sync_mode(cfg_with(f"model.path={ensure_arch_model('qwen2', dtype='bfloat16')}")) == ("adapter", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert lora_sync_mode(cfg_with(f"model.path={moe}")) == ("adapter", None)
