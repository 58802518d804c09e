"""A gradient that is not finite is kept out of the weights (trainer/distributed/gradient_guard.py): through the loop's
own ``optimizer_step`` with a real accelerator and AdamW, a planted NaN or inf leaves every weight and the
optimizer's state as they were, drops the gradients, names the parameters and returns a non-finite norm; a finite
gradient steps as before. The run's summary counts the skipped steps."""
import math

import pytest
import torch
from accelerate import Accelerator

from trainer.distributed.deepspeed import optimizer_step
from trainer.distributed.gradient_guard import nonfinite_gradients, skipped_update_message
from trainer.lifecycle.run_health import health_warnings


class _Policy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(3, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x) + self.frozen(x)))


def _setup():
    acc = Accelerator(cpu=True)
    model = _Policy()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.1)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt, params


def _backward(model, poison=None):
    model(torch.ones(4, 3)).pow(2).sum().backward()
    if poison is not None:
        model.proj.weight.grad[0, 1] = poison


def test_a_finite_gradient_steps():
    acc, model, opt, params = _setup()
    before = [p.detach().clone() for p in params]
    _backward(model)
    norm = optimizer_step(acc, model, opt, params, 1.0)
    assert math.isfinite(norm) and norm > 0
    assert all(not torch.equal(b, p) for b, p in zip(before, params))
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_a_nonfinite_gradient_leaves_the_weights_and_the_optimizer_as_they_were(poison, capsys):
    acc, model, opt, params = _setup()
    _backward(model)
    optimizer_step(acc, model, opt, params, 1.0)  # one good step first: the optimizer has moments to lose
    weights = [p.detach().clone() for p in params]
    moments = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
    _backward(model, poison)
    norm = optimizer_step(acc, model, opt, params, 1.0)
    assert not math.isfinite(norm)
    assert all(torch.equal(w, p) for w, p in zip(weights, params))
    assert all(torch.equal(v, opt.state_dict()["state"][0][k]) for k, v in moments.items())
    assert all(p.grad is None for p in params)
    out = capsys.readouterr().out
    assert "the gradient is not finite" in out and "1 parameter(s): proj.weight;" in out and "skipped" in out
    _backward(model)  # and the next finite gradient steps again
    assert math.isfinite(optimizer_step(acc, model, opt, params, 1.0))
    assert not torch.equal(weights[0], params[0])


def test_a_nonfinite_gradient_outside_the_policy_module_is_kept_out_too(capsys):
    """PPO's value head is stepped by the same optimizer but is not a parameter of the policy module."""
    acc, model, opt, params = _setup()
    head = torch.nn.Linear(3, 1)
    opt.add_param_group({"params": list(head.parameters())})
    head(torch.ones(2, 3)).sum().backward()
    head.bias.grad[0] = math.nan
    _backward(model)
    weights = [p.detach().clone() for p in params]
    assert math.isnan(optimizer_step(acc, model, opt, [*params, *head.parameters()], 1.0))
    assert all(torch.equal(w, p) for w, p in zip(weights, params))
    assert "a parameter outside the policy module" in capsys.readouterr().out


def test_the_names_are_those_of_the_nonfinite_gradients_only():
    model = _Policy()
    _backward(model)
    assert nonfinite_gradients(model.named_parameters()) == []
    model.head.bias.grad[1] = -math.inf
    model.proj.weight.grad[2, 2] = math.nan
    assert nonfinite_gradients(model.named_parameters()) == ["proj.weight", "head.bias"]
    msg = skipped_update_message([f"p{i}" for i in range(6)], math.nan, step=3)
    assert msg.startswith("warning: step 3: the gradient is not finite (norm nan) in 6 parameter(s): p0, p1, p2, "
                          "p3 and 2 more;")


def test_the_summary_counts_the_skipped_steps():
    h = [{"step": s, "reward/mean": 0.3, "train/skipped_updates": float(s in (3, 4))} for s in range(1, 7)]
    assert health_warnings(h, 2, {}, {}) == [
        "warning: 2 of 6 steps skipped an update whose gradient was not finite (steps 3, 4): the weights did not "
        "move there; the console named the parameters"]
