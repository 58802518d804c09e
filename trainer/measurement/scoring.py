"""The trainer's scores of a batch's completion tokens: one forward per micro-batch, gathered into ``Scores``.

One loop for every consumer, so that all of them measure the same computation: the step's pi_old
(``trainer.rl.update.score_pass``), the parity probe (``trainer.measurement.probe``) and `parityrl compare`.
The update passes, which need gradients, call the same ``forward`` and fill the same ``Scores``.

A forward is ``completion_hidden`` (the backbone, and PPO's critic on the same hidden states),
then the chunked fused kernel for log-probs, entropy and the log-probs of the engine's top-k ids.
``exact`` (``trainer.models.exact.ExactLogprobs``, for a precision recipe whose log-probs are the
engine's own forward) replaces those numbers by the engine's own; gradients stay this forward's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from trainer.measurement.micro_batches import micro_batch_rows
from trainer.models.batch import TokenBatch
from trainer.models.policy import completion_hidden, completion_logprobs, logprobs_from_hidden
from trainer.models.routing_replay import attached_replay

# How often (seconds) a long scoring reports its progress.
PROGRESS_EVERY_S = 10


@dataclass
class Scores:
    """Per-token trainer outputs of a whole batch [S, C] (0 where nothing was scored), detached.

    ``topk`` [S, C, k]: the trainer's log-probs of the engine's top-k ids (when the batch has them);
    ``values``: PPO's critic; ``ref_logprobs``: the reference policy (the base model, adapter off);
    ``routing``: an MoE batch's routing parity sums (``RoutingReplay.last_stats``, summed over micro-batches);
    ``kept`` [S, C]: with truncated sampling, log of the trainer's full-softmax mass inside the engine's kept set
    at each position (``sampling/kept_mass``); None without.
    """

    logprobs: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    topk: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    routing: Optional[dict] = None
    kept: Optional[torch.Tensor] = None

    @classmethod
    def zeros(cls, batch: TokenBatch, *, entropy: bool = True, values: bool = False,
              reference: bool = False) -> "Scores":
        def zero():
            return torch.zeros_like(batch.rollout_logprobs)

        return cls(logprobs=zero(), entropy=zero() if entropy else None,
                   topk=None if batch.topk_ids is None else torch.zeros_like(batch.topk_logprobs),
                   values=zero() if values else None, ref_logprobs=zero() if reference else None,
                   kept=None if batch.support is None else zero())

    def put(self, rows, lp, ent, top, values=None, routing=None, kept=None) -> None:
        """Write one micro-batch's outputs (its first ``lp.shape[1]`` columns) into ``rows``."""
        c = lp.shape[1]
        if routing is not None:
            self.routing = routing if self.routing is None else {k: self.routing[k] + v for k, v in routing.items()}
        self.logprobs[rows, :c] = lp.detach()
        if self.entropy is not None:
            self.entropy[rows, :c] = ent.detach()
        if self.topk is not None:
            self.topk[rows, :c] = top
        if self.values is not None:
            self.values[rows, :c] = values.detach()
        if self.kept is not None:
            self.kept[rows, :c] = kept

    def rows(self, idx, cols: Optional[int] = None) -> "Scores":
        """The scores of rows ``idx`` (and their first ``cols`` columns)."""
        cut = slice(None) if cols is None else slice(None, cols)

        def take(x):
            return None if x is None else x[idx, cut]

        return replace(self, logprobs=take(self.logprobs), entropy=take(self.entropy), topk=take(self.topk),
                       values=take(self.values), ref_logprobs=take(self.ref_logprobs), kept=take(self.kept))


def check_engine_logprobs(rollout_lp: torch.Tensor, mask: torch.Tensor, dp) -> None:
    """The engine's sampled-token log-probs are finite wherever they are scored (``RuntimeError`` otherwise)."""
    # Counted over all ranks, so that every rank raises together (a rank left waiting in
    # the next collective would hang the job instead of stopping it).
    bad = dp.sum_metrics({"n": float(((~torch.isfinite(rollout_lp)) & (mask > 0)).sum())})["n"]
    if bad:
        raise RuntimeError(f"the engine returned {int(bad)} non-finite sampled-token log-probs; the trainer cannot "
                           "score a token the engine considers impossible (check top_k/top_p and logprobs mode)")


