"""Batch invariance: the same sequences scored alone and among others, by each side on its own, against the
engine-vs-trainer mismatch on the same tokens.

The watched sequences are the fixed batch's (``Doctor.batch``: prompt + sampled completion), scored at T = 1 over the
full vocabulary on both sides (the engine's prompt log-probs are the raw distribution's):

- the engine (``score``: one prefill per sequence) alone, in the batch of 8, and in a batch of 64 (the 8 among 56
  other sequences of varied lengths);
- the trainer (the training step's scoring) in micro-batches of 1 (alone: a row without padding), 8, and 64 (the
  batch of 64: the watched rows left-padded to the longest prompt among the others);
- the trainer's fused log-prob kernel at chunk sizes 1 and 7 against its automatic tiling (TRL #6789 found the chunk
  size alone moved 8% of bf16 tokens outside a ratio of [0.9, 1.1] on CUDA).

Each side's spread (mean |lp - lp_reference| over the watched tokens; the max in the details) is reported beside the
engine-vs-trainer mismatch (both alone) on those tokens, so a user sees how much of the mismatch batching explains.

Levels (measured on CPU, tiny model, 96 watched tokens, 2026-11-27): the engine is bitwise invariant (0 at 8 and 64,
bf16 and float32), as ``rollout/engine_forward.py`` says of vLLM's CPU forward; the trainer's micro-batches moved
bf16 tokens by at most 9.5e-7 (mean 2e-8) and float32 ones not at all; chunk sizes moved float32 tokens by up to
1.9e-6 (mean 9.4e-8, a third of float32's mismatch mean 3.0e-7) and bf16 ones not at all. The band is the dtype's
parity level (``Doctor.mae_level``): in a healthy setup batching only rounds the same computation differently, and one
side's rounding noise above the level a healthy engine-vs-trainer pair reaches would by itself make that level
unreachable; a padding or mask leak moved bf16 tokens by 4.7e-2 on average (max 2.1) in the batch of 64
(tests/doctor/test_batch_invariance.py).
On CUDA vLLM's kernels are not batch-invariant by default (``VLLM_BATCH_INVARIANT=1``): that spread is what the engine
row measures there.
"""
from __future__ import annotations

import torch

from rollout.types import Rollouts
from trainer.config.validate import sequence_length
from trainer.doctor.context import Doctor
from trainer.doctor.records import Check, Finding, at_most
from trainer.precision.verdict import MAE_WARN_FACTOR

NAME = "batch_invariance"
BATCH = 64  # the large batch: the watched sequences among fillers
MICRO_BATCHES = (8, 64)  # against 1 (alone)
CHUNKS = (1, 7)  # against None (the kernel's automatic tiling): one row per tile, and tiles cutting across rows
FILLER_SEED = 1  # the fillers' sampling seed, after the recipe's


def _plain(r: Rollouts) -> Rollouts:
    """The samples without kept sets or top-k: both sides then score the full softmax at T = 1."""
    return Rollouts(prompt_ids=r.prompt_ids, completion_ids=r.completion_ids, rollout_logprobs=r.rollout_logprobs,
                    finish_reasons=r.finish_reasons, group_size=1)


