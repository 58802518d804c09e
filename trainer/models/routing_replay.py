"""Rollout routing replay for Hugging Face mixture-of-experts models: the trainer's forward uses the experts the
engine chose.

The engine and the trainer compute the router's logits with different kernels, so near-ties flip the top-k
(R3, arXiv 2510.11370: about 10% of router decisions on Qwen3-30B-A3B). With replay, each MoE layer's router
takes its expert ids from the routes the engine returned, and its gate weights from the live router: the softmax
of the router logits gathered at those ids (and normalised as the model does), so the router still gets a
gradient. Where a token has no route (``NO_ROUTE`` = -1: the engine returned none for it) the router's own
selection is used and counted; ``PAD`` (-2) marks positions whose route does not matter (padding, and the tokens
after a sequence's last sampled one), also left to the router and not counted.

Supported: transformers' ``TopKRouter`` modules of the families parityrl trains, whose ``forward(hidden)`` returns
``(router_logits, scores, indices)`` (read in transformers 5.19's ``modeling_qwen2_moe.py``, ``qwen3_moe``,
``mixtral``, ``olmoe``): ``ROUTERS`` says per class how its scores are normalised and cast. Another MoE router
is refused by name rather than replayed wrongly.

Layout: ``routes`` is [batch, positions, MoE layers, top_k] aligned with the model's ``input_ids`` (a router sees
its input flattened to batch x positions rows). ``RoutingReplay`` is installed once; ``set_routes`` holds the
routes until ``clear``, so that gradient checkpointing's recompute in the backward pass (which calls the router
again) replays the same selection. Every forward records the router's own top-k (``own``) for the routing parity
(``parity.routing``): ``last_stats`` compares it with the routes given. With replay, a layer's own choice is
made on hidden states that the earlier layers' replayed experts produced: it answers "would this router, given
the engine's inputs, have chosen the engine's experts", layer by layer. ``replay=False`` only measures.
"""
from __future__ import annotations

import types
import weakref
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from parity.routing import routing_stats
from rollout.routes import NO_ROUTE

__all__ = ["PAD", "ROUTERS", "RouterRule", "RoutingReplay", "UnsupportedRouting", "attached_replay", "moe_routers"]

PAD = -2  # a position whose route does not matter: the router's own choice, not counted as unrouted
ATTR = "_parityrl_replay"


class UnsupportedRouting(ValueError):
    """A model whose MoE routers this module cannot replay (or a dense model asked to replay)."""


@dataclass(frozen=True)
class RouterRule:
    """How a router family turns its top-k probabilities into gate weights."""

    normalize: Optional[str]  # an attribute holding whether to renormalise (e.g. norm_topk_prob), or None: always
    cast_to_logits_dtype: bool  # whether the weights are cast back to the logits' dtype


