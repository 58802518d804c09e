"""A model's weights under the names, shapes and splits its checkpoint holds them in: what an engine started from
that checkpoint loads.

Transformers 5 converts some checkpoint layouts as it loads them (``transformers/conversion_mapping.py``). The routed
experts of Qwen2-MoE, Qwen3-MoE and OLMoE, stored one tensor per expert and projection
(``mlp.experts.<e>.gate_proj.weight``, ``up_proj``, ``down_proj``), become two tensors per layer in memory:
``mlp.experts.gate_up_proj`` [E, 2I, H] (each expert's gate and up concatenated) and ``mlp.experts.down_proj``
[E, H, I]; Mixtral's ``block_sparse_moe.experts.<e>.w1/w3/w2.weight`` likewise, its ``block_sparse_moe`` renamed
``mlp``. vLLM knows the checkpoint's names, and the sync refuses any other (``rollout.weight_updates.check_update``).

``checkpoint_named`` applies Transformers' own inverse of the conversion the model was loaded with
(``core_model_loading.revert_weight_conversion``, what ``save_pretrained`` writes; a model built from a config gets
its family's default mapping), so an exported weight is what the checkpoint would hold, bit for bit (a split is a
view: no arithmetic). Names no conversion touches come back unchanged.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

NamedTensors = list[tuple[str, torch.Tensor]]


def checkpoint_named(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> NamedTensors:
    """``named`` (in-memory names of ``model``, a plain Transformers model) under the checkpoint's names, in the
    order Transformers writes them."""
    from transformers.core_model_loading import revert_weight_conversion  # late: importing rollout stays light

    named = list(named)
    if not named:
        return named
    return list(revert_weight_conversion(model, dict(named)).items())