def _fillers(doc: Doctor, count: int) -> Rollouts:
    """``count`` other sequences of varied lengths: each recipe prompt behind a growing part of another (20 to ~40
    tokens on the tiny model), with a completion the engine samples for it."""
    spec = doc.spec(seed=doc.cfg.train.seed + FILLER_SEED)
    # the prompt budget, and room for the completion in a score: prefill log-probs need one position to spare
    context = getattr(doc.engine, "max_model_len", None) or sequence_length(doc.cfg)
    p, limit = doc.prompt_ids, min(doc.cfg.data.max_prompt_tokens, context - spec.max_new_tokens - 1)
    prompts = []
    for k in range(count):
        own, other = p[k % len(p)], p[(k + 1 + k // len(p)) % len(p)]
        prompts.append((other[:(5 * k) % len(other)] + own)[-limit:])
    return _plain(doc.engine.generate(prompts, spec))


def _join(a: Rollouts, b: Rollouts) -> Rollouts:
    return Rollouts(prompt_ids=a.prompt_ids + b.prompt_ids, completion_ids=a.completion_ids + b.completion_ids,
                    rollout_logprobs=a.rollout_logprobs + b.rollout_logprobs,
                    finish_reasons=a.finish_reasons + b.finish_reasons, group_size=1)


def _take(r: Rollouts, i: int) -> Rollouts:
    return Rollouts(prompt_ids=r.prompt_ids[i:i + 1], completion_ids=r.completion_ids[i:i + 1],
                    rollout_logprobs=r.rollout_logprobs[i:i + 1], finish_reasons=r.finish_reasons[i:i + 1],
                    group_size=1)


def _engine_rows(doc: Doctor, r: Rollouts, watched: int) -> torch.Tensor:
    """The engine's prefill log-probs [watched, C] of the first ``watched`` samples' completion tokens, scored with
    every sequence of ``r`` in one call."""
    scored = doc.engine.score([p + c for p, c in zip(r.prompt_ids, r.completion_ids)])
    width = max(len(c) for c in r.completion_ids[:watched])
    out = torch.zeros(watched, width)
    for i in range(watched):
        lp = scored.logprobs[i][len(r.prompt_ids[i]) - 1:]
        out[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return out


def _spread(a: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    d = (a[:, :ref.shape[1]] - ref).abs()[mask]
    return {"mean": float(d.mean()), "max": float(d.max())}


def _worst(spreads: dict[str, dict]) -> float:
    return max(s["mean"] for s in spreads.values())


def _finding(item: str, spreads: dict[str, dict], mismatch: dict[str, float], level: float, cause: str) -> Finding:
    worst = _worst(spreads)
    share = worst / mismatch["mean"] if mismatch["mean"] > 0 else None
    return at_most(NAME, item, worst, level, cause, warn_factor=MAE_WARN_FACTOR,
                   details={"spread": spreads, "mismatch_engine_vs_trainer": mismatch, "spread_over_mismatch": share})


def run(doc: Doctor) -> list[Finding]:
    batch = _plain(doc.batch())
    n = len(batch.prompt_ids)
    big = _join(batch, _fillers(doc, BATCH - n))
    # ---- the engine: each watched sequence alone, then in the batch of 8 and of 64
    alone = torch.zeros(n, max(len(c) for c in batch.completion_ids))
    for i in range(n):
        row = _engine_rows(doc, _take(batch, i), 1)
        alone[i, :row.shape[1]] = row[0]
    # ---- the trainer: micro-batches of 1 (alone), 8 and 64; chunk sizes at micro-batch 8
    t_alone, mask = doc.trainer_logprobs(batch, micro_batch_size=1, temperature=1.0)
    mismatch = _spread(alone, t_alone, mask)
    engine = {f"batch {n}": _spread(_engine_rows(doc, batch, n), alone, mask),
              f"batch {len(big.prompt_ids)}": _spread(_engine_rows(doc, big, n), alone, mask)}
    trainer = {}
    for mb in MICRO_BATCHES:
        scored = big if mb > n else batch
        lp, _ = doc.trainer_logprobs(scored, micro_batch_size=mb, temperature=1.0)
        trainer[f"micro-batch {mb} in a batch of {len(scored.prompt_ids)}"] = _spread(lp[:n], t_alone, mask)
    auto, _ = doc.trainer_logprobs(batch, micro_batch_size=n, temperature=1.0)
    chunks = {}
    for cs in CHUNKS:
        lp, _ = doc.trainer_logprobs(batch, micro_batch_size=n, chunk_size=cs, temperature=1.0)
        chunks[f"chunk_size {cs}"] = _spread(lp, auto, mask)
    level = doc.mae_level()
    doc.say(f"  engine vs trainer (both alone): mean |dlp| {mismatch['mean']:.3g}, max {mismatch['max']:.3g}; "
            f"batching spreads: engine {_worst(engine):.3g}, trainer micro-batch {_worst(trainer):.3g}, "
            f"chunk {_worst(chunks):.3g}")
    return [
        _finding(f"engine: batch of {n} / {len(big.prompt_ids)} vs alone: mean |dlp|", engine, mismatch, level,
                 "the engine's log-probs of a sequence depend on the other sequences in its batch (batch-variant "
                 "kernels: vLLM's default on CUDA; VLLM_BATCH_INVARIANT=1 removes it)"),
        _finding("trainer: micro-batch 8 / 64 vs 1: mean |dlp|", trainer, mismatch, level,
                 "the trainer's log-probs of a row depend on the micro-batch's other rows: padding or the attention "
                 "mask leaks into the row (left-padded prompts), or rows are mixed"),
        _finding("trainer: log-prob chunk_size 1 / 7 vs auto: mean |dlp|", chunks, mismatch, level,
                 "the fused log-prob kernel's result depends on its tile size (parity.logprobs chunk_size: the "
                 "lm_head GEMM or log-softmax rounds per tile)"),
    ]


CHECK = Check(NAME, "does batching (batch size, micro-batch, log-prob chunk) move a sequence's log-probs?", run)
