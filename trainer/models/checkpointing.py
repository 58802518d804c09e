"""``train.gradient_checkpointing``: recompute each decoder layer's activations in the backward pass.

Without it a LoRA update keeps every layer's intermediate activations (attention, MLP, norms) for
the backward; with it only each decoder layer's input is kept and the layer runs again in the
backward: memory ~ layers x tokens x hidden instead of ~ layers x tokens x (several x hidden + MLP),
for one extra forward (issue 27: a Qwen2.5-0.5B-shaped LoRA update at 16 x 4096 tokens went from out
of memory on 80 GB to 10.7 GiB, +30% step time). The gradients are the same function (tested).

Transformers' own switch (``PreTrainedModel.gradient_checkpointing_enable``) on the HF model under
the PEFT wrapper:
- ``use_reentrant=False``: torch's recommended implementation (torch.utils.checkpoint docs); it
  works when the layer's *inputs* do not require grad (frozen embeddings under LoRA), keeps the RNG
  state for the recompute (dropout draws the same mask) and supports keyword arguments;
- the input-embedding hook that makes its output require grad (``enable_input_require_grads``,
  which ``gradient_checkpointing_enable`` installs on a model whose input is ``input_ids``): what
  PEFT's own preparation does, needed by the reentrant variant and harmless with the other.

It takes effect only in train mode: ``GradientCheckpointingLayer.__call__`` checks
``self.gradient_checkpointing and self.training`` (the RL loop puts the model in train mode before
its passes; the probe's eval-mode forward and no-grad passes save nothing anyway). The backbone is
called directly by ``completion_hidden`` (no lm_head logits): checkpointing lives in its layers,
so that call path is covered; PPO's value head reads the backbone's output, outside the layers.
"""
from __future__ import annotations

from trainer.config.schema import RecipeError

CHECKPOINT_KWARGS = {"use_reentrant": False}


def hf_model(model):
    """The Transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def enable_gradient_checkpointing(model):
    """Turn on per-decoder-layer checkpointing in ``model`` (PEFT-wrapped or not); returns ``model``.

    Refuses (RecipeError) an architecture whose Transformers class does not support it.
    """
    base = hf_model(model)
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise RecipeError(f"train.gradient_checkpointing = true: {type(base).__name__} does not support gradient "
                         "checkpointing in Transformers; expected false for this model")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(CHECKPOINT_KWARGS))
    return model


def checkpointing_enabled(model) -> bool:
    """Whether ``model``'s decoder layers recompute their activations in the backward (in train mode)."""
    return any(getattr(m, "gradient_checkpointing", False) for m in hf_model(model).modules())
