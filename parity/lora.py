"""The LoRA merge both sides compute: the effective weight of a PEFT LoRA layer.

    W = W_base + sum_{a in active adapters} scaling_a * delta_a

Linear: ``lora_A[a].weight`` [r, in], ``lora_B[a].weight`` [out, r], delta = B @ A [out, in]
(transposed to [in, out] when ``fan_in_fan_out``, matching the base weight). Embedding:
``lora_embedding_A[a]`` [r, vocab], ``lora_embedding_B[a]`` [dim, r], delta = (B @ A).T
[vocab, dim]. Hu et al. 2021, "LoRA", https://arxiv.org/abs/2106.09685, eq. 3.

The weight sync sends this weight to the engine (``rollout.weight_export``) and the trainer's
FP8 layers quantize it in their forward (``trainer.models.precision``); the two must hold the
same bits, so there is one implementation. The arithmetic is float32 (delta * scaling, then
added to the float32 base, adapter by adapter in PEFT's order), which is bitwise what PEFT's
``merge_and_unload()`` of a float32 copy holds; the caller rounds the result once to its dtype.

Works on PEFT's LoRA layers by their attributes (no PEFT import: ``parity`` depends on torch only).
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["merged_lora_weight"]


def _delta(module: nn.Module, adapter: str) -> torch.Tensor | None:
    """float32 B @ A of one adapter in the base weight's layout, or None if it does not apply to ``module``."""
    if adapter in getattr(module, "lora_A", {}):
        lora_b = module.lora_B[adapter]
        if getattr(lora_b, "bias", None) is not None:
            raise NotImplementedError(f"adapter {adapter!r} has lora_bias=True; merging it changes the base bias")
        delta = lora_b.weight.float() @ module.lora_A[adapter].weight.float()
        return delta.T if module.fan_in_fan_out else delta
    if adapter in getattr(module, "lora_embedding_A", {}):
        return (module.lora_embedding_B[adapter].float() @ module.lora_embedding_A[adapter].float()).T
    return None


def merged_lora_weight(module: nn.Module) -> torch.Tensor:
    """The weight a PEFT LoRA layer's forward multiplies by: W_base + sum_a scaling_a * delta_a.

    float32 when an adapter adds a delta (the caller rounds it once to its dtype), the base
    weight itself otherwise. Differentiable in the adapters' weights (the trainer's FP8 forward
    backpropagates through it); call it under ``torch.no_grad()`` for a copy to send.
    Adapters already merged into the base (``merged_adapters``) are not added again; with
    adapters disabled the forward uses the base weight, and so does this. LoRA variants (DoRA),
    ``lora_bias`` and layers other than Linear and Embedding are refused: their merge is not
    W + s * B @ A.
    """
    base = module.get_base_layer().weight
    if module.disable_adapters:
        return base
    merged: torch.Tensor | None = None
    for adapter in module.active_adapters:
        if adapter in module.merged_adapters:
            continue
        variant = getattr(module, "lora_variant", {}).get(adapter)
        if variant is not None or getattr(module, "use_dora", {}).get(adapter):
            raise NotImplementedError(
                f"adapter {adapter!r} uses a LoRA variant ({type(variant).__name__}, e.g. DoRA); "
                "its merge is not W + s*B@A and is not supported")
        delta = _delta(module, adapter)
        if delta is None:
            continue  # adapter not applied to this module
        if delta.shape != base.shape:
            raise NotImplementedError(
                f"LoRA module of type {type(module).__name__}: delta shape {tuple(delta.shape)} != "
                f"base weight shape {tuple(base.shape)}; only Linear and Embedding LoRA layers are supported")
        # delta * scaling, then add: PEFT's float32 operations, in its order.
        merged = (base.float() if merged is None else merged) + delta * float(module.scaling[adapter])
    return base if merged is None else merged
