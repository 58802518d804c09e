"""The teacher engine's log-probs of the student's sampled ids, laid out as the step's batch [S, C].

The teacher scores each sequence ``prompt + completion`` exactly as the student's engine produced it (ids, never
text): one prefill, the log-prob of every token given its prefix (``RolloutEngine.score``: vLLM's prompt log-probs,
or a Transformers forward). Position t - 1 of a sequence's scores is token t's, so a completion's tokens start at
``len(prompt) - 1``. An episode's completion holds the environment's replies too: they are scored (the teacher
reads the same context) and then ignored by the batch's mask, which marks the sampled ids only.
"""
from __future__ import annotations

from typing import Optional

import torch

from rollout.types import Rollouts


def teacher_scores(engine, rollouts: Rollouts, columns: int, device, *, top1: bool = False
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log-probs [S, columns] float32, the teacher's most likely id at each position [S, columns] int64 or None)
    of ``rollouts``' completion tokens under ``engine``, at temperature 1; 0 (and -1) past each completion."""
    sequences = [list(p) + list(c) for p, c in zip(rollouts.prompt_ids, rollouts.completion_ids)]
    scored = engine.score(sequences, topk=1 if top1 else 0)
    s = len(sequences)
    lp = torch.zeros(s, columns, dtype=torch.float32)
    best = torch.full((s, columns), -1, dtype=torch.int64) if top1 else None
    for k, (prompt, completion) in enumerate(zip(rollouts.prompt_ids, rollouts.completion_ids)):
        start, n = len(prompt) - 1, len(completion)
        row = scored.logprobs[k][start:start + n]
        if len(row) != n:
            raise RuntimeError(f"the teacher engine returned {len(row)} prompt log-probs for the {n} completion "
                               f"tokens of sequence {k}: expected one per token (rollout.base.RolloutEngine.score)")
        lp[k, :n] = torch.tensor(row, dtype=torch.float32)
        if top1:
            best[k, :n] = torch.tensor([ids[0] for ids in scored.topk_ids[k][start:start + n]], dtype=torch.int64)
    return lp.to(device), None if best is None else best.to(device)
