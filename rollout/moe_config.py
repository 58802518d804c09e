"""The mixture-of-experts shape of a Hugging Face model config: which layers route, over how many experts, top-k.

Read from the config alone (no weights), so that a recipe's ``parity.routing_replay`` is checked before
anything loads and an engine that returns vLLM's own routes knows their layout. One rule per family, from
transformers 5.19's modeling files: Qwen2-MoE and Qwen3-MoE route in layer i unless i is in
``mlp_only_layers``, and only every ``decoder_sparse_step``-th layer ((i + 1) % step == 0); Mixtral and OLMoE
route in every layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["MOE_FAMILIES", "MoeShape", "is_moe", "moe_shape", "route_shape"]


@dataclass(frozen=True)
class MoeShape:
    model_type: str
    layers: tuple[int, ...]  # the decoder layers that route, in order (MoE layer l = layers[l])
    num_experts: int
    top_k: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def route_shape(num_layers: int, top_k: int, num_experts: int) -> dict[str, int]:
    """The shape every engine reports for its routes (``route_shape``) and the trainer checks its model against."""
    return {"layers": int(num_layers), "top_k": int(top_k), "num_experts": int(num_experts)}


# model_type -> the config attribute holding the expert count
MOE_FAMILIES: dict[str, str] = {"qwen2_moe": "num_experts", "qwen3_moe": "num_experts",
                                "mixtral": "num_local_experts", "olmoe": "num_experts"}


def _sparse(config: Any, i: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return i not in (getattr(config, "mlp_only_layers", None) or []) and (i + 1) % step == 0


def moe_shape(config: Any) -> Optional[MoeShape]:
    """The routing of a supported family's config; None for a dense model or a family ``MOE_FAMILIES`` lacks
    (``is_moe`` tells those apart)."""
    kind = getattr(config, "model_type", "")
    if kind not in MOE_FAMILIES:
        return None
    experts = int(getattr(config, MOE_FAMILIES[kind], 0) or 0)
    if experts <= 0:
        return None
    n = int(config.num_hidden_layers)
    layers = tuple(i for i in range(n) if kind in ("mixtral", "olmoe") or _sparse(config, i))
    return MoeShape(kind, layers, experts, int(config.num_experts_per_tok)) if layers else None


def is_moe(config: Any) -> bool:
    """Whether the config describes a mixture-of-experts model (any family): it names an expert count."""
    return any(int(getattr(config, k, 0) or 0) > 1 for k in ("num_experts", "num_local_experts", "n_routed_experts",
                                                             "moe_num_experts"))
