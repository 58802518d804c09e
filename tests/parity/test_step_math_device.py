"""The per-step math makes its tensors on its inputs' device, so that what passes on CPU also runs on CUDA.

A tensor made without ``device=`` lands on the CPU; beside CUDA inputs that is "Expected all tensors to be on the
same device" at the first CUDA step, which no CPU test sees by itself. Under
``torch.device("meta")`` as the default device, such a tensor is made on ``meta`` instead and meets the CPU
inputs with the same error, so a CPU run sees the bug: each function here runs on CPU inputs under it and must
return what it returns without it.
"""
import math

import pytest
import torch

import parity.metrics as pm
from parity.corrections import CorrectionInputs
from parity.corrections.plan import CorrectionPlan
from parity.corrections.registry import get_rule, rule_names
from parity.corrections.stats import correction_stats
from trainer.off_policy import OFF_POLICY


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    train = -torch.rand(4, 6, generator=g) * 3
    rollout = train + 0.3 * torch.randn(4, 6, generator=g)
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[1, 4:] = False
    mask[3, 2:] = False
    return train, rollout, mask


def _on_meta_default(fn, *args):
    with torch.device("meta"):
        return fn(*args)


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.device == b.device and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


@pytest.mark.parametrize("name", [n for n, o in OFF_POLICY.items() if o.weight is not None])
def test_off_policy_weights_stay_on_the_inputs_device(name):
    prox, behaviour, mask = _batch()
    objective = OFF_POLICY[name]
    parameter = {"m2_threshold": 0.04, "behaviour_weight_cap": 2.0}[objective.parameter]
    want = objective.weight(prox, behaviour, mask.float(), parameter)
    _same(_on_meta_default(objective.weight, prox, behaviour, mask.float(), parameter), want)


@pytest.mark.parametrize("name", rule_names())
def test_correction_rules_and_their_statistics_stay_on_the_inputs_device(name):
    train, rollout, mask = _batch(1)
    advantages = torch.randn(4, 6, generator=torch.Generator().manual_seed(2)) * mask
    plan = CorrectionPlan((name,), batch_normalize=get_rule(name).kind == "weight")

    def run():
        inputs = CorrectionInputs.of(train, rollout, mask, advantages)
        out = plan.apply(inputs)
        return out.weights, correction_stats(inputs, out, plan)

    _same(_on_meta_default(run), run())


@pytest.mark.parametrize("fn", [pm.compare, pm.compare_by_turn])
def test_the_parity_metrics_stay_on_the_inputs_device(fn):
    train, rollout, mask = _batch(3)
    _same(_on_meta_default(fn, train, rollout, mask), fn(train, rollout, mask))


def test_a_tensor_made_without_a_device_is_caught():
    """The check itself: arithmetic between an input and a tensor made on the default device (M2PO's running mean
    divided by a ``torch.arange`` made on the default device) fails under it, as it fails on CUDA."""
    def careless(x: torch.Tensor) -> torch.Tensor:
        return x.cumsum(0) / torch.arange(1, x.numel() + 1)

    x = torch.tensor([1.0, 3.0])
    assert careless(x).tolist() == [1.0, 2.0]
    with pytest.raises(RuntimeError, match="device"):
        _on_meta_default(careless, x)
