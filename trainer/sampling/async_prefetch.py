"""One step off-policy rollouts (``rollout.max_staleness: 1``): batch k+1 is generated while batch k trains.

Order of a step k with staleness 1 (the weights of the engine change only at syncs, as with 0):

    take batch k (generated with theta_{k-2}) -> launch batch k+1 on the engine (theta_{k-1})
    -> score batch k under its behaviour adapter theta_{k-2} and under theta_{k-1} -> update -> theta_k
    -> wait for batch k+1 -> sync theta_k -> probe

so generation of k+1 overlaps scoring and the update of k. In server mode the launch runs in a
thread and the server (another process) generates while this process trains: real overlap. With a
colocated engine the same batch is generated inline, before the update: the same weights
generate the same batches, with nothing overlapped (one process's cores do both) — it keeps the
off-policy semantics testable without a server.

The behaviour policy of a batch is the adapter the engine held when it was launched; with LoRA
it is a copy of the trainable tensors (``snapshot``), restored around a no-grad scoring pass
(``behaviour_weights``). That splits the mismatch (``trainer.rl.loop.score_phase``):
``parity/*`` = engine vs the trainer under the behaviour adapter (same weights: numerics only),
``staleness/*`` = behaviour vs current adapter in the trainer (policy lag only). The loss's ratio is
pi_theta / pi_behaviour (the trainer's; clipped as PPO's), so the update is the standard
off-policy surrogate; the corrections (``parity.correction``) act on engine vs behaviour (numerics), as in the
synchronous loop.

A checkpoint after step k holds the pending batch k+1 and its behaviour adapter (``state_dict``),
so a resumed run trains on exactly what the uninterrupted one would.
"""
from __future__ import annotations

import base64
import contextlib
import threading
from dataclasses import asdict, replace
from typing import Callable, Optional

import torch

from rollout.routes import decode_routes, encode_routes
from rollout.support import decode_supports, encode_supports
from rollout.types import Rollouts
from trainer.sampling.drawn import Drawn


def snapshot(model) -> dict[str, torch.Tensor]:
    """Copies of the trainable tensors (the LoRA adapter): the behaviour policy of a batch launched now."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@contextlib.contextmanager
def behaviour_weights(model, state: Optional[dict[str, torch.Tensor]]):
    """The model with ``state``'s values in its trainable tensors; the current ones restored after."""
    if state is None:
        yield model
        return
    params = dict(model.named_parameters())
    saved = {n: params[n].detach().clone() for n in state}
    with torch.no_grad():
        for n, t in state.items():
            params[n].copy_(t)
    try:
        yield model
    finally:
        with torch.no_grad():
            for n, t in saved.items():
                params[n].copy_(t)


class Prefetch:
    """The next step's batch: launched after this step's batch is taken, waited for before the sync."""

    def __init__(self) -> None:
        self.step: Optional[int] = None
        self.behaviour: Optional[dict[str, torch.Tensor]] = None
        self._drawn = None
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None

    def launch(self, step: int, draw: Callable[[], object], behaviour: dict[str, torch.Tensor], *,
               threaded: bool) -> None:
        if self.step is not None:
            raise RuntimeError(f"a batch for step {self.step} is already pending")
        self.step, self.behaviour, self._drawn, self._error = step, behaviour, None, None

        def work() -> None:
            try:
                self._drawn = draw()
            except BaseException as e:  # noqa: BLE001 - re-raised in the training thread by wait()
                self._error = e

        if threaded:
            self._thread = threading.Thread(target=work, name=f"parityrl-rollout-{step}", daemon=True)
            self._thread.start()
        else:
            work()

    def wait(self) -> None:
        """Block until the pending batch is generated (before the engine's weights change).

        A failure is kept for ``take``: it belongs to the step that trains on the batch, which then
        stops before its update (the checkpoint is the step before: trainer/lifecycle/stops.py).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take(self, step: int):
        """(Drawn, behaviour adapter) of ``step`` if it was prefetched, else None; raises its generation's error."""
        if self.step != step:
            return None
        self.wait()
        if self._error is not None:
            error, self._error, self.step, self.behaviour = self._error, None, None, None
            raise error
        out = (self._drawn, self.behaviour)
        self.step, self.behaviour, self._drawn = None, None, None
        return out

    # ---- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> Optional[dict]:
        """The pending batch and its behaviour adapter (JSON: tensors as base64 of their bytes), or None."""
        self.wait()
        if self.step is None or self._error is not None:
            return None  # a failed generation is drawn again on resume (from the prompts after it)
        d = self._drawn
        rollouts = {**asdict(replace(d.rollouts, routes=[], support=[])),
                    "routes": [encode_routes(r) for r in d.rollouts.routes],
                    "support": encode_supports(d.rollouts.support)}
        return {"step": self.step,
                "drawn": {"rows": d.rows, "rollouts": rollouts, "rewards": d.rewards, "per_fn": d.per_fn},
                "behaviour": {n: _encode(t) for n, t in self.behaviour.items()}}

    def load_state_dict(self, state: Optional[dict]) -> None:
        if not state:
            return
        d = state["drawn"]
        self.step = int(state["step"])
        rollouts = {**d["rollouts"], "routes": [decode_routes(r, "the checkpoint's pending batch")
                                                for r in d["rollouts"].get("routes", [])],
                    "support": decode_supports(d["rollouts"].get("support", []))}
        self._drawn = Drawn(rows=d["rows"], rollouts=Rollouts(**rollouts), rewards=d["rewards"],
                            per_fn=d["per_fn"])
        self.behaviour = {n: _decode(v) for n, v in state["behaviour"].items()}


def _encode(t: torch.Tensor) -> dict:
    t = t.detach().cpu().contiguous()
    raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "data": base64.b64encode(raw).decode("ascii")}


def _decode(d: dict) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    raw = bytearray(base64.b64decode(d["data"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(d["shape"]).clone()
