"""An update for vLLM's block-FP8 layers (the CUDA FP8 recipes' engine) must carry each targeted weight as FP8 values
with its scale (issue 57 item 3): ``VLLMEngine`` refuses anything else before vLLM's reload, which would cast a float
weight into the FP8 parameter unscaled and process the layer with a scale it never loaded (shown on vLLM's own layers
in tests/doctor/test_weight_sync_fp8.py)."""
import pytest
import torch

from rollout.fp8_weights import check_block_fp8_update, fp8_block_weights, is_fp8_layer, is_fp8_target
from rollout.vllm_engine import VLLMEngine
from rollout.weight_updates import DEFAULT_PACKED_MODULES

O_PROJ = "model.layers.0.self_attn.o_proj.weight"
FLOAT = [(O_PROJ, torch.randn(256, 256, dtype=torch.bfloat16)), ("model.norm.weight", torch.ones(256)),
         ("lm_head.weight", torch.randn(300, 256, dtype=torch.bfloat16))]


def test_the_block_fp8_form_passes_and_floats_outside_the_targets_too():
    update = list(fp8_block_weights(FLOAT))
    assert [n for n, _ in update] == [O_PROJ, O_PROJ.replace("weight", "weight_scale_inv"), "model.norm.weight",
                                      "lm_head.weight"]
    check_block_fp8_update(update)


@pytest.mark.parametrize("update, said", [
    (FLOAT, f"{O_PROJ} is torch.bfloat16"),
    (lambda u: [x for x in u if not x[0].endswith("weight_scale_inv")], f"{O_PROJ} comes without its weight_scale_inv"),
    (lambda u: [x for x in u if x[0] != O_PROJ], "o_proj.weight_scale_inv comes without its weight"),
])
def test_a_float_weight_or_a_lone_half_is_refused_naming_it(update, said):
    update = update(list(fp8_block_weights(FLOAT))) if callable(update) else update
    with pytest.raises(ValueError, match="an update for vLLM's block-FP8 layers: .*" + said.replace(".", r"\.")):
        check_block_fp8_update(update)


def test_the_engine_checks_an_update_of_its_block_fp8_layers():
    engine = VLLMEngine.__new__(VLLMEngine)
    engine._shapes, engine.model, engine.packed_modules = None, "m", DEFAULT_PACKED_MODULES
    engine.fp8_block_weights = False  # BF16 layers, or the CPU emulation: float weights are what they take
    engine._check_update(FLOAT)
    engine.fp8_block_weights = True
    with pytest.raises(ValueError, match="would cast a float weight unscaled"):
        engine._check_update(FLOAT)
    engine._check_update(list(fp8_block_weights(FLOAT)))


def test_a_vision_tower_stays_out_of_fp8_on_both_names():
    """The tiny Idefics3's encoder blocks are "layers" with q/k/v_proj leaves; FP8 takes the language model's only."""
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    assert is_fp8_layer("model.text_model.layers.0.self_attn.qkv_proj", packed)
    assert not is_fp8_layer("model.vision_model.encoder.layers.0.self_attn.qkv_proj", packed)
    assert is_fp8_target("model.text_model.layers.1.mlp.down_proj.weight")
    for name in ("model.vision_model.encoder.layers.1.self_attn.q_proj.weight", "visual.layers.0.attn.q_proj.weight",
                 "model.vision_tower.layers.0.self_attn.v_proj.weight"):
        assert not is_fp8_target(name), name
