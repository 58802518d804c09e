"""trainer.measurement.merge_cost: ``sync/merge_*`` in what the engine stores. With an FP8 engine the layers it
quantizes are measured in block FP8 and the others in the sync's dtype; worked by hand on a two-layer policy."""
import math

import pytest
import torch
from torch import nn

from trainer.measurement.merge_cost import MergeCost

peft = pytest.importorskip("peft")


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(4, 1, bias=False)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attention()


class _Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer()])


class _Policy(nn.Module):
    """model.layers.0.self_attn.q_proj (an FP8 target) and lm_head (BF16 in every engine), one row of 4 each."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Decoder()
        self.lm_head = nn.Linear(4, 1, bias=False)


@pytest.fixture
def policy():
    base = _Policy().to(torch.bfloat16)
    with torch.no_grad():
        for linear in (base.model.layers[0].self_attn.q_proj, base.lm_head):
            linear.weight.copy_(torch.tensor([[448.0, 1.0, 2.0, 3.0]]))
    model = peft.get_peft_model(base, peft.LoraConfig(r=1, lora_alpha=1, target_modules=["q_proj", "lm_head"]))
    with torch.no_grad():  # delta = 1.0 * B @ A = [0, 2**-5, 2**-2, 3/16] on both layers
        for module in model.modules():
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                module.lora_A["default"].weight.copy_(torch.tensor([[0.0, 2.0**-5, 2.0**-2, 3 / 16]]))
                module.lora_B["default"].weight.fill_(1.0)
    return model


def test_an_fp8_engine_is_measured_in_block_fp8_on_the_layers_it_quantizes(policy):
    # q_proj in FP8 (scale 448 / 448 = 1): 1 + 2**-5 -> 1 (lost, -2**-5), 2.25 exact, 3.1875 -> 3.25 (+2**-4):
    # err2 = 5 * 2**-10; lm_head in bf16: every element arrives, err2 = 0. delta2 = 2 * 101 * 2**-10.
    # Unchanged: q_proj's first two elements, lm_head's first: 3 of 8.
    m = MergeCost(policy, torch.bfloat16, fp8=True)()
    assert m["sync/merge_update_error"] == pytest.approx(math.sqrt(5 / 202), rel=1e-12)
    assert m["sync/merge_unchanged_frac"] == 3 / 8
    # the same sync to a BF16 engine loses nothing: the figure above is FP8's rounding
    plain = MergeCost(policy, torch.bfloat16)()
    assert plain["sync/merge_update_error"] == 0.0 and plain["sync/merge_unchanged_frac"] == 2 / 8


def test_the_warning_names_what_the_engine_stores(policy):
    cost = MergeCost(policy, torch.bfloat16, fp8=True)
    line = cost.warning(3, {"sync/merge_update_error": 0.5, "sync/merge_unchanged_frac": 0.25}, "merged")
    assert "did not move in bfloat16 then block FP8" in line and "lora_sync: adapter" not in line
    bf16 = MergeCost(policy, torch.bfloat16).warning(3, {"sync/merge_update_error": 0.5}, "merged")
    assert "did not move in bfloat16)" in bf16 and "rollout.lora_sync: adapter" in bf16
