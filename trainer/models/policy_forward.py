"""The policy's forward as one module, for a DeepSpeed engine to wrap (``PolicyForward``), and the way in and
out of it around ``accelerator.prepare``."""
from __future__ import annotations

import torch
from torch import nn

from trainer.distributed.deepspeed import deepspeed_stage
from trainer.models.architecture import split_model


class PolicyForward(nn.Module):
    """The module to hand DeepSpeed: ``forward`` returns the policy backbone's last hidden states.

    DeepSpeed's engine expects ``loss = engine(batch); engine.backward(loss)``
    (``DeepSpeedEngine.set_gradient_accumulation_boundary`` docstring), and its
    ``forward`` does bookkeeping the backward relies on: ``clear_backward_seen_flag()``
    (ZeRO-3 advances ``micro_step_id`` there; at 0 a backward overwrites the partitioned
    gradients instead of adding to them, ``stage3.py``: "if self.micro_step_id == 0: #
    don't accumulate") and the backward-prologue hooks on its outputs. Calling the
    backbone directly skips both: observed under ZeRO-3 with two micro-batches, only the
    last micro-batch's gradient survived (grad norm 2.75 instead of 4.26). Wrapping the
    backbone call as this module's forward keeps the fused log-prob path (no logits) and
    goes through the engine; ``trainer.models.policy.completion_hidden`` dispatches on it. With
    it, two CPU ranks matched one process on the full batch (``bench/checks/zero_cpu_check.py``:
    ZeRO-2 to 3.7e-9, ZeRO-3 in float32 to 7.5e-9, in bf16 within 0.6% of the update).

    ``policy``: the PEFT model (``unwrap_policy`` returns it). ``config`` and
    ``disable_adapter`` are forwarded because accelerate reads ``model.config`` (the
    "auto" bucket sizes) and the loop calls ``model.disable_adapter()`` on what prepare
    returned (the engine forwards unknown attributes to this module).

    ``value_head``: PPO's critic (``trainer.rl.value_head.ValueHead``), or None. It becomes a
    submodule, so the engine owns it like the adapters (its parameters in the ZeRO
    optimizer, its gradient reduced, its state in the engine's checkpoint), and the
    forward returns ``(hidden, values)``: the values are computed INSIDE the engine's
    forward, where ZeRO-3's module hooks expect every submodule call (a call after the
    forward returned would be outside the recorded trace).
    """

    def __init__(self, policy: nn.Module, value_head: nn.Module | None = None) -> None:
        super().__init__()
        self.policy = policy
        self.value_head = value_head

    @property
    def config(self):
        return self.policy.config

    def disable_adapter(self):
        return self.policy.disable_adapter()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        """hidden [S, T, H], or (hidden, values [S, T]) with a value head."""
        backbone, _ = split_model(self.policy)
        hidden = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return hidden if self.value_head is None else (hidden, self.value_head(hidden))


def wrap_for_prepare(accelerator, policy: nn.Module, value_head: nn.Module | None = None) -> nn.Module:
    """What to pass to ``accelerator.prepare``: ``PolicyForward(policy, value_head)`` under DeepSpeed, else ``policy``.

    (Without DeepSpeed the loop does not prepare the model: ``trainer.distributed.data_parallel``
    reduces gradients itself, for the same reason -- DDP's reducer is armed in its own
    ``forward``, which the policy's direct backbone call would skip. The value head then
    stays a separate module, its gradient reduced with the adapters'.)
    """
    return PolicyForward(policy, value_head) if deepspeed_stage(accelerator) else policy


def unwrap_policy(accelerator, model: nn.Module) -> nn.Module:
    """The PEFT model behind what ``prepare`` returned (DeepSpeed engine, or the model itself)."""
    inner = accelerator.unwrap_model(model)
    return inner.policy if isinstance(inner, PolicyForward) else inner


def wrapped_policy_forward(model: nn.Module):
    """The ``PolicyForward`` a DeepSpeed engine wraps (its ``.module``), or None for any other model."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, PolicyForward) else None