ROUTERS: dict[str, RouterRule] = {
    "Qwen2MoeTopKRouter": RouterRule(normalize="norm_topk_prob", cast_to_logits_dtype=True),
    "Qwen3MoeTopKRouter": RouterRule(normalize="norm_topk_prob", cast_to_logits_dtype=True),
    "OlmoeTopKRouter": RouterRule(normalize="norm_topk_prob", cast_to_logits_dtype=True),
    "MixtralTopKRouter": RouterRule(normalize=None, cast_to_logits_dtype=False),
}


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE routers in layer order; [] for a dense model. ``UnsupportedRouting`` for a router class
    that ``ROUTERS`` does not know (a module named ``*Router``, or an MoE block's ``gate`` with a ``top_k``)."""
    found = []
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls in ROUTERS:
            found.append(module)
        elif cls.endswith("Router") or (name.endswith(".gate") and hasattr(module, "top_k")):
            raise UnsupportedRouting(f"{name} is a {cls}: routing replay supports {sorted(ROUTERS)}")
    return found


_FOUND: "weakref.WeakKeyDictionary[torch.nn.Module, Optional[RoutingReplay]]" = weakref.WeakKeyDictionary()


def attached_replay(model: torch.nn.Module) -> Optional["RoutingReplay"]:
    """The ``RoutingReplay`` installed in ``model`` (or in the model a wrapper holds), or None; one walk over
    the modules per model object (a dense model's every forward asks)."""
    if model not in _FOUND:
        _FOUND[model] = next((getattr(m, ATTR) for m in model.modules() if getattr(m, ATTR, None) is not None), None)
    return _FOUND[model]


class RoutingReplay:
    """Wraps every router of ``model`` (once); inert until ``set_routes``. ``replay=False``: the routers keep
    their own choice and only record it (routing parity without replay)."""

    def __init__(self, model: torch.nn.Module, replay: bool = True):
        self.routers = moe_routers(model)
        if not self.routers:
            raise UnsupportedRouting(f"{type(model).__name__} has no mixture-of-experts router to replay")
        if any(getattr(r, ATTR, None) is not None for r in self.routers):
            raise ValueError("RoutingReplay: this model's routers are already wrapped")
        self.replay = replay
        self.top_k = int(self.routers[0].top_k)
        self.num_experts = int(self.routers[0].num_experts)
        self.routes: Optional[torch.Tensor] = None
        self.own: list[Optional[torch.Tensor]] = [None] * len(self.routers)  # the last forward's own top-k
        self.unrouted = 0  # (token, layer) selections replay left to the router for lack of a route (NO_ROUTE)
        for layer, router in enumerate(self.routers):
            router.forward = self._wrapped(router, layer)
            setattr(router, ATTR, self)
        _FOUND.clear()  # a wrapper looked up before this install must find it now

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    def set_routes(self, routes: Optional[torch.Tensor]) -> None:
        """Replay ``routes`` [batch, positions, layers, top_k] (-1: none) in every forward until ``clear``."""
        if routes is not None:
            if routes.dim() != 4 or routes.shape[2:] != (self.num_layers, self.top_k):
                raise ValueError(f"routes: expected [batch, positions, {self.num_layers} MoE layers, top_k "
                                 f"{self.top_k}], got {tuple(routes.shape)}")
            if routes.dtype.is_floating_point:
                raise ValueError(f"routes: expected integer expert ids, got {routes.dtype}")
            bad = routes >= self.num_experts
            if bad.any():
                where = bad.nonzero()[0].tolist()
                raise ValueError(f"routes: expert id {int(routes[tuple(where)])} at (row {where[0]}, position "
                                 f"{where[1]}, MoE layer {where[2]}) is out of range: the model has "
                                 f"{self.num_experts} experts")
        self.routes, self.unrouted = routes, 0

    def clear(self) -> None:
        self.routes = None

    def last_stats(self) -> dict[str, torch.Tensor]:
        """``parity.routing.routing_stats`` of the last forward: its routers' own choice against the routes set,
        over the positions the engine routed; plus ``unrouted`` (token-layer selections with ``NO_ROUTE``) and
        ``positions`` (the routes' non-PAD token-layer slots)."""
        given = self.routes.reshape(-1, self.num_layers, self.top_k).long()
        own = torch.stack([o.to(given.device) for o in self.own], 1)  # [tokens, L, k]
        stats = routing_stats(given, own, (given >= 0).all(-1).all(-1))
        stats["unrouted"] = (given == NO_ROUTE).any(-1).double().sum()
        stats["positions"] = (given != PAD).any(-1).double().sum()
        return stats

    def _wrapped(self, router: torch.nn.Module, layer: int):
        """The router's replaying forward, bound to the router: it reads the router's own weights and the
        ``RoutingReplay`` attached to it (``ATTR``), so that ``copy.deepcopy`` of the model (which rebinds a bound
        method to the copied module and copies the attribute) gives a copy that routes with its own weights and
        routes, e.g. the same weights cast to a wider dtype."""
        rule = ROUTERS[type(router).__name__]

        def forward(router: torch.nn.Module, hidden_states: torch.Tensor):
            replay = getattr(router, ATTR)
            hidden = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(hidden, router.weight)
            probs = torch.softmax(logits.float(), dim=-1)
            top, own = torch.topk(probs, router.top_k, dim=-1)
            replay.own[layer] = own.detach()
            if replay.routes is not None:
                given = replay.routes[:, :, layer].reshape(-1, router.top_k).to(own.device)
                if given.shape[0] != own.shape[0]:
                    raise ValueError(f"routes hold {given.shape[0]} tokens for MoE layer {layer}, whose input has "
                                     f"{own.shape[0]}: the routes must be laid out as the model's input_ids")
            if replay.routes is not None and replay.replay:
                missing = (given < 0).any(-1, keepdim=True)
                replay.unrouted += int((given == NO_ROUTE).any(-1).sum())
                own = torch.where(missing, own, given.long())
                top = probs.gather(-1, own)  # differentiable in the router's weight: the router keeps learning
            if rule.normalize is None or getattr(router, rule.normalize):
                top = top / top.sum(dim=-1, keepdim=True)
            if rule.cast_to_logits_dtype:
                top = top.to(logits.dtype)
            return logits, top, own

        return types.MethodType(forward, router)
