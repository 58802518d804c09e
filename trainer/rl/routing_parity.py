"""A step's routing parity (``parity/routing_*``) and, with replay, the same step scored without it
(``parity/unreplayed/*``): what rollout routing replay removes, measured on the batch it trained on.

The sums come from the trainer's scoring forward (``Scores.routing``: ``RoutingReplay.last_stats`` per
micro-batch) and are pooled over the data-parallel ranks before any division (``parity.routing``).
``parity/routing_unrouted``: the share of the routed positions' (token, layer) slots the engine returned no
route for, where the trainer's router chose (``trainer.models.routing_replay``).
"""
from __future__ import annotations

import contextlib

import torch

from parity.routing import routing_metrics
from trainer.models.routing_replay import attached_replay

__all__ = ["pooled_routing_metrics", "replay_paused"]


def pooled_routing_metrics(stats: dict, dp, prefix: str = "parity/") -> dict[str, float]:
    """``parity/routing_*`` of this rank's routing sums pooled with every other rank's."""
    layers = stats["agree_by_layer"]
    flat = {f"agree_{i}": float(v) for i, v in enumerate(layers)}
    flat.update({k: float(stats[k]) for k in ("tokens", "tokens_any_diff", "unrouted", "positions")})
    s = dp.sum_metrics(flat)
    pooled = {"agree_by_layer": torch.tensor([s[f"agree_{i}"] for i in range(layers.numel())], dtype=torch.float64),
              "tokens": torch.tensor(s["tokens"]), "tokens_any_diff": torch.tensor(s["tokens_any_diff"])}
    out = routing_metrics(pooled)
    out["parity/routing_unrouted"] = s["unrouted"] / max(s["positions"], 1.0)
    return out if prefix == "parity/" else {prefix + k.split("/", 1)[1]: v for k, v in out.items()}


@contextlib.contextmanager
def replay_paused(model):
    """The model's routers choose for themselves inside (the routes still reach them, for the statistics)."""
    replay = attached_replay(model)
    was, replay.replay = replay.replay, False
    try:
        yield
    finally:
        replay.replay = was
