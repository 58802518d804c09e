"""rollout.weight_export: merged LoRA weights equal PEFT's own merge, under base names, without side effects."""
import copy

import pytest
import torch
from torch import nn

from rollout.weight_export import (
    full_weights,
    iter_merged_lora_weights,
    merged_lora_weights,
    payload_bytes,
)

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _tiny_llama(dtype=torch.bfloat16):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).to(dtype)


def _randomise_lora(model, seed=1):
    """PEFT initialises B = 0 (delta = 0); give every adapter weight a non-zero value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _lora_llama(target=("q_proj", "v_proj", "down_proj"), modules_to_save=None):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(target), modules_to_save=modules_to_save,
                          lora_dropout=0.1)
    model = peft.get_peft_model(_tiny_llama(), cfg)
    _randomise_lora(model)
    return model


def _float32_merge(peft_model):
    """Reference: PEFT's own merge of a float32 copy (the trainer's model is untouched)."""
    ref = copy.deepcopy(peft_model).to(torch.float32)
    return ref.merge_and_unload().state_dict()


def test_hand_computed_single_linear():
    # W = [[1, 2], [3, 4]], A = [[1, 0]] (r=1, in=2), B = [[1], [2]] (out=2, r=1), alpha=2, r=1 -> scaling 2.
    # B @ A = [[1, 0], [2, 0]]; W + 2 * B@A = [[3, 2], [7, 4]].
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2, bias=False)

    net = Net()
    with torch.no_grad():
        net.proj.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    model = peft.get_peft_model(net, peft.LoraConfig(r=1, lora_alpha=2, target_modules=["proj"]))
    with torch.no_grad():
        model.base_model.model.proj.lora_A["default"].weight.copy_(torch.tensor([[1.0, 0.0]]))
        model.base_model.model.proj.lora_B["default"].weight.copy_(torch.tensor([[1.0], [2.0]]))
    (name, w), = merged_lora_weights(model, dtype=torch.float32, fused_groups=())
    assert name == "proj.weight"
    assert torch.equal(w, torch.tensor([[3.0, 2.0], [7.0, 4.0]]))


def test_matches_merge_and_unload_and_rounds_once():
    model = _lora_llama()
    ref = _float32_merge(model)
    exported32 = dict(merged_lora_weights(model, dtype=torch.float32))
    exported16 = dict(merged_lora_weights(model, dtype=torch.bfloat16))
    for name, w in exported32.items():
        # Same float32 operations as PEFT's merge: bitwise equal.
        assert torch.equal(w, ref[name]), name
        # BF16 export = the float32 merge rounded once (not base rounded, then delta added in BF16).
        assert exported16[name].dtype == torch.bfloat16
        assert torch.equal(exported16[name], ref[name].to(torch.bfloat16)), name
    # The delta is real: q_proj moved away from its base weight.
    base_q = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.float()
    assert (exported32["model.layers.0.self_attn.q_proj.weight"] - base_q).abs().max() > 0.1


def test_names_are_base_names_and_only_changed_modules_plus_fused_siblings():
    model = _lora_llama(target=("q_proj", "v_proj", "down_proj"), modules_to_save=["lm_head"])
    names = [n for n, _ in merged_lora_weights(model)]
    base_keys = set(_tiny_llama().state_dict())
    assert set(names) <= base_keys
    expected = []
    for i in range(2):
        # k_proj is not targeted but is sent: vLLM rebuilds the fused qkv_proj from all three shards.
        expected += [f"model.layers.{i}.self_attn.{x}_proj.weight" for x in "qkv"]
        expected += [f"model.layers.{i}.mlp.down_proj.weight"]  # not fused with anything
    expected += ["lm_head.weight"]
    assert names == expected  # model order, fused group members adjacent
    # Without fused groups: strictly the LoRA-targeted modules (+ modules_to_save).
    names_nofuse = {n for n, _ in merged_lora_weights(model, fused_groups=())}
    assert names_nofuse == set(expected) - {f"model.layers.{i}.self_attn.k_proj.weight" for i in range(2)}


def test_fused_sibling_and_modules_to_save_values():
    model = _lora_llama(target=("q_proj",), modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    out = dict(merged_lora_weights(model, dtype=torch.float32))
    root = model.get_base_model()
    k = root.model.layers[1].self_attn.k_proj.weight
    assert torch.equal(out["model.layers.1.self_attn.k_proj.weight"], k.float())
    # The trained copy, not the frozen original.
    assert torch.equal(out["lm_head.weight"], root.lm_head.modules_to_save["default"].weight.float())
    assert not torch.equal(out["lm_head.weight"], root.lm_head.original_module.weight.float())


def test_peft_model_is_unchanged_bitwise():
    model = _lora_llama(modules_to_save=["lm_head"])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    merged_lora_weights(model)
    merged_lora_weights(model, dtype=torch.float32)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert not any(getattr(m, "merged", False) for m in model.modules())


def test_fan_in_fan_out_gpt2_conv1d():
    # GPT-2's Conv1D stores weights as [in, out]: PEFT needs fan_in_fan_out=True and transposes the delta.
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=4)
    base = transformers.GPT2LMHeadModel(cfg)
    model = peft.get_peft_model(base, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"],
                                                      fan_in_fan_out=True))
    _randomise_lora(model)
    ref = _float32_merge(model)
    out = merged_lora_weights(model, dtype=torch.float32)
    assert [n for n, _ in out] == ["transformer.h.0.attn.c_attn.weight"]
    assert out[0][1].shape == (32, 96)  # [in, out]
    assert torch.equal(out[0][1], ref["transformer.h.0.attn.c_attn.weight"])


def test_embedding_lora():
    model = peft.get_peft_model(_tiny_llama(), peft.LoraConfig(r=2, lora_alpha=2, target_modules=["embed_tokens"]))
    _randomise_lora(model)
    ref = _float32_merge(model)
    (name, w), = merged_lora_weights(model, dtype=torch.float32)
    assert name == "model.embed_tokens.weight" and w.shape == (64, 32)
    assert torch.equal(w, ref[name])


def test_active_adapter_only_and_disabled_adapters():
    model = _lora_llama(target=("q_proj",))
    model.add_adapter("second", peft.LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj"]))
    _randomise_lora(model, seed=7)
    q = "model.layers.0.self_attn.q_proj.weight"
    model.set_adapter("second")
    got = dict(merged_lora_weights(model, dtype=torch.float32, fused_groups=()))[q]
    ref = _float32_merge(model)[q]  # merge_and_unload merges the active adapter
    assert torch.equal(got, ref)
    # The default adapter would give a different weight, so the choice above mattered.
    model.set_adapter("default")
    assert not torch.equal(dict(merged_lora_weights(model, dtype=torch.float32, fused_groups=()))[q], got)
    with model.disable_adapter():
        base = dict(merged_lora_weights(model, dtype=torch.float32, fused_groups=()))[q]
    assert torch.equal(base, model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight.float())


def test_gather_called_once_per_exported_module():
    model = _lora_llama(target=("q_proj",))
    seen = []

    class Recorder:
        def __init__(self, params):
            seen.append(len(params))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    out = list(iter_merged_lora_weights(model, gather=Recorder))
    assert len(out) == 6 and len(seen) == 6  # q, k, v in each of 2 layers
    # q_proj (LoRA) gathers its base weight + lora_A + lora_B; k/v only their weight.
    assert seen[:3] == [3, 1, 1]


def test_full_weights_and_refusals():
    model = _tiny_llama()
    out = full_weights(model, dtype=torch.float32)
    assert [n for n, _ in out] == [n for n, _ in model.named_parameters()]
    assert all(t.dtype == torch.float32 for _, t in out)
    with pytest.raises(TypeError, match="merged_lora_weights"):
        full_weights(_lora_llama())
    with pytest.raises(TypeError, match="peft_model"):
        merged_lora_weights(model)
    with pytest.raises(TypeError, match="dtype"):
        merged_lora_weights(_lora_llama(), dtype="bf16")


def test_payload_bytes():
    # 2x3 bf16 = 6 * 2 bytes = 12; 4 float32 = 4 * 4 = 16; total 28.
    named = [("a", torch.zeros(2, 3, dtype=torch.bfloat16)), ("b", torch.zeros(4))]
    assert payload_bytes(named) == 28
    assert payload_bytes([]) == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_fused_experts_are_exported_as_the_checkpoint_holds_them(arch):
    """Transformers 5 fuses each layer's routed experts into mlp.experts.gate_up_proj / down_proj (and renames
    Mixtral's block_sparse_moe): what an engine loads are the checkpoint's per-expert tensors, so the export must
    give exactly the checkpoint's names and values, whether the model came from the checkpoint or from a config."""
    from safetensors.torch import load_file

    from rollout.model_files import checkpoint_shapes
    from rollout.weight_updates import DEFAULT_PACKED_MODULES, check_update
    from trainer.builtin.zoo import ensure_arch_model

    model_dir = ensure_arch_model(arch)
    saved = {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters())  # fused in memory
    built = transformers.AutoModelForCausalLM.from_config(model.config).to(torch.float32)  # no conversion record
    built.load_state_dict(model.state_dict())
    for exported in (full_weights(model, dtype=torch.float32), full_weights(built, dtype=torch.float32)):
        assert sorted(n for n, _ in exported) == sorted(saved)
        assert all(torch.equal(t, saved[n]) for n, t in exported)
    check_update(exported, checkpoint_shapes(model_dir), str(model_dir), DEFAULT_PACKED_MODULES)

    # a LoRA policy's merged sync (attention and any dense MLP; routed experts are not Linear layers) is named as
    # the checkpoint is, and leaves the experts alone
    policy = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"]))
    _randomise_lora(policy)
    merged = merged_lora_weights(policy, dtype=torch.float32)
    assert merged and all(n in saved and ".experts." not in n for n, _ in merged)
