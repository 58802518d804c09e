"""In-flight weight updates on a server (``rollout.in_flight``): new weights reach vLLM while its requests run.

vLLM's RL routes (``vllm/entrypoints/rl/online/api_router.py``): ``POST /pause?mode=keep`` freezes every running
request where it is (the engine core finishes its step, stops scheduling and empties its output queue:
``EngineCore.pause_scheduler``), the weights are pushed and the version set while nothing samples, and
``POST /resume`` continues the requests. The two modes differ in the KV a continued request reads:

- ``keep``: the KV the old weights computed (PipelineRL's in-flight update). Its tokens after the update are sampled
  by the new weights over a context the old ones encoded (``stale_kv_flags``). The prefix cache cannot be emptied
  while requests hold blocks (``BlockPool.reset_prefix_cache`` refuses; the no-op reset of NeMo-RL PR #3929), so a
  request that starts after the update could read a running request's old prompt KV: a ``keep`` server runs without
  prefix caching (``parityrl serve`` starts it so; the client refuses one that caches).
- ``recompute``: ``POST /reset_prefix_cache?reset_running_requests=true`` preempts every running request
  (``Scheduler.reset_prefix_cache``), so each is prefilled again, prompt and tokens so far, under the new weights
  before it samples on, and the prefix cache is emptied with it (NeMo-RL's KV recompute, done by the scheduler).

The version of every token comes from vLLM itself: the engine core stamps each step's outputs with its weight
version (``EngineCore._attach_weight_version``; versions change only while paused) and the answer carries each
request's spans (``weight_versions``: tokens [start, end) sampled under ``version``), on either model runner.
"""
from __future__ import annotations

from typing import Callable, Optional

from rollout.server_engine.errors import ServerEngineError
from rollout.server_engine.http_channel import _Http

MODES = ("off", "keep", "recompute")


def token_versions(choice: dict, num_tokens: int, number: Callable[[str], Optional[int]], bad) -> list[int]:
    """The weight version of each of a sample's ``num_tokens`` tokens from its answer's spans; ``number`` maps a
    version label to this client's push number (None: not one of this client's complete pushes, an error)."""
    spans = choice.get("weight_versions")
    if not isinstance(spans, list) or not spans:
        raise bad(f"the answer has no weight-version spans for its {num_tokens} tokens (weight_versions = "
                  f"{spans!r:.120}); a vLLM without per-token versions cannot take in-flight updates")
    out: list[int] = []
    for span in spans:
        label, start, end = span.get("version"), span.get("start"), span.get("end")
        n = number(label) if isinstance(label, str) else None
        if n is None:
            raise bad(f"tokens [{start}, {end}) were sampled under weight version {label!r}, not one this trainer "
                      "pushed whole (a push that failed part-way, or another trainer pushing to the same server)")
        if start != len(out) or not isinstance(end, int) or end < start:
            raise bad(f"weight-version spans are not contiguous: {spans!r:.200}")
        out.extend([n] * (end - start))
    if len(out) != num_tokens:
        raise bad(f"weight-version spans cover {len(out)} tokens, the sample has {num_tokens}")
    if any(b < a for a, b in zip(out, out[1:])):
        raise bad(f"weight versions go backwards within the sample: {spans!r:.200}")
    return out


def stale_kv_flags(versions: list[int], mode: str) -> list[int]:
    """1 for each token sampled over KV older weights computed. With ``keep`` a request's prompt KV is the version
    of its prefill, which sampled its first token, and every later token's KV is no older; versions never go down
    within a request, so token t reads stale KV exactly when its version is above the first token's. ``recompute``
    re-prefills every running request after an update: none is."""
    if mode != "keep" or not versions:
        return [0] * len(versions)
    first = versions[0]
    return [int(v > first) for v in versions]


def pause_for_update(http: _Http) -> None:
    """Freeze the running requests (``mode=keep``: they stay scheduled, their KV kept) until ``resume``.

    ``clear_cache=false`` is needed, not a detail: the route's default is true, and although its docstring says
    the flag is ignored with ``keep``, the engine core's ``_finish_pause`` then runs ``_reset_caches`` with
    ``reset_running_requests=True``, which preempts every running request, so that each is re-prefilled under the
    new weights: a ``keep`` that silently recomputes. Measured here: with the default, tokens sampled after the
    push matched a fresh forward of the new weights (MAE 3.6e-3) and not the forward over the old weights' KV
    (0.93 away); tests/rollout/test_in_flight_server.py holds both to it."""
    http.call("POST", "/pause?mode=keep&clear_cache=false", "in-flight update (pause)")


def recompute_running(http: _Http, url: str) -> None:
    """Preempt every running request so that each is prefilled again under the weights just pushed; the prefix
    cache is emptied with it. An answer other than success is an error: the requests would go on over old KV."""
    out = http.call("POST", "/reset_prefix_cache?reset_running_requests=true", "in-flight update (recompute)")
    if not (out or {}).get("success"):
        raise ServerEngineError(f"vLLM server at {url} did not preempt its running requests after an in-flight "
                                f"update (answered {out!r:.200}); they would continue on the old weights' KV")


def resume_after_update(http: _Http) -> None:
    http.call("POST", "/resume", "in-flight update (resume)")
