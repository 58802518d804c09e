"""Routes from vLLM's V1 model runner: the expert ids every MoE layer's router chose, per request and position.

vLLM's own ``enable_return_routed_experts`` needs Model Runner V2 (its AuxOutput connector), which the CPU
build cannot run. The V1 runner's routers still expose a hook: ``BaseRouter.set_capture_fn``
(``fused_moe/router/base_router.py``) is called with the top-k ids [tokens, k] of every forward, before any
expert-parallel remapping (logical ids). What the hook does not say is which request and position each row
is; that is the runner's batch layout at the time of the forward, read here around ``_model_forward``:

* ``input_batch.req_ids[:num_reqs]``: the requests of the step, in batch order;
* ``query_start_loc.np[:num_reqs + 1]``: where each request's rows start (``_prepare_inputs``);
* the ``positions`` argument: each row's position in its sequence (prefill rows and decode rows alike).

The rows are kept per forward until ``take_routes`` assembles each request's into the
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

from rollout.moe_config import route_shape
from rollout.routes import NO_ROUTE, ROUTE_DTYPE

__all__ = ["RouteRecorder", "install_route_capture", "request_names", "reset_routes", "take_routes"]

ATTR = "_parityrl_routes"


class RouteRecorder:
    """Per request, the routes of the positions the engine computed since ``reset``.

    Each forward's rows stay one record (request index, position, ids per row): the bookkeeping per decoding
    step is a few tensor operations whatever the batch, and ``take`` sorts every row to its request at once
    (a Python loop over requests and steps costs more than the capture itself)."""

    def __init__(self, layer_ids: Sequence[int], top_k: int, num_experts: int) -> None:
        self.layer_of = {lid: i for i, lid in enumerate(sorted(layer_ids))}  # vLLM decoder layer -> MoE ordinal
        self.top_k, self.num_experts = int(top_k), int(num_experts)
        self.step = None  # (row request indices, positions, ids [rows, L, k]) during a forward
        self.reset()

    @property
    def num_layers(self) -> int:
        return len(self.layer_of)

    def reset(self) -> None:
        self.index: dict[str, int] = {}  # the engine's request id -> its number in the records
        self.records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def begin(self, req_ids: list[str], starts: list[int], positions: torch.Tensor) -> None:
        rows = starts[-1]
        numbers = torch.tensor([self.index.setdefault(r, len(self.index)) for r in req_ids], dtype=torch.long)
        counts = torch.tensor(starts[1:], dtype=torch.long) - torch.tensor(starts[:-1], dtype=torch.long)
        # a copy: on CPU .to() would alias the runner's positions buffer, which the next step overwrites
        self.step = (numbers.repeat_interleave(counts), positions[:rows].to("cpu", torch.long, copy=True),
                     torch.full((rows, self.num_layers, self.top_k), NO_ROUTE, dtype=ROUTE_DTYPE))

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.step is None:  # a warm-up or profiling forward: no request to attribute it to
            return
        ids = self.step[2]
        ids[:, self.layer_of[layer_id]] = topk_ids[:ids.shape[0]].to("cpu", ROUTE_DTYPE)

    def end(self) -> None:
        if self.step[0].numel():
            self.records.append(self.step)
        self.step = None

    def take(self, requests: Sequence[tuple[str, int]]) -> list[torch.Tensor]:
        """The routes [length, L, k] of each (caller's request id, length), in order; those requests' rows are
        forgotten afterwards."""
        if not self.records:
            return [self._empty(n) for _, n in requests]
        req, pos, ids = (torch.cat(x) for x in zip(*self.records))
        order = torch.sort(req, stable=True).indices  # stable: a recomputed (preempted) position comes later
        req, pos, ids = req[order], pos[order], ids[order]
        ends = torch.bincount(req, minlength=len(self.index)).cumsum(0).tolist()
        names = request_names(self.index)
        out, taken = [], []
        for rid, n in requests:
            number = names.get(rid)
            r = self._empty(n)
            if number is not None:
                lo, hi = (ends[number - 1] if number else 0), ends[number]
                p = pos[lo:hi]
                keep = p < n
                r[p[keep]] = ids[lo:hi][keep]
                taken.append(number)
            out.append(r)
        if taken:
            rest = ~torch.isin(req, torch.tensor(taken, dtype=torch.long))
            self.records = [(req[rest], pos[rest], ids[rest])] if bool(rest.any()) else []
        return out

    def _empty(self, n: int) -> torch.Tensor:
        return torch.full((n, self.num_layers, self.top_k), NO_ROUTE, dtype=ROUTE_DTYPE)


def request_names(index: dict[str, int]) -> dict[str, int]:
    """Every name a caller may use for an engine request id -> its number: the id, the id without the engine's
    random suffix, and that behind any route prefix (``generate-tokens-<id>``); the full id itself wins."""
    table: dict[str, int] = {}
    for key, number in index.items():
        base = key.rsplit("-", 1)[0]
        parts = base.split("-")
        for i in range(1, len(parts)):  # behind a route's prefix: generate-tokens-<id>
            table.setdefault("-".join(parts[i:]), number)
        table[base] = number
    for key, number in index.items():
        table[key] = number
    return table


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
        # Model Runner V2 (vllm/v1/worker/gpu/model_runner.py, the CUDA default) has none of these: its routes are
        # vLLM's own enable_return_routed_experts (rollout.vllm_engine.route_options)
        missing = [a for a in ("_model_forward", "input_batch", "query_start_loc") if not hasattr(runner, a)]
        if missing:
            raise ValueError(f"routes: vLLM's {type(runner).__module__}.{type(runner).__name__} has no {missing[0]}: "
                             "the project's route capture hooks the V1 model runner only (vLLM's CPU backend)")
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
    return route_shape(recorder.num_layers, recorder.top_k, recorder.num_experts)


def reset_routes(worker) -> None:
    """Forget every request's routes (a new batch of requests starts)."""
    getattr(_runner(worker), ATTR).reset()


def take_routes(worker, requests: Sequence[tuple[str, int]]) -> list[torch.Tensor]:
    """The routes of each (request id, sequence length), in order."""
    return getattr(_runner(worker), ATTR).take(requests)
