"""parity.merge_cost: what a merged sync loses in what the engine stores (its dtype; an FP8 engine's block-FP8
values), against hand-computed values."""
import math

import pytest
import torch

from parity.lora import merged_lora_weight
from parity.merge_cost import merge_cost_metrics, merge_cost_sums
from parity.precision import fake_quant_weight


def test_bf16_merge_of_a_small_a_representable_and_a_tied_update():
    # bf16 spacing is 2**-7 at 1.0 and 2 at 256: 1 + 2**-10 rounds back to 1 (lost), 1 + 2**-7 is exact,
    # 256 + 1 is a tie that rounds to the even 256 (lost).
    w = torch.tensor([1.0, 1.0, 256.0], dtype=torch.bfloat16)
    delta = torch.tensor([2.0**-10, 2.0**-7, 1.0])
    s = merge_cost_sums(w, w.float() + delta, torch.bfloat16)
    assert s["err2"] == pytest.approx(2.0**-20 + 1.0, rel=1e-12)
    assert s["delta2"] == pytest.approx(2.0**-20 + 2.0**-14 + 1.0, rel=1e-12)
    assert s == {**s, "unchanged": 2.0, "numel": 3.0}
    m = merge_cost_metrics(s)
    assert m["sync/merge_update_error"] == pytest.approx(math.sqrt((2.0**-20 + 1) / (2.0**-20 + 2.0**-14 + 1)))
    assert m["sync/merge_unchanged_frac"] == pytest.approx(2 / 3)


def test_float32_engine_loses_nothing_and_a_zero_update_has_no_error():
    w = torch.randn(64, 32)
    delta = 1e-3 * torch.randn(64, 32)
    exact = w + delta
    m = merge_cost_metrics(merge_cost_sums(w, exact, torch.float32))
    assert m["sync/merge_update_error"] < 1e-4  # float32's own rounding of W + delta, relative to delta
    w16 = w.to(torch.bfloat16)
    zero = merge_cost_metrics(merge_cost_sums(w16, w16.float(), torch.bfloat16))
    assert "sync/merge_update_error" not in zero and zero["sync/merge_unchanged_frac"] == 1.0


def test_sums_pool_over_weights_before_the_division():
    a = merge_cost_sums(torch.ones(4, dtype=torch.bfloat16), torch.full((4,), 1 + 2.0**-10), torch.bfloat16)
    b = merge_cost_sums(torch.ones(4, dtype=torch.bfloat16), torch.full((4,), 1 + 2.0**-7), torch.bfloat16)
    pooled = merge_cost_metrics({k: a[k] + b[k] for k in a})
    # 4 elements lose 2**-10 each, 4 arrive exactly: sqrt(4 * 2**-20 / (4 * 2**-20 + 4 * 2**-14))
    assert pooled["sync/merge_update_error"] == pytest.approx(math.sqrt(2.0**-20 / (2.0**-20 + 2.0**-14)))
    assert pooled["sync/merge_unchanged_frac"] == 0.5


def test_low_learning_rate_lora_update_is_mostly_lost_in_bf16_and_kept_in_float32():
    """The issue's effect in miniature: a LoRA update of relative size ~1e-4 against W moves few bf16 elements."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False)).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["0"]))
    layer = model.base_model.model[0]
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0, 1e-4)
    merged = merged_lora_weight(layer)
    bf16 = merge_cost_metrics(merge_cost_sums(layer.get_base_layer().weight, merged, torch.bfloat16))
    assert bf16["sync/merge_update_error"] > 0.5 and bf16["sync/merge_unchanged_frac"] > 0.5


def test_shapes_must_match():
    with pytest.raises(ValueError, match="differ in shape"):
        merge_cost_sums(torch.ones(2, 3), torch.ones(3, 2), torch.bfloat16)


def test_an_fp8_engine_loses_what_fp8_rounding_drops_where_bf16_keeps_it():
    # One 128x128 block whose amax 448 gives the scale 448 / 448 = 1, so the E4M3 grid is the values themselves:
    # spacing 2**-3 in [1, 2), 2**-2 in [2, 4). W = [448, 1, 2, 3] is on both grids; each W + delta is a bf16 value.
    #   1 + 2**-5  -> FP8 1.0   (lost: error -2**-5)
    #   2 + 2**-2  -> FP8 2.25  (exact)
    #   3 + 3/16   -> FP8 3.25  (nearer than 3.0: error +2**-4)
    # err2 = 2**-10 + 2**-8 = 5 * 2**-10, delta2 = 2**-10 + 2**-4 + 9 * 2**-8 = 101 * 2**-10; unchanged: the
    # element without an update and the lost one. In bf16 every update arrives exactly.
    w = torch.tensor([[448.0, 1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    merged = w.float() + torch.tensor([[0.0, 2.0**-5, 2.0**-2, 3 / 16]])
    fp8 = merge_cost_sums(w, merged, torch.bfloat16, store=fake_quant_weight)
    assert fp8 == {"err2": 5 * 2.0**-10, "delta2": 101 * 2.0**-10, "unchanged": 2.0, "numel": 4.0}
    m = merge_cost_metrics(fp8)
    assert m["sync/merge_update_error"] == pytest.approx(math.sqrt(5 / 101), rel=1e-12)
    assert m["sync/merge_unchanged_frac"] == 0.5
    bf16 = merge_cost_sums(w, merged, torch.bfloat16)
    assert bf16["err2"] == 0.0 and bf16["unchanged"] == 1.0


def test_an_update_that_moves_a_blocks_amax_moves_its_other_elements():
    # W = [448, 3], delta = [32, 0]: the amax becomes 480, the scale s = 480 / 448 (float32), and 3 requantizes to
    # e4m3(3 / s = 2.8) = 2.75 (spacing 2**-2), 2.75 * s = 2.9464... -> bf16 2.953125 (spacing 2**-6): an element
    # without an update moves by -3/64, while 480 arrives exactly. err2 = (3/64)**2, delta2 = 32**2.
    w = torch.tensor([[448.0, 3.0]], dtype=torch.bfloat16)
    s = merge_cost_sums(w, w.float() + torch.tensor([[32.0, 0.0]]), torch.bfloat16, store=fake_quant_weight)
    assert s == {"err2": (3 / 64) ** 2, "delta2": 1024.0, "unchanged": 0.0, "numel": 2.0}
