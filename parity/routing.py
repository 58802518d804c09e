"""Routing parity of mixture-of-experts models: how often the engine's expert selection and the trainer's agree.

A route is, per token and per MoE layer, the ids of the top-k experts the router chose. Two routes of a
(token, layer) agree when they hold the same experts as sets (the order of the top-k does not change the layer's
output). Definitions (DESIGN.md, "Routes"):

* ``parity/routing_agree``: the share of (token, layer) selections that agree, over the valid tokens;
* ``parity/routing_agree/layer_<l>``: the same per MoE layer l (0 = the first MoE layer);
* ``parity/routing_tokens_any_diff``: the share of valid tokens whose selection differs in at least one layer
  (the R3 paper's 94% on Qwen3-30B-A3B, arXiv 2510.11370).

``routing_stats`` returns sums, so that batches and data-parallel ranks pool exactly before ``routing_metrics``
divides.
"""
from __future__ import annotations

from typing import Dict

import torch

__all__ = ["routing_metrics", "routing_stats"]


def routing_stats(engine_routes: torch.Tensor, trainer_routes: torch.Tensor, valid: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Sums over the valid tokens: ``agree_by_layer`` [L] (float64 counts), ``tokens``, ``tokens_any_diff``.

    Args:
        engine_routes, trainer_routes: [..., L, k] integer expert ids, the same shape.
        valid: [...] bool, the tokens to count (e.g. the sampled completion tokens).
    """
    if engine_routes.shape != trainer_routes.shape or engine_routes.dim() < 2:
        raise ValueError(f"routes: expected two [..., layers, top_k] tensors of one shape, got "
                         f"{tuple(engine_routes.shape)} and {tuple(trainer_routes.shape)}")
    if valid.shape != engine_routes.shape[:-2]:
        raise ValueError(f"valid: expected shape {tuple(engine_routes.shape[:-2])}, got {tuple(valid.shape)}")
    same = (engine_routes.sort(-1).values == trainer_routes.sort(-1).values).all(-1)  # [..., L]
    same = same[valid.bool()]  # [N, L]
    return {"agree_by_layer": same.double().sum(0), "tokens": torch.tensor(float(same.shape[0]), dtype=torch.float64),
            "tokens_any_diff": (~same).any(-1).double().sum()}


def routing_metrics(stats: Dict[str, torch.Tensor]) -> Dict[str, float]:
    """``parity/routing_*`` from (pooled) ``routing_stats``; NaN without tokens."""
    n = float(stats["tokens"])
    layers = stats["agree_by_layer"]
    if n == 0:
        return {"parity/routing_agree": float("nan"), "parity/routing_tokens_any_diff": float("nan")}
    out = {"parity/routing_agree": float(layers.sum()) / (n * layers.numel()),
           "parity/routing_tokens_any_diff": float(stats["tokens_any_diff"]) / n}
    out.update({f"parity/routing_agree/layer_{i}": float(v) / n for i, v in enumerate(layers)})
    return out
