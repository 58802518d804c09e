"""Routes: per token and per mixture-of-experts layer, the top-k expert ids an engine's router chose.

A sample's routes are one int16 tensor [P + C, L, k] over its whole sequence (the prompt's P tokens, then the
completion's C), L = the model's MoE layers in order (0 = the first MoE layer), k = its top-k. ``NO_ROUTE`` (-1)
marks a position the engine did not route: the last sampled token (the engine never feeds it back), a token it
did not compute (a prefix-cache hit), or an engine that returned nothing for it. The trainer replays the ids
and uses its own router where there are none (``trainer.models.routing_replay``), counting them.

int16: expert ids of every MoE model parityrl trains fit (vLLM picks uint8 / uint16 for the same reason,
``routed_experts_capturer.py``); a [P + C, L, k] tensor per sample is 2 bytes per (token, layer, slot).

Multi-turn episodes (``trainer.sampling.episodes``) send the whole conversation at every turn; a position's route
comes from the first turn that computed it (``extend_routes``): the turn whose computation produced the
sampled token's log-prob, not the later prefills that re-read it.
"""
from __future__ import annotations

import base64
from typing import Optional, Sequence

import torch

__all__ = ["NO_ROUTE", "ROUTE_DTYPE", "check_routes", "decode_routes", "encode_routes", "extend_routes",
           "route_shape"]

NO_ROUTE = -1
ROUTE_DTYPE = torch.int16


def route_shape(routes: Sequence[torch.Tensor]) -> Optional[tuple[int, int]]:
    """(MoE layers, top-k) of a batch's routes; None for none."""
    for r in routes:
        return int(r.shape[1]), int(r.shape[2])
    return None


def check_routes(routes: Sequence[torch.Tensor], lengths: Sequence[int], where: str) -> None:
    """``ValueError`` naming ``where`` unless ``routes`` holds one int16 [length, L, k] tensor per sample, every
    sample with the same (L, k)."""
    if len(routes) != len(lengths):
        raise ValueError(f"{where}: {len(routes)} route tensors for {len(lengths)} samples")
    shape = route_shape(routes)
    for i, (r, n) in enumerate(zip(routes, lengths)):
        if not isinstance(r, torch.Tensor) or r.dtype != ROUTE_DTYPE or r.dim() != 3:
            raise ValueError(f"{where}: sample {i}'s routes must be an int16 tensor [tokens, MoE layers, top_k], got "
                             f"{getattr(r, 'dtype', type(r).__name__)} {tuple(getattr(r, 'shape', ()))}")
        if r.shape[0] != n or tuple(r.shape[1:]) != shape:
            raise ValueError(f"{where}: sample {i}'s routes have shape {tuple(r.shape)}, expected "
                             f"[{n} tokens (prompt + completion), {shape[0]} MoE layers, top_k {shape[1]}]")


def extend_routes(earlier: Optional[torch.Tensor], later: torch.Tensor) -> torch.Tensor:
    """``later``'s routes where ``earlier`` has none: the routes of a sequence that ``later`` extends.

    ``earlier`` covers the first ``len(earlier)`` positions (or is None), ``later`` all of them; a position
    ``earlier`` routed keeps its route."""
    if earlier is None or earlier.shape[0] == 0:
        return later.clone()
    if earlier.shape[0] > later.shape[0] or earlier.shape[1:] != later.shape[1:]:
        raise ValueError(f"extend_routes: routes {tuple(later.shape)} do not extend {tuple(earlier.shape)}")
    out = later.clone()
    n = earlier.shape[0]
    known = (earlier != NO_ROUTE).all(-1, keepdim=True)
    out[:n] = torch.where(known, earlier, later[:n])
    return out


def encode_routes(routes: torch.Tensor) -> dict:
    """A JSON-able form of one sample's routes (server mode's wire): shape and base64 little-endian int16."""
    r = routes.to(ROUTE_DTYPE).contiguous()
    return {"shape": list(r.shape), "int16": base64.b64encode(r.numpy().astype("<i2").tobytes()).decode("ascii")}


def decode_routes(obj: dict, where: str) -> torch.Tensor:
    """``encode_routes``'s inverse; ``ValueError`` naming ``where`` for anything else."""
    import numpy as np

    try:
        shape = [int(x) for x in obj["shape"]]
        data = base64.b64decode(obj["int16"], validate=True)
        arr = np.frombuffer(data, dtype="<i2").reshape(shape)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where}: routes are not {{'shape': [tokens, layers, top_k], 'int16': base64}} ({e})") from e
    if len(shape) != 3:
        raise ValueError(f"{where}: routes of shape {shape}, expected [tokens, MoE layers, top_k]")
    return torch.from_numpy(arr.astype(np.int16))
