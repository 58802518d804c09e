"""``model.attn_implementation``: the rules (trainer/models/attention.py), the load, the recipe-level refusals."""
from pathlib import Path

import pytest
import torch

from trainer.config.schema import RecipeError
from trainer.config.supervised import read_rm_recipe
from trainer.lifecycle.preflight import load_recipe
from trainer.models import attention
from trainer.models.attention import resolve_attn_implementation
from trainer.models.policy import load_base_model

REPO = Path(__file__).resolve().parents[3]


def llama():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)


def gemma2():
    from transformers import Gemma2Config

    return Gemma2Config(attn_logit_softcapping=50.0)


def test_null_is_what_the_architecture_needs_else_the_default():
    assert resolve_attn_implementation(llama(), None, dtype="bfloat16", device="cpu") is None
    assert resolve_attn_implementation(gemma2(), None, dtype="bfloat16", device="cpu") == "eager"


@pytest.mark.parametrize("choice", ["sdpa", "eager"])
def test_sdpa_and_eager_are_taken_as_asked(choice):
    assert resolve_attn_implementation(llama(), choice, dtype="float32", device="cpu") == choice


@pytest.mark.parametrize("choice", ["sdpa", "flash_attention_2"])
def test_an_architecture_that_needs_eager_refuses_the_others(choice, monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    with pytest.raises(RecipeError, match=f"model.attn_implementation = '{choice}': expected null or 'eager' for "
                                          "Gemma2: its attention logit softcap"):
        resolve_attn_implementation(gemma2(), choice, dtype="bfloat16", device="cuda")
    assert resolve_attn_implementation(gemma2(), "eager", dtype="bfloat16", device="cuda") == "eager"


def test_flash_attention_needs_the_package_cuda_and_a_16_bit_dtype(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    with pytest.raises(RecipeError, match="the flash_attn package is not importable"):
        resolve_attn_implementation(llama(), "flash_attention_2", dtype="bfloat16", device="cuda")
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    with pytest.raises(RecipeError, match="the model trains on cpu, FlashAttention-2 runs on CUDA only"):
        resolve_attn_implementation(llama(), "flash_attention_2", dtype="bfloat16", device=torch.device("cpu"))
    with pytest.raises(RecipeError, match="model.dtype = 'float32': FlashAttention-2 runs float16/bfloat16 only"):
        resolve_attn_implementation(llama(), "flash_attention_2", dtype="float32", device="cuda:0")
    assert resolve_attn_implementation(llama(), "flash_attention_2", dtype="bfloat16", device="cuda:0") == \
        "flash_attention_2"


def test_the_load_uses_the_choice_and_refuses_before_loading_weights(tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(llama()).save_pretrained(tmp_path)
    assert load_base_model(str(tmp_path), "float32").config._attn_implementation == "sdpa"
    assert load_base_model(str(tmp_path), "float32", attn_implementation="eager").config._attn_implementation == "eager"
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    # SFT loads on the CPU and trains where the Trainer puts it: the rule reads the training device
    with pytest.raises(RecipeError, match="trains on cpu"):
        load_base_model(str(tmp_path), "bfloat16", "cpu", "flash_attention_2", train_device="cpu")


def test_recipes_refuse_an_unknown_value_and_train_rm_any_value():
    with pytest.raises(RecipeError, match="model.attn_implementation"):
        load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["model.attn_implementation=flash"])
    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["model.attn_implementation=eager"])
    assert cfg.model.attn_implementation == "eager"
    with pytest.raises(RecipeError, match="model.attn_implementation = 'sdpa': expected null"):
        read_rm_recipe(REPO / "recipes" / "rm_tiny.yaml", ["model.attn_implementation=sdpa"])
