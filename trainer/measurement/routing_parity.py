"""A step's routing parity (``parity/routing_*``) and, with replay, the same step scored without it
(``parity/unreplayed/*``): what rollout routing replay removes, measured on the batch it trained on; and the
run's routes set up and checked: ``parity.routing_replay`` resolved for the loaded model
(``install_routing``), the engine's routes checked against the model before any rollout
(``check_engine_routes``), and every batch held to carry them (``with_routes``).

The sums come from the trainer's scoring forward (``Scores.routing``: ``RoutingReplay.last_stats`` per
micro-batch) and are pooled over the data-parallel ranks before any division (``parity.routing``).
``parity/routing_unrouted``: the share of the routed positions' (token, layer) slots the engine returned no
route for, where the trainer's router chose (``trainer.models.routing_replay``).
"""
from __future__ import annotations

import contextlib

import torch

from parity.routing import routing_metrics
from rollout.moe_config import route_shape
from trainer.config import RecipeError, RunConfig
from trainer.models.batch import TokenBatch
from trainer.models.routing_mode import routing_mode
from trainer.models.routing_replay import RoutingReplay, attached_replay

__all__ = ["check_engine_routes", "install_routing", "pooled_routing_metrics", "replay_paused", "with_routes"]


def install_routing(cfg: RunConfig, model) -> str:
    """``parity.routing_replay`` resolved for the loaded model (replay | measure | off); the trainer's routers
    wrapped unless "off"."""
    try:
        routing = routing_mode(cfg.parity.routing_replay, model.config, where=f"recipe {cfg.name!r}")
    except ValueError as e:
        raise RecipeError(str(e)) from None
    if routing != "off":
        RoutingReplay(model, replay=routing == "replay")
    return routing


def check_engine_routes(engine, model) -> None:
    """The engine returns routes of the trainer's model's shape (MoE layers, top-k, experts), before any rollout."""
    replay = attached_replay(model)
    mine = route_shape(replay.num_layers, replay.top_k, replay.num_experts)
    theirs = getattr(engine, "route_shape", None)
    if theirs is None or not getattr(engine, "return_routes", False):
        raise RecipeError(f"parity.routing_replay: the engine ({type(engine).__name__}) does not return routes; "
                          "it must be started with return_routes=True (or set parity.routing_replay: off)")
    if dict(theirs) != mine:
        raise RecipeError(f"parity.routing_replay: the engine's routes are {dict(theirs)}, the trainer's model has "
                          f"{mine}: the engine serves another model")


def with_routes(routing: str, engine, batch: TokenBatch) -> TokenBatch:
    """The batch with the engine's routes where the run replays or measures them (``routing`` not "off"), without
    them otherwise; an engine that returned none when they were asked for is an error, never a silent fallback to
    the routers."""
    if routing == "off":
        batch.routes = None
    elif batch.routes is None:
        raise RuntimeError(f"parity.routing_replay: the engine ({type(engine).__name__}) returned no routes with "
                           f"the step's rollouts; it must be started with return_routes=True")
    return batch


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
