"""DAPO's dynamic sampling in the loop (Yu et al., arXiv 2503.14476, Sec. 3.2).

A group whose rewards are all equal (every completion right, or every one wrong) has zero
group-relative advantage: it adds no gradient and only dilutes the batch. With
``algorithm.dynamic_sampling`` the loop keeps the groups with signal
(``trainer.algorithms.filters.groups_with_signal``) and draws further prompt batches until
it holds ``rollout.prompts_per_step`` of them, or ``algorithm.max_sampling_rounds`` batches
were drawn this step.

Choices, and why:
- Each round is a whole ``prompts_per_step`` batch from the same ``PromptBatcher`` (its
  state, in the checkpoint, covers every round, so a resumed run draws the same prompts),
  sampled with the per-sample seeds of sample indices after the previous rounds'
  (``SamplingSpec.index_offset``): no two rounds of a step share a seed.
- With data parallel every rank draws the same batches and samples its shard (as without
  dynamic sampling); the ranks decide together (one small all-reduce per round) whether
  another round is needed, so they draw the same number of batches and stay in step.
- Every rank then trains on the SAME number of groups, the smallest any rank kept (capped
  at its share of ``prompts_per_step`` and rounded down so that ``algorithm.mini_batches``
  still divides the samples): ZeRO-3 needs the same number of forwards on every rank. A rank
  that kept more drops its last groups, so with several ranks the kept set can differ from
  one process's (the same samples are drawn; the cut is per rank).
- Still short after the last round: train on the groups kept (a smaller batch; the loss is
  normalised by the batch actually trained on). None kept on some rank: train on the first
  round's batch as drawn (zero advantage everywhere under GRPO: the update is a no-op apart
  from KL / entropy terms) and log ``rollout/ds_fallback`` = 1. verl raises instead once its
  ``max_num_gen_batches`` is exceeded; a run that stops on a hard batch loses more than it saves.

Metrics: ``rollout/ds_rounds`` (batches drawn this step), ``rollout/ds_signal_frac`` (share
of drawn groups with signal, all ranks), ``rollout/ds_train_groups`` (groups trained on, all
ranks), ``rollout/ds_fallback``. Rewards, lengths and throughput are logged over every
sample drawn this step: the policy's behaviour, not the filtered batch's.
"""
from __future__ import annotations

from typing import Callable

import torch

from trainer.algorithms.filters import groups_with_signal
from trainer.sampling.drawn import Drawn


def groups_to_train(kept_per_rank: list[int], share: int, group_size: int, mini_batches: int) -> int:
    """Groups every rank trains on: the smallest rank's kept count, at most ``share`` (this rank's part of
    ``prompts_per_step``), rounded down until ``mini_batches`` divides its samples. 0 = none usable."""
    n = min(min(kept_per_rank), share)
    while n > 0 and (n * group_size) % mini_batches:
        n -= 1
    return n


def fill_with_signal(draw: Callable[[int], Drawn], *, share: int, group_size: int, mini_batches: int,
                     max_rounds: int, dp) -> tuple[Drawn, list[Drawn], dict[str, float]]:
    """Draw rounds (``draw(round_index)``) until every rank holds ``share`` groups with signal or
    ``max_rounds`` were drawn. Returns (the groups to train on, every round drawn, metrics).

    Collective with data parallel (``dp``): every rank must call it at the same point.
    """
    drawn: list[Drawn] = []
    kept: list[Drawn] = []
    while True:
        part = draw(len(drawn))
        drawn.append(part)
        keep, _ = groups_with_signal(torch.tensor(part.rewards, dtype=torch.float64), group_size)
        signal = [gi for gi in range(part.num_groups) if bool(keep[gi * group_size])]
        kept.append(part.take_groups(signal))
        have = sum(k.num_groups for k in kept)
        short = torch.tensor([float(have < share)], dtype=torch.float64)
        if len(drawn) >= max_rounds or float(dp.all_sum(short)[0]) == 0:
            break
    counts = torch.zeros(dp.world, dtype=torch.float64)
    counts[dp.rank] = have
    kept_per_rank = [int(c) for c in dp.all_sum(counts).tolist()]
    n = groups_to_train(kept_per_rank, share, group_size, mini_batches)
    train = Drawn.concat(kept).take_groups(list(range(n))) if n else drawn[0]
    drawn_groups = dp.world * sum(p.num_groups for p in drawn)  # every rank draws the same number
    metrics = {"rollout/ds_rounds": float(len(drawn)),
               "rollout/ds_signal_frac": sum(kept_per_rank) / drawn_groups,
               "rollout/ds_train_groups": float((n or share) * dp.world),
               "rollout/ds_fallback": float(n == 0)}
    return train, drawn, metrics
