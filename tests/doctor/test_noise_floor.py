"""The model's own noise floor (trainer.diagnostics.noise_floor), without an engine: the band arithmetic by hand, the floor
measured on random zoo Qwen3s (std-0.2 weights, as the zoo builds them) growing with depth, the doctor's model left as
it was, and a float32 model's floor against float64 at float32's rounding."""
import pytest
import torch

from trainer.builtin.zoo import build_arch_model
from trainer.diagnostics.noise_floor import FACTOR, UNIT_ROUNDOFF, bands, measure, wide_copy
from trainer.doctor.checks.layers import first_divergence, points, trainer_states, with_bands

SEQS = [[1, 40, 77, 301, 9, 12, 250, 33, 4, 5, 6, 7], [1, 3, 9, 500, 4, 66, 71, 80]]


def _qwen3(layers: int, dtype: torch.dtype):
    model, _ = build_arch_model("qwen3", overrides={"num_hidden_layers": layers})
    return model.to(dtype).eval()


def test_bands_are_the_factor_over_the_floor_and_never_below_one_rounding():
    floor = {"embedding": 0.0, "layer 0, mlp": 1e-2, "logits": 1e-3}
    got = bands(floor, "bfloat16")
    assert got == {"embedding": FACTOR * 2.0 ** -8, "layer 0, mlp": FACTOR * 1e-2, "logits": FACTOR * 2.0 ** -8}
    assert bands({"x": 0.0}, "float32") == {"x": FACTOR * 2.0 ** -24}
    assert UNIT_ROUNDOFF["float16"] == 2.0 ** -11


def test_first_divergence_reads_each_points_own_band():
    rows = [{"point": "a", "kind": "mlp", "rel_error": 5e-3}, {"point": "b", "kind": "mlp", "rel_error": 5e-2},
            {"point": "c", "kind": "mlp", "rel_error": 5e-1}]
    deep = with_bands(rows, {"a": 1e-3, "b": 2e-2, "c": 1e-2}, "bfloat16")  # bands 1.56e-2, 8e-2, 4e-2
    assert [r["band"] for r in deep] == [FACTOR * 2.0 ** -8, FACTOR * 2e-2, FACTOR * 1e-2]
    assert first_divergence(deep)["point"] == "c"
    # the same error at b is a divergence where the model's floor there is lower
    assert first_divergence(with_bands(rows, {"a": 1e-3, "b": 1e-3, "c": 1e-2}, "bfloat16"))["point"] == "b"


def test_the_floor_grows_with_depth_and_leaves_the_model_as_it_was():
    model = _qwen3(48, torch.bfloat16)
    names = [p.name for p in points(48, transformed=False)]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    floor = measure(model, "bfloat16", SEQS, names, trainer_states)
    assert floor["embedding"] == 0.0  # the same bf16 weights cast up: the lookup rounds nothing
    assert all(floor[n] > 0 for n in names[1:])
    early = max(floor[f"layer {i}, output"] for i in range(4))
    late = max(floor[f"layer {i}, output"] for i in range(40, 48))
    print(f"48-layer qwen3 bf16 floor: layers 0-3 {early:.3g}, 40-47 {late:.3g}, logits {floor['logits']:.3g}")
    assert late > 2 * early  # rounding carried and amplified through the layers
    assert floor["logits"] > 2.0 ** -8
    assert next(model.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_float32_models_floor_is_float32_rounding():
    model = _qwen3(2, torch.float32)
    names = [p.name for p in points(2, transformed=False)]
    floor = measure(model, "float32", SEQS, names, trainer_states)
    assert next(wide_copy(model, "float32").parameters()).dtype == torch.float64
    assert 0 < max(floor.values()) < 1e-5, floor


def test_a_dtype_without_a_wider_one_is_refused():
    with pytest.raises(ValueError, match="model.dtype 'int8': the noise floor is measured for bfloat16"):
        wide_copy(torch.nn.Linear(2, 2), "int8")
