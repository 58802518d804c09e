"""Routes from a Hugging Face model's own forward (the HF engine): the expert ids each router call returned.

transformers' MoE routers (``*TopKRouter`` in Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE) return
``(router_logits, scores, indices)`` with indices [tokens, k] of their input flattened to batch x positions.
``RouterTap`` records the indices of every call while it is open; ``generation_routes`` lays the calls of
one ``generate`` (a prefill over the left-padded prompts, then one call per decoding step, each for the token
sampled before it) out as ``rollout.routes`` tensors.
"""
from __future__ import annotations

import torch

from rollout.routes import NO_ROUTE, ROUTE_DTYPE

__all__ = ["RouterTap", "generation_routes"]


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


class RouterTap:
    """While open, ``calls[l]`` holds every call's indices [tokens, k] of MoE layer l (in layer order)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = _routers(model)
        if not self.routers:
            raise ValueError(f"routes: {type(model).__name__} has no mixture-of-experts router (a *TopKRouter module)")
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._hooks = []

    def __enter__(self) -> "RouterTap":
        for layer, router in enumerate(self.routers):
            self._hooks.append(router.register_forward_hook(
                lambda _m, _i, out, layer=layer: self.calls[layer].append(out[2].detach().to("cpu", ROUTE_DTYPE))))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def generation_routes(tap: RouterTap, prompt_lens: list[int], width: int, completion_lens: list[int]) -> list:
    """Per row b: routes [prompt_lens[b] + completion_lens[b], L, k] from one ``generate`` over ``B`` rows
    left-padded to ``width``: call 0 is the prefill (B x width rows), call t >= 1 routes completion token t - 1."""
    b_rows = len(prompt_lens)
    layers = [torch.stack([c.view(b_rows, -1, c.shape[-1]) for c in calls[1:]], 1) if len(calls) > 1 else None
              for calls in tap.calls]  # per layer [B, decode steps, 1, k]
    out = []
    for b, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        r = torch.full((p + c, len(tap.calls), tap.routers[0].top_k), NO_ROUTE, dtype=ROUTE_DTYPE)
        for lay, calls in enumerate(tap.calls):
            r[:p, lay] = calls[0].view(b_rows, width, -1)[b, width - p:]
            if layers[lay] is not None:
                steps = min(c, layers[lay].shape[1])
                r[p:p + steps, lay] = layers[lay][b, :steps, 0]
        out.append(r)
    return out
