"""Routes from vLLM's V1 model runner: the expert ids every MoE layer's router chose, per request and position.

vLLM's own ``enable_return_routed_experts`` needs Model Runner V2 (its AuxOutput connector), which the CPU
build cannot run. The V1 runner's routers still expose a hook: ``BaseRouter.set_capture_fn``
(``fused_moe/router/base_router.py``) is called with the top-k ids [tokens, k] of every forward, before any
expert-parallel remapping (logical ids). What the hook does not say is which request and position each row
is; that is the runner's batch layout at the time of the forward, read here around ``_model_forward``:

* ``input_batch.req_ids[:num_reqs]``: the requests of the step, in batch order;
* ``query_start_loc.np[:num_reqs + 1]``: where each request's rows start (``_prepare_inputs``);
* the ``positions`` argument: each row's position in its sequence (prefill rows and decode rows alike).

A request's routes are kept as (positions, ids) chunks until ``take_routes`` assembles them into the
[positions, MoE layers, k] layout of ``rollout.routes`` (``NO_ROUTE`` where nothing was computed: the last
sampled token, and any prefix-cache hit -- which is why an engine that returns routes runs with prefix
caching off, ``rollout.vllm_engine``). A preempted request that is recomputed overwrites its positions.

The functions run in the worker: in-process through ``LLM.collective_rpc`` (the colocated engine) or through
the server's worker extension (``server_transfer.ParityrlWorkerExtension``). Request ids: vLLM's engine
suffixes every request id with 8 random characters (``input_processor.assign_request_id``), and the server's
token route prefixes it (``generate-tokens-``); ``take_routes`` is given the ids the caller chose and matches
them through those rules. A request whose routes are never taken (one the caller abandoned) stays until the
next ``reset_routes``: every colocated ``generate``, every trainer connecting to a server.
"""
from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from rollout.routes import NO_ROUTE, ROUTE_DTYPE

__all__ = ["RouteRecorder", "install_route_capture", "reset_routes", "take_routes"]

ATTR = "_parityrl_routes"


class RouteRecorder:
    """Per request, the routes of the positions the engine computed since ``reset``."""

    def __init__(self, layer_ids: Sequence[int], top_k: int, num_experts: int) -> None:
        self.layer_of = {lid: i for i, lid in enumerate(sorted(layer_ids))}  # vLLM decoder layer -> MoE ordinal
        self.top_k, self.num_experts = int(top_k), int(num_experts)
        self.chunks: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.step = None  # (request ids, row starts, positions, ids [rows, L, k]) during a forward

    @property
    def num_layers(self) -> int:
        return len(self.layer_of)

    def begin(self, req_ids: list[str], starts: list[int], positions: torch.Tensor) -> None:
        rows = starts[-1]
        # a copy: on CPU .to() would alias the runner's positions buffer, which the next step overwrites
        self.step = (req_ids, starts, positions[:rows].to("cpu", torch.long, copy=True),
                     torch.full((rows, self.num_layers, self.top_k), NO_ROUTE, dtype=ROUTE_DTYPE))

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.step is None:  # a warm-up or profiling forward: no request to attribute it to
            return
        ids = self.step[3]
        ids[:, self.layer_of[layer_id]] = topk_ids[:ids.shape[0]].to("cpu", ROUTE_DTYPE)

    def end(self) -> None:
        req_ids, starts, positions, ids = self.step
        self.step = None
        for i, rid in enumerate(req_ids):
            lo, hi = starts[i], starts[i + 1]
            if hi > lo:
                self.chunks.setdefault(rid, []).append((positions[lo:hi], ids[lo:hi]))

    def take(self, request_id: str, length: int) -> torch.Tensor:
        """The routes [length, L, k] of the request the caller named ``request_id`` (forgotten afterwards)."""
        out = torch.full((length, self.num_layers, self.top_k), NO_ROUTE, dtype=ROUTE_DTYPE)
        for key in [k for k in self.chunks if _names(k, request_id)]:
            for pos, ids in self.chunks.pop(key):
                keep = pos < length
                out[pos[keep]] = ids[keep]
        return out


def _names(key: str, request_id: str) -> bool:
    """Whether the engine's request id ``key`` is the caller's ``request_id``: the same, or with the engine's
    random suffix, behind a route's prefix (the server's token route: ``generate-tokens-<id>``)."""
    base = key.rsplit("-", 1)[0]
    return request_id in (key, base) or base.endswith("-" + request_id)


def _runner(worker):
    return getattr(worker, "worker", worker).model_runner


def install_route_capture(worker) -> dict:
    """Hook every MoE router of the worker's model and its runner's forward (once); returns the routes'
    shape: ``{"layers": L, "top_k": k, "num_experts": E}``. ``ValueError`` for a model without a hookable
    MoE router."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    runner = _runner(worker)
    recorder = getattr(runner, ATTR, None)
    if recorder is None:
        moe = [m for m in runner.get_model().modules() if isinstance(m, MoERunner)]
        if not moe:
            raise ValueError("routes: the engine's model has no mixture-of-experts layer")
        bad = [type(m.router).__name__ for m in moe if not isinstance(m.router, BaseRouter)]
        if bad:
            raise ValueError(f"routes: vLLM router {bad[0]} has no capture hook (BaseRouter.set_capture_fn)")
        first = moe[0].router
        recorder = RouteRecorder([m.layer_id for m in moe], first.top_k, first.global_num_experts)
        for m in moe:
            m.router.set_capture_fn(partial(recorder.capture, m.layer_id))
        forward = runner._model_forward

        def recorded_forward(*args, **kwargs):
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            n = runner.input_batch.num_reqs
            recorder.begin(list(runner.input_batch.req_ids[:n]), runner.query_start_loc.np[:n + 1].tolist(),
                           positions)
            try:
                return forward(*args, **kwargs)
            finally:
                recorder.end()

        runner._model_forward = recorded_forward
        setattr(runner, ATTR, recorder)
    return {"layers": recorder.num_layers, "top_k": recorder.top_k, "num_experts": recorder.num_experts}


def reset_routes(worker) -> None:
    """Forget every request's routes (a new batch of requests starts)."""
    getattr(_runner(worker), ATTR).chunks.clear()


def take_routes(worker, requests: Sequence[tuple[str, int]]) -> list[torch.Tensor]:
    """The routes of each (request id, sequence length), in order."""
    recorder = getattr(_runner(worker), ATTR)
    return [recorder.take(rid, n) for rid, n in requests]
