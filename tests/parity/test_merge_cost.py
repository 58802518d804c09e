"""parity.merge_cost: what a merged sync loses in the engine's dtype, against hand-computed values."""
import math

import pytest
import torch

from parity.lora import merged_lora_weight
from parity.merge_cost import merge_cost_metrics, merge_cost_sums


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
