"""Routing, for a mixture-of-experts model: per MoE layer, the share of tokens whose top-k experts in the trainer's
forward are the engine's (as sets: the order of the top-k does not change the layer's output), and whether the engine
recorded every token's routes. A token whose experts differ gets an entirely different MLP output at that layer, far
beyond any rounding: where the experts differ, that is the cause of a divergence, not the MLP's weights.

Both sides on the same ids, one prefill per sequence (the fixed batch's first ``NUM_SEQUENCES``, as the layers check):

- engine: the experts each of vLLM's MoE layers chose, read at the router (``BaseRouter.set_capture_fn``, called with
  the top-k ids [rows, k] of every forward, before any expert-parallel remapping; ``fused_moe/router/base_router.py``)
  while ``engine.score`` runs the sequence alone; any capture already installed (the project's route capture,
  ``rollout.vllm_plugins.route_capture``) still receives them. With the recipe's ``parity.routing_replay`` on or
  measure the engine also returns its routes (``Scored.routes``): what training gives the trainer to replay.
- trainer: ``doc.model`` with the recipe's routing, as training runs it (``Doctor.routing``): with replay its routers
  are given the routes the engine returned, and the experts the forward used are read at each router's output
  (``rollout.hf_routes.RouterTap``), beside the router's own top-k (``RoutingReplay.own``).

Verdicts per MoE layer: the experts used agree on every token: PASS. With replay they must (the trainer was given the
engine's): otherwise FAIL, the routes replayed are not the engine's. Without replay a few tokens differ in a healthy
setup (near-ties of the router logits, broken differently by the two sides' roundings): WARN, naming routing as the
cause and replay as the fix. Either way, a router whose own top-k agrees on fewer than ``OWN_LEVEL`` of the tokens is
not near-ties but another router: FAIL, naming the layer.

On CUDA (written, not run here): the capture runs inside the router's forward, which a replayed CUDA graph skips, so the
engine must run eagerly (``enforce_eager``), as for the layers check.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch

from parity.routing import routing_stats
from rollout.hf_routes import RouterTap
from rollout.moe_config import moe_shape
from rollout.vllm_engine import VLLMEngine
from trainer.doctor.context import Doctor
from trainer.doctor.records import FAIL, PASS, WARN, Check, CheckCannotRun, Finding, skipped
from trainer.models.routing_replay import attached_replay

NAME = "routing"
NUM_SEQUENCES = 4  # the layers check's sequences: its divergence and these agreements are read on the same tokens
# A router's own top-k agreeing with the engine's on fewer than this share of a layer's tokens is not near-ties.
# Healthy bf16 routers differ on a few percent of the tokens (the zoo's Qwen3-MoE, top-2 of 8 at std 0.2, without
# replay: 0 and 1.1% on its two layers, docs/doctor.md; R3, arXiv 2510.11370: about 10% of the router decisions of
# Qwen3-30B-A3B); 0.8 leaves twice the largest of those, while a router whose weights differ by half their spread on
# one side agrees on 0.57 (tests/doctor/moe_doctor_cases.py).
OWN_LEVEL = 0.8
MAX_LAYER_ROWS = 8  # a model with more MoE layers gets a summary row and the layers that did not pass


def _moe_runners(engine: VLLMEngine) -> list:
    """vLLM's MoE layers of the engine's model, in layer order (``MoERunner.layer_id``)."""
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner  # late: vLLM's own classes

    model = engine.llm.apply_model(lambda m: m)[0]
    return sorted((m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id)


@dataclass
class EngineRoutes:
    """Per sequence: ``chosen`` [n, L, k] the experts the engine's routers chose (long), ``returned`` [n, L, k] the
    routes the engine returned with the scoring (None: it returns none); ``layers``: each MoE layer's decoder layer."""

    chosen: list[torch.Tensor]
    returned: list[Optional[torch.Tensor]]
    layers: tuple[int, ...]


def engine_routes(engine: VLLMEngine, seqs: list[list[int]]) -> EngineRoutes:
    """The engine's experts for each sequence, from one prefill each (``engine.score`` of that sequence alone)."""
    runners = _moe_runners(engine)
    if not runners:
        raise CheckCannotRun("the engine's model has no vLLM MoE layer (MoERunner) to read the experts of")
    calls: dict[int, list[torch.Tensor]] = {m.layer_id: [] for m in runners}
    previous = [(m.router, m.router.capture_fn) for m in runners]

    def capture(layer_id, before):
        def fn(topk_ids: torch.Tensor) -> None:
            calls[layer_id].append(topk_ids.detach().to("cpu", torch.long, copy=True))
            if before is not None:
                before(topk_ids)
        return fn

    chosen, returned = [], []
    try:
        for m, (_, before) in zip(runners, previous):
            m.router.set_capture_fn(capture(m.layer_id, before))
        for seq in seqs:
            for c in calls.values():
                c.clear()
            scored = engine.score([seq])
            if any(len(c) != 1 for c in calls.values()):
                raise RuntimeError(f"one score() call ran {max(map(len, calls.values()))} forwards through an MoE "
                                   "layer; expected one prefill")
            chosen.append(torch.stack([calls[m.layer_id][0][:len(seq)] for m in runners], 1))
            returned.append(scored.routes[0].long() if scored.routes else None)
    finally:
        for router, before in previous:
            router.set_capture_fn(before)
    return EngineRoutes(chosen, returned, tuple(int(m.layer_id) for m in runners))


