"""The policy under training: loaded, prepared for DeepSpeed (or not), and the ``Learner`` the update passes take.

``load_policy`` and ``prepare_policy`` are the run's own model setup; bench/checks/zero_cpu_check.py
drives them too, so what it checks against a single-process reference is what a run does.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from trainer.config import RunConfig
from trainer.distributed.data_parallel import DataParallel
from trainer.distributed.deepspeed import fill_deepspeed_config, model_load_context
from trainer.models.checkpointing import enable_gradient_checkpointing
from trainer.models.exact import ExactLogprobs
from trainer.models.policy import add_lora, load_base_model
from trainer.models.policy_forward import unwrap_policy, wrap_for_prepare
from trainer.precision import recipe_for
from trainer.rl.value_head import ValueHead


@dataclass
class Learner:
    """What an update pass needs of the run: the model it differentiates, how a gradient and a step are taken.

    ``backward(loss)`` per micro-batch and ``step()`` (clip, optimizer step, zero; returns the
    pre-clip gradient norm) per mini-batch: ``trainer.distributed.deepspeed.make_backward`` /
    ``optimizer_step``, which drive the DeepSpeed engine when there is one. ``step`` None: a
    learner that only accumulates gradients (a ``policy_gradient_pass`` on its own).
    """

    cfg: RunConfig
    model: object  # the PEFT policy, or the DeepSpeed engine around it
    backward: Callable[[torch.Tensor], None]
    step: Optional[Callable[[], float]] = None
    value_head: Optional[ValueHead] = None
    dp: DataParallel = field(default_factory=DataParallel)
    exact: Optional[ExactLogprobs] = None  # when the precision recipe's log-probs are the engine's own

    def param_groups(self) -> list[list[torch.nn.Parameter]]:
        """The trainable parameters: the adapters, then the critic's."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        return [trainable] if self.value_head is None else [trainable, list(self.value_head.parameters())]


def load_policy(cfg: RunConfig, accelerator, model_dir: str):
    """The base model with the recipe's LoRA adapter on the accelerator's device, transformed as its precision
    recipe says (``PrecisionRecipe.transform``: FP8 layers where both phases run the same FP8 forward), with
    the recipe's attention implementation and, with ``train.gradient_checkpointing``, checkpointed decoder
    layers (set on the HF modules before any DeepSpeed wrapper, which calls them as they are)."""
    with model_load_context(accelerator):
        base = load_base_model(model_dir, cfg.model.dtype, accelerator.device, cfg.model.attn_implementation,
                               pack_sequences=cfg.train.pack_sequences)
        model = add_lora(base, cfg.model.lora)
    model = recipe_for(cfg.precision.recipe).transform(model)
    return enable_gradient_checkpointing(model) if cfg.train.gradient_checkpointing else model


def prepare_policy(cfg: RunConfig, accelerator, stage: int, model, optimizer, value_head=None):
    """(model, optimizer, policy) after accelerate's prepare: the DeepSpeed engine under ZeRO, else as they were.

    The scheduler is never prepared: it drives the AdamW param groups, which DeepSpeed's ZeRO
    optimizer steps with (checked in bench/checks/zero_cpu_check.py).
    """
    if not stage:
        # The model is not prepared: no DDP wrapper (see DataParallel); it is already on the device.
        return model, accelerator.prepare(optimizer), model
    fill_deepspeed_config(accelerator, micro_batch_size=cfg.train.micro_batch_size,
                          max_grad_norm=cfg.train.max_grad_norm)
    # PPO's value head goes inside the engine with the policy (PolicyForward).
    engine, optimizer = accelerator.prepare(wrap_for_prepare(accelerator, model, value_head), optimizer)
    return engine, optimizer, unwrap_policy(accelerator, engine)
