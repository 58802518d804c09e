"""parity.routing_replay: what each setting means for a model and a rollout mode (trainer/models/routing_mode.py),
and its refusals before anything loads (the recipe's preflight)."""
import pytest
import transformers
import yaml

from rollout.engine_forward import check_supported
from rollout.moe_config import moe_shape
from trainer.builtin.zoo import ensure_arch_model
from trainer.config import RecipeError
from trainer.lifecycle.preflight import check_before_loading
from trainer.models.routing_mode import routing_mode

SMALL = dict(num_hidden_layers=4, hidden_size=32, num_attention_heads=2)
QWEN2_MOE = transformers.Qwen2MoeConfig(**SMALL, num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2,
                                        mlp_only_layers=[3])
DENSE = transformers.Qwen2Config(**SMALL)
OTHER_MOE = transformers.DeepseekV3Config(**SMALL, n_routed_experts=8)


def test_the_moe_shape_of_a_config_follows_its_familys_rule():
    shape = moe_shape(QWEN2_MOE)  # every 2nd layer routes (1, 3), but 3 is an MLP-only layer
    assert shape.layers == (1,) and shape.num_experts == 8 and shape.top_k == 2
    assert moe_shape(transformers.MixtralConfig(**SMALL, num_local_experts=4)).layers == (0, 1, 2, 3)
    assert moe_shape(DENSE) is None and moe_shape(OTHER_MOE) is None


@pytest.mark.parametrize("setting,config,expected", [
    ("auto", QWEN2_MOE, "replay"), (True, QWEN2_MOE, "replay"), ("measure", QWEN2_MOE, "measure"),
    (False, QWEN2_MOE, "off"), ("auto", DENSE, "off"), ("auto", OTHER_MOE, "off"), ("off", DENSE, "off"),
])
def test_each_setting_resolves(setting, config, expected):
    assert routing_mode(setting, config, where="r.yaml") == expected


@pytest.mark.parametrize("setting,config,says", [
    ("on", DENSE, r"r.yaml: parity.routing_replay = 'on': the model \(qwen2\) is a dense model"),
    ("measure", OTHER_MOE, r"\(deepseek_v3\) is a mixture-of-experts family replay does not support "
                           r"\(supported: \['mixtral', 'olmoe', 'qwen2_moe', 'qwen3_moe'\]\)"),
    ("sometimes", QWEN2_MOE, r"expected one of \['auto', 'on', 'off', 'measure'\]"),
])
def test_a_setting_that_cannot_hold_is_refused_with_the_reason(setting, config, says):
    with pytest.raises(ValueError, match=says):
        routing_mode(setting, config, where="r.yaml")


def test_the_preflight_refuses_replay_on_a_dense_model_before_anything_loads(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "r", "model": {"path": str(ensure_arch_model("qwen2")),
                                                           "dtype": "float32"},
                                    "data": {"source": "builtin:arithmetic"},
                                    "logging": {"run_dir": str(tmp_path / "run")}})
                    + "parity:\n  routing_replay: on\n")  # YAML's bare on: true
    with pytest.raises(RecipeError, match=r"parity.routing_replay = 'on': the model \(qwen2\) is a dense model"):
        check_before_loading(path)


def test_exact_mode_refuses_a_mixture_of_experts_model_with_the_reason():
    with pytest.raises(ValueError, match="exact mode does not re-implement vLLM's fused MoE kernel"):
        check_supported(QWEN2_MOE)
