"""In-flight weight updates (``rollout.in_flight: keep | recompute``, server mode, ``rollout.max_staleness`` >= 1).

Without them the sync after step s waits for the batches launched ahead (``async_prefetch``) before it pushes
theta_s, so every token of a batch has the version it was launched with. With them the sync pushes at once: the
server freezes its running requests, takes theta_s and continues them (``rollout.server_engine.in_flight``), so
one sequence can hold tokens of theta_{s-1} and theta_s, and a batch launched k steps ahead tokens of up to k + 1
versions. What that changes for the trainer:

- **Versions per token.** The server answers which of its weight versions sampled each token
  (``Rollouts.versions``); ``InFlight`` maps them to the trainer's policy versions as they are pushed (theta_v:
  the weights after v optimizer steps), when each batch finishes generating, so a checkpoint's pending batches
  hold policy versions and a resumed run needs no server history.
- **A behaviour policy per version.** Each in-flight sync snapshots theta_s (the LoRA tensors) onto every pending
  batch (``Prefetch.add_behaviour``); the batch is scored once per version present, each token under the weights
  that sampled it (``trainer.off_policy.by_version``): ``parity/*`` stays engine-vs-the-same-weights numerics and
  ``staleness/*`` the lag, per token.
- **Stale KV.** With ``keep`` a token sampled after an update read KV the older weights computed
  (``Rollouts.stale_kv``); the trainer's forward recomputes its whole context under one version, so the engine's
  log-prob of such a token differs by more than numerics. Those tokens are measured apart (``parity/stale_kv/*``)
  and left out of ``parity/*``: what ``keep`` costs in mismatch, beside what it saves in re-prefill.

The cost: one more scoring pass per extra version in a batch, and one LoRA snapshot per in-flight sync while a
pending batch may hold its tokens (full fine-tuning: a copy of the model each).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from trainer.sampling.async_prefetch import Prefetch, snapshot
from trainer.sampling.drawn import Drawn


class InFlight:
    """A run's in-flight syncs: the engine's weight versions as policy versions, the behaviour snapshots."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.policy_version: dict[int, int] = {}  # the engine's weight version -> the trainer's policy version

    def pushed(self, engine, version: int) -> None:
        """The engine now holds policy ``version`` (a sync without pausing: the first one, a resume's)."""
        self.policy_version[engine.weight_version] = version

    def sync(self, push: Callable[[object], dict], engine, policy, prefetch: Prefetch, version: int) -> dict:
        """Push policy ``version`` (the weights just updated) while the launched generations run: ``push``'s
        figures. The snapshot goes onto every pending batch first, and the version number is known before the
        push, so a generation that ends right after it finds both."""
        prefetch.add_behaviour(version, snapshot(policy))
        self.policy_version[engine.weight_version + 1] = version  # a merged push is one engine version
        with engine.in_flight_update():
            out = push(engine)
        if self.policy_version.get(engine.weight_version) != version:
            raise RuntimeError(f"in-flight sync of policy version {version}: the engine is at its weight version "
                               f"{engine.weight_version}, expected one push")
        return out

    def mapped(self, drawn: Drawn) -> Drawn:
        """``drawn`` with its tokens' engine versions as policy versions (an unknown one is an error: the engine
        was updated by something other than this run's syncs)."""
        r = drawn.rollouts
        if not r.versions:
            return drawn
        try:
            versions = [[self.policy_version[v] for v in row] for row in r.versions]
        except KeyError as e:
            raise RuntimeError(f"a sampled token came from the engine's weight version {e.args[0]}, which none of "
                               f"this run's syncs pushed (pushed: {sorted(self.policy_version)})") from None
        return replace(drawn, rollouts=replace(r, versions=versions))