def forward(model, micro: TokenBatch, *, temperature: float, chunk_size: Optional[int] = None, value_head=None,
            exact=None, entropy: bool = True, entropy_grad: bool = False, pack_sequences: bool = False):
    """(log-probs, entropy or None, top-k log-probs or None, values or None, routing parity sums or None, log of the
    kept mass [S, C] (0 without truncated sampling)) of one micro-batch from one forward.

    Entropy comes from the same kernel pass: it feeds the breakdown of the mismatch by trainer
    entropy and PPO's entropy bonus. Gradients flow when grad is enabled -- to the entropy only
    with ``entropy_grad`` (a loss that uses it): a logged entropy keeps the cheap backward.
    ``pack_sequences``: the backbone runs on packed rows (``trainer.models.packing``), same outputs.
    """
    hidden, lm_head, values = completion_hidden(model, micro, value_head, pack_sequences=pack_sequences)
    # read now: a reference pass or a checkpoint's recompute calls the routers again
    replay = None if micro.routes is None else attached_replay(model)
    routing = None if replay is None else replay.last_stats()
    lp, ent, *top, kept = logprobs_from_hidden(hidden, lm_head, micro, temperature=temperature, chunk_size=chunk_size,
                                               return_entropy=entropy, entropy_grad=entropy_grad,
                                               topk_ids=micro.topk_ids, return_kept=True)
    top = top[0] if top else None
    if exact is not None:
        lp, ent, top = exact(micro, lp, ent, top, temperature)
    return lp, ent, top, values, routing, kept.detach()


@torch.no_grad()
def reference_logprobs(model, micro: TokenBatch, *, temperature: float, chunk_size: Optional[int] = None,
                       exact=None, pack_sequences: bool = False) -> torch.Tensor:
    """The reference policy's log-probs of the micro-batch: the base model, i.e. the same weights with the
    adapter off, so that no second copy of the model is held."""
    with model.disable_adapter():
        lp, _ = completion_logprobs(model, micro, temperature=temperature, chunk_size=chunk_size,
                                    pack_sequences=pack_sequences)
    if exact is not None:
        lp = exact.reference(micro, lp, temperature)
    return lp


@torch.no_grad()
def score_batch(model, batch: TokenBatch, *, micro_batch_size: int, temperature: float,
                chunk_size: Optional[int] = None, value_head=None, reference: bool = False, exact=None,
                entropy: bool = True, order: Optional[torch.Tensor] = None, pack_sequences: bool = False,
                progress: Optional[Callable[[str], None]] = None) -> Scores:
    """``Scores`` of ``batch`` under ``model``, no gradient, ``micro_batch_size`` rows per forward.

    ``order``: the rows in the order they are grouped into micro-batches (default: the longest
    first, ``trainer.measurement.micro_batches``). ``reference`` adds ``ref_logprobs``; ``pack_sequences``
    packs each micro-batch's sequences into fewer rows; ``progress`` is called with a one-line
    message every ``PROGRESS_EVERY_S`` seconds.
    """
    scores = Scores.zeros(batch, entropy=entropy, values=value_head is not None, reference=reference)
    n, done, last = len(batch), 0, time.monotonic()
    for rows in micro_batch_rows(batch, micro_batch_size, order):
        micro = batch.select(rows)
        scores.put(rows, *forward(model, micro, temperature=temperature, chunk_size=chunk_size,
                                  value_head=value_head, exact=exact, entropy=entropy, pack_sequences=pack_sequences))
        if reference:
            lp = reference_logprobs(model, micro, temperature=temperature, chunk_size=chunk_size, exact=exact,
                                    pack_sequences=pack_sequences)
            scores.ref_logprobs[rows, :lp.shape[1]] = lp
        done += len(rows)
        if progress and time.monotonic() - last > PROGRESS_EVERY_S:
            last = time.monotonic()
            progress(f"  scored {done}/{n} samples")
    return scores
