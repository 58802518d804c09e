"""What the server's workers record beside the answers: an MoE model's routes and truncated sampling's kept sets
(package docstring, Truncated sampling); a server on CUDA can give neither."""
from __future__ import annotations

import json

import torch

from rollout.routes import NO_ROUTE, decode_routes
from rollout.server_engine.errors import ServerEngineError
from rollout.server_engine.http_channel import _Http
from rollout.support import Support, decode_supports

# Why a CUDA server cannot return routes, and what to do (said by the client and by `parityrl serve`).
SERVER_ROUTES_ON_CUDA = (
    "on CUDA vLLM runs Model Runner V2, which lacks the V1-runner internals the project's capture hooks "
    "(rollout/vllm_plugins/route_capture.py), and vLLM's own routes (enable_return_routed_experts) are not in "
    "its HTTP answers; train with rollout.mode: colocate (routes from vLLM's own capture) or set "
    "parity.routing_replay: off")


# Why a CUDA server cannot return the kept sets of truncated sampling, and what to do.
SERVER_SUPPORTS_ON_CUDA = (
    "the sets of tokens top-p / top-k / min-p kept come from a server on CPU only: on CUDA vLLM runs Model Runner V2, "
    "which the project's capture (rollout/vllm_plugins/support_capture.py) cannot hook, and vLLM's own sampling "
    "masks (return_sampling_mask) are not in its HTTP answers; train with rollout.mode: colocate (the masks from "
    "vLLM itself) or without truncation (rollout.top_p 1, top_k 0, min_p 0)")


def take_supports(http: _Http, requests: list[tuple[str, int]]) -> list[Support]:
    """The kept sets of each (request id, completion length) from the server's workers (rank 0's: every rank
    of a tensor-parallel group samples the same tokens); a missing or malformed answer is an error."""
    out = http.call("POST", "/collective_rpc", "sampling supports of samples",
                    json={"method": "parityrl_take_supports", "args": [json.dumps(requests)]})
    try:
        supports = decode_supports(out["results"][0])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise ServerEngineError(f"vLLM server at {http.url}: asked for the kept sets of {len(requests)} samples, "
                                f"it answered {out!r:.300} ({type(e).__name__}: {e})") from None
    if [s.offsets.numel() - 1 for s in supports] != [n for _, n in requests]:
        raise ServerEngineError(f"vLLM server at {http.url}: kept sets for {len(supports)} samples of lengths "
                                f"{[s.offsets.numel() - 1 for s in supports][:8]}, expected {len(requests)} of "
                                f"{[n for _, n in requests][:8]}")
    return supports


def take_routes(http: _Http, requests: list[tuple[str, int]], what: str,
                route_shape: dict[str, int]) -> list[torch.Tensor]:
    """The routes of each (request id, sequence length) from the server's workers (rank 0's: every rank of a
    tensor-parallel group routes the same tokens); an answer without them is an error, never a fallback."""
    out = http.call("POST", "/collective_rpc", f"routes of {what}",
                    json={"method": "parityrl_take_routes", "args": [json.dumps(requests)]})
    results = out.get("results") if isinstance(out, dict) else None
    got = results[0] if isinstance(results, list) and results else None
    if not isinstance(got, list) or len(got) != len(requests):
        raise ServerEngineError(f"vLLM server at {http.url}: asked for the routes of {len(requests)} {what}, it "
                                f"answered {out!r:.300}")
    shape = (route_shape["layers"], route_shape["top_k"])
    routes = []
    for (rid, n), enc in zip(requests, got):
        r = decode_routes(enc, f"vLLM server at {http.url}, routes of request {rid}")
        if tuple(r.shape) != (n, *shape):
            raise ServerEngineError(f"vLLM server at {http.url}: routes of request {rid} have shape "
                                    f"{tuple(r.shape)}, expected ({n}, {shape[0]}, {shape[1]})")
        if n > 1 and bool((r[:n - 1] == NO_ROUTE).all()):
            raise ServerEngineError(f"vLLM server at {http.url}: request {rid} came back without routes (the "
                                    "server's route capture saw none of its tokens)")
        routes.append(r)
    return routes