@dataclass
class TrainerRoutes:
    """What the trainer's forwards on the sequences used, filled while ``trainer_routing`` is open: per sequence
    ``used`` and ``own`` [n, L, k] (None until its forward ran)."""

    engine: EngineRoutes
    replayed: bool = False  # the trainer was given the engine's routes (parity.routing_replay on)
    used: list[Optional[torch.Tensor]] = field(default_factory=list)
    own: list[Optional[torch.Tensor]] = field(default_factory=list)

    def agreement(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(used [L], own [L]): per MoE layer the share of tokens whose experts agree with the engine's, over every
        position of the sequences the trainer ran; and the number of tokens."""
        ran = [j for j, u in enumerate(self.used) if u is not None]
        if not ran:
            raise RuntimeError("the trainer's forward ran on none of the sequences the engine routed")
        eng = torch.cat([self.engine.chosen[j] for j in ran])
        valid = torch.ones(eng.shape[0], dtype=torch.bool)
        out = []
        for mine in (self.used, self.own):
            s = routing_stats(eng, torch.cat([mine[j] for j in ran]), valid)
            out.append(s["agree_by_layer"] / s["tokens"])
        return out[0], out[1], int(eng.shape[0])

    def cause(self, depth: float) -> Optional[str]:
        """The routing cause of a divergence first seen at ``depth`` (the layers check's ``Point.depth``: inside
        decoder layer ceil(depth) - 1): the earliest MoE layer up to there whose experts differ; None if none do."""
        used, _, _ = self.agreement()
        for d, share in zip(self.engine.layers, used.tolist()):
            if d <= math.ceil(depth) - 1 and share < 1.0:
                return differ_cause(d, share, replayed=self.replayed)
        return None


def differ_cause(layer: int, share: float, *, replayed: bool) -> str:
    """The experts chosen differ at ``layer`` on 1 - ``share`` of the tokens: the cause, in one line."""
    if replayed:
        return (f"the experts chosen differ: with parity.routing_replay on, layer {layer} still used other experts "
                f"than the engine's on {1 - share:.1%} of the tokens: the routes replayed are not the engine's "
                "(misaligned positions or layers, or missing: see 'routes recorded')")
    return (f"the experts chosen differ: at layer {layer} the trainer's router picked other experts than the engine's "
            f"on {1 - share:.1%} of the tokens (near-ties of the router logits broken differently by the two sides' "
            "roundings; each such token's MLP output is another expert's), not the MLP's weights: "
            "parity.routing_replay: on makes the trainer use the engine's experts")


def router_cause(layer: int, own: float) -> str:
    return (f"layer {layer}'s router chooses other experts than the engine's on {1 - own:.0%} of the tokens (its own "
            f"top-k; near-ties flip a few percent): its weights (mlp.gate) differ between the two sides, or its "
            "softmax / top-k / normalisation (norm_topk_prob), or the hidden states reaching it (see the layers check)")


@contextlib.contextmanager
def trainer_routing(doc: Doctor, seqs: list[list[int]], engine: Optional[EngineRoutes] = None
                    ) -> Iterator[Optional[TrainerRoutes]]:
    """While open, each forward of ``doc.model`` on one of ``seqs`` (a batch of that one sequence) runs with the
    recipe's routing: with replay its routers are given the routes the engine returned for it; the experts it used
    and its routers' own top-k are recorded. Yields None for a dense model (nothing routes)."""
    model = doc.model
    if moe_shape(model.config) is None:
        yield None
        return
    engine = engine if engine is not None else engine_routes(doc.engine, seqs)
    replay = attached_replay(model)
    out = TrainerRoutes(engine, replay is not None and doc.routing == "replay", [None] * len(seqs), [None] * len(seqs))
    index = {tuple(s): j for j, s in enumerate(seqs)}
    current: list[Optional[int]] = [None]

    def before(_m, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        j = index.get(tuple(ids[0].tolist())) if ids is not None and ids.shape[0] == 1 else None
        current[0] = j
        if replay is not None:
            given = engine.returned[j] if j is not None and out.replayed else None
            replay.set_routes(None if given is None else given[None])

    def after(_m, _a, _o):
        j = current[0]
        if j is not None:
            out.used[j] = torch.stack([c[-1] for c in tap.calls], 1).long()
            out.own[j] = out.used[j] if replay is None else torch.stack(replay.own, 1).cpu().long()
        for c in tap.calls:
            c.clear()
        if replay is not None:
            replay.clear()

    with RouterTap(model) as tap:
        handles = [model.register_forward_pre_hook(before, with_kwargs=True), model.register_forward_hook(after)]
        try:
            yield out
        finally:
            for h in handles:
                h.remove()
            if replay is not None:
                replay.clear()


# ---- the check ----------------------------------------------------------------------------------
def layer_finding(layer: int, used: float, own: float, *, replayed: bool, details: dict) -> Finding:
    """One MoE layer's verdict (module docstring): the router's own choice first, then the experts used."""
    if own < OWN_LEVEL:
        return Finding(NAME, f"layer {layer}: router's own top-k agree", own, f">= {OWN_LEVEL:g}", FAIL,
                       router_cause(layer, own), details)
    expected = "== 1 (replayed)" if replayed else "== 1"
    if used >= 1.0:
        return Finding(NAME, f"layer {layer}: experts agree", used, expected, PASS, details=details)
    return Finding(NAME, f"layer {layer}: experts agree", used, expected, FAIL if replayed else WARN,
                   differ_cause(layer, used, replayed=replayed), details)


def completeness(doc: Doctor) -> Finding:
    """The share of the fixed batch's (token, MoE layer) slots the engine returned a route for, over each sample's
    positions but its last sampled token (never fed back to the engine: ``rollout.routes``)."""
    item = "routes recorded: every token, every MoE layer"
    if doc.routing == "off":
        return skipped(NAME, item, "parity.routing_replay is off: the engine returns no routes and the trainer's "
                                   "routers choose (the experts below are the two routers' own)")
    routes = doc.batch().routes
    if not routes:
        return Finding(NAME, item, 0.0, "== 1", FAIL, f"parity.routing_replay resolves to {doc.routing!r} but the "
                                                      "engine returned no routes with its rollouts: it must be "
                                                      "started with return_routes=True")
    slots = torch.cat([(r[:-1] >= 0).all(-1).flatten() for r in routes])
    share = float(slots.double().mean()) if slots.numel() else 0.0
    return Finding(NAME, item, share, "== 1", PASS if share == 1.0 else FAIL,
                   "" if share == 1.0 else f"the engine returned no route for {int((~slots).sum())} of "
                                           f"{slots.numel()} token-layer slots: there the trainer's routers choose "
                                           "instead of replaying (a prefix-cache hit, a capture that missed a forward)",
                   {"slots": int(slots.numel())})


def _refuse(doc: Doctor) -> VLLMEngine:
    if moe_shape(doc.model.config) is None:
        raise CheckCannotRun(f"{doc.model.config.model_type}: not a mixture-of-experts model of a family routing "
                             "replay supports (rollout.moe_config.MOE_FAMILIES): nothing routes")
    engine = doc.engine
    if not isinstance(engine, VLLMEngine):
        raise CheckCannotRun(f"the {type(engine).__name__} does not run vLLM's routers in this process: reading the "
                             "engine's experts needs the colocated vLLM engine (rollout.engine: vllm)")
    if not engine.llm.model_config.enforce_eager:
        raise CheckCannotRun("the engine runs CUDA graphs, where the router's capture does not run: start it with "
                             "enforce_eager to read its experts")
    return engine


def run(doc: Doctor) -> list[Finding]:
    engine = _refuse(doc)
    batch = doc.batch()
    seqs = [list(p) + list(c) for p, c in zip(batch.prompt_ids[:NUM_SEQUENCES], batch.completion_ids[:NUM_SEQUENCES])]
    with trainer_routing(doc, seqs, engine_routes(engine, seqs)) as routes, torch.no_grad():
        for seq in seqs:
            doc.model(input_ids=torch.tensor([seq], device=next(doc.model.parameters()).device))
    used, own, tokens = routes.agreement()
    replayed = routes.replayed
    rows = []
    for d, u, o in zip(routes.engine.layers, used.tolist(), own.tolist()):
        doc.say(f"  layer {d}: experts agree on {u:.4f} of {tokens} tokens (the router's own top-k: {o:.4f})")
        rows.append(layer_finding(d, u, o, replayed=replayed, details={"used": u, "own": o, "tokens": tokens,
                                                                        "routing": doc.routing}))
    out = [completeness(doc)]
    if len(rows) <= MAX_LAYER_ROWS:
        return out + rows
    order = {PASS: 0, WARN: 1, FAIL: 2}
    worst = max(rows, key=lambda f: order[f.verdict])
    lowest = int(used.argmin())
    summary = Finding(NAME, f"experts agree, {len(rows)} MoE layers: lowest (layer {routes.engine.layers[lowest]})",
                      float(used.min()), "== 1", worst.verdict, worst.cause,
                      {"used": used.tolist(), "own": own.tolist(), "layers": list(routes.engine.layers)})
    return out + [summary] + [f for f in rows if f.verdict != PASS][:MAX_LAYER_ROWS]


CHECK = Check(NAME, "do the engine and the trainer choose the same experts (with the recipe's routing replay)?", run,
              hooks_engine=True)
