"""What the recipe's correction did to a step's batch: ``correction/*``, where its weights fell, and the shadow table.

The numbers come from ``parity.corrections`` on the step's own pi_old log-probs (the ``Scores`` the update and
``parity/*`` used), the engine's and the advantages: no forward of its own. Every statistic is pooled over the
data-parallel ranks (``DataParallel.pool``), so each rank returns the same values; rank 0 writes them.

Tables (rows of plain values, written with the parity breakdown):
- ``correction_by_position`` / ``_by_rollout_prob`` / ``_by_entropy`` / ``_by_turn`` (episodes): the share of tokens
  clipped and masked per bucket of the parity breakdown's buckets, when a rule is in use;
- ``correction_shadow`` (``parity.correction.shadow``): every rule on the same batch (``parity.corrections.shadow``).
"""
from __future__ import annotations

from typing import Optional

import torch

from parity.corrections import CorrectionInputs, breakdown as buckets, correction_metrics, shadow_rows
from trainer.config import CorrectionSection
from trainer.distributed.data_parallel import DataParallel
from trainer.measurement.scoring import Scores
from trainer.models.batch import TokenBatch


def correction_report(correction: CorrectionSection, batch: TokenBatch, scored: Scores, advantages: torch.Tensor,
                      dp: DataParallel, *, shadow: bool = False,
                      by_turn: bool = False) -> tuple[dict[str, float], dict[str, list[dict]]]:
    """(``correction/*`` of the step, its tables). ``shadow``: add the shadow table (on a breakdown step);
    ``by_turn``: multi-turn episodes, add the per-turn table. Collective: every rank calls it."""
    plan = correction.plan
    inputs = CorrectionInputs.of(scored.logprobs, batch.rollout_logprobs, batch.mask, advantages)
    metrics, out = correction_metrics(inputs, plan, all_sum=dp.all_sum, pool=dp.pool)
    tables: dict[str, list[dict]] = {}
    if plan:
        tables.update(bucket_tables(inputs, out.clipped, out.masked, batch.rollout_logprobs, scored.entropy, dp,
                                    by_turn=by_turn))
    if shadow:
        tables["correction_shadow"] = shadow_rows(inputs, plan, all_sum=dp.all_sum, pool=dp.pool)
    return metrics, tables


def bucket_tables(inputs: CorrectionInputs, clipped: torch.Tensor, masked: torch.Tensor,
                  rollout_logprobs: torch.Tensor, entropy: Optional[torch.Tensor], dp: DataParallel, *,
                  by_turn: bool = False) -> dict[str, list[dict]]:
    """The share clipped and masked per bucket of position, engine probability, trainer entropy (and turn)."""
    mask = inputs.mask
    local_len = float(inputs.lengths.max()) if inputs.lengths.numel() else 0.0
    turn = buckets.turns(mask)
    longest = dp.max_metrics({"len": local_len, "turn": float(turn.max()) if turn.numel() else 0.0})
    specs = [("correction_by_position", buckets.positions(mask), buckets.position_edges(int(longest["len"])),
              "position_start", "position_end"),
             ("correction_by_rollout_prob", torch.exp(rollout_logprobs.double()), buckets.PROB_EDGES,
              "prob_start", "prob_end")]
    if entropy is not None:
        specs.append(("correction_by_entropy", entropy, buckets.ENTROPY_EDGES, "entropy_start", "entropy_end"))
    if by_turn:
        specs.append(("correction_by_turn", turn, buckets.turn_edges(int(longest["turn"])), "turn", "turn_end"))
    counts = dp.pool({name: buckets.bucket_counts(values, mask, clipped, masked, edges)
                      for name, values, edges, _, _ in specs})
    tables = {}
    for name, _, edges, start, end in specs:
        rows = buckets.bucket_rows(counts[name], edges, start, end)
        if name == "correction_by_turn":
            rows = [{**{k: v for k, v in r.items() if k != "turn_end"}, "turn": int(r["turn"])} for r in rows]
        tables[name] = rows
    return tables
