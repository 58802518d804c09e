"""rollout.adapters: the trainer's LoRA adapter as PEFT saves it, one version per sync."""
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from rollout.adapters import CONFIG_FILE, WEIGHTS_FILE, export_lora_adapter, lora_modules, vllm_lora_rank


def _policy(r=4):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    model = get_peft_model(LlamaForCausalLM(cfg), LoraConfig(r=r, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def test_vllm_rank_is_the_smallest_allowed_one_at_least_r():
    assert [vllm_lora_rank(r) for r in (1, 4, 8, 12, 16, 200, 320, 512)] == [1, 8, 8, 16, 16, 256, 320, 512]
    with pytest.raises(ValueError, match="rank <= 512"):
        vllm_lora_rank(513)


def test_export_holds_every_lora_weight_under_peft_save_names_in_the_asked_dtype(tmp_path):
    model = _policy()
    a = export_lora_adapter(model, version=3, dtype=torch.bfloat16)
    assert a.name == "policy-v3" and a.rank == 4
    assert len(a.tensors) == 2 * 2 * 2  # 2 layers x (q_proj, down_proj) x (A, B)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
    assert a.tensors[key].dtype == torch.bfloat16 and tuple(a.tensors[key].shape) == (32, 4)
    live = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["default"].weight
    assert torch.equal(a.tensors[key], live.detach().to(torch.bfloat16))
    # a copy: the next optimizer step does not reach what the engine loads
    with torch.no_grad():
        live.add_(1.0)
    assert not torch.equal(a.tensors[key], live.detach().to(torch.bfloat16))
    assert a.nbytes == sum(t.numel() * 2 for t in a.tensors.values())
    assert [n for n, _ in lora_modules(model)][0] == "base_model.model.model.layers.0.self_attn.q_proj"


def test_written_adapter_is_what_peft_itself_saves_and_loads_back(tmp_path):
    model = _policy()
    a = export_lora_adapter(model, version=1, dtype=torch.float32)
    out = a.write(tmp_path / "ours")
    model.save_pretrained(tmp_path / "peft")
    ours, theirs = load_file(str(out / WEIGHTS_FILE)), load_file(str(tmp_path / "peft" / WEIGHTS_FILE))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = json.loads((out / CONFIG_FILE).read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and sorted(config["target_modules"]) == ["down_proj", "q_proj"]
    # PEFT loads our files onto a fresh base and computes what the policy computes
    fresh = LlamaForCausalLM(model.base_model.model.config)
    fresh.load_state_dict(model.get_base_model().state_dict(), strict=False)
    with model.disable_adapter():
        base_state = {k: v for k, v in model.get_base_model().state_dict().items() if "lora" not in k}
    fresh.load_state_dict({k.replace(".base_layer", ""): v for k, v in base_state.items()})
    loaded = PeftModel.from_pretrained(fresh, str(out))
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-6)


def test_version_must_be_positive_and_a_model_without_lora_is_refused():
    with pytest.raises(ValueError, match="version"):
        export_lora_adapter(_policy(), version=0, dtype=torch.float32)
    cfg = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="no LoRA layers"):
        export_lora_adapter(LlamaForCausalLM(cfg), version=1, dtype=torch.float32)


def test_the_engine_wraps_a_vision_language_policy_s_layers_by_leaf_name():
    """A vision-language policy's PEFT config holds one regex (the language model's blocks only); the engine's
    lora_target_modules are the adapter's leaf names, as the recipe's targets resolve on the model."""
    from rollout.adapters import adapter_config, lora_leaves
    from rollout.vllm_adapters import lora_options
    from trainer.builtin.zoo_vl import build_vl_model
    from trainer.config.schema import LoraConfig as RecipeLora
    from trainer.models.policy import add_lora

    model, _ = build_vl_model()
    policy = add_lora(model, RecipeLora(r=4, alpha=8))
    regex = adapter_config(policy)["target_modules"]
    assert isinstance(regex, str) and "text_model" in regex
    leaves = lora_leaves(policy)
    assert leaves == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    # the tower's projections share the names q/k/v_proj, and stay without LoRA
    assert not [n for n, _ in lora_modules(policy) if "vision" in n]
    assert lora_options(4, leaves)["lora_target_modules"] == leaves
    with pytest.raises(TypeError, match="expected the adapter's leaf names"):
        lora_options(4, regex)
