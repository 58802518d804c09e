"""The order of a batch's rows into micro-batches: longest first, so each micro-batch holds rows of similar length.

``TokenBatch.select`` trims a micro-batch to the columns its longest row needs, so a
micro-batch of similar lengths carries little padding: with completion lengths spread
10x across a batch, cutting micro-batches in row order pads most rows to near the
batch's longest (TRL's ``group_by_length`` and verl's dynamic batch sizing rest on the
same observation). Every pass that walks a batch in micro-batches (pi_old's scoring, the
policy-gradient pass, each mini-batch of several updates, the probe, ``parityrl compare``)
takes its rows from here, so all of them group rows the same way.

Grouping does not change what is computed: the loss is normalised by whole-batch counts
(``LossNormalizer``), so the sum over micro-batches is the same sum in another order
(equal to float rounding, tests/trainer/measurement/test_micro_batches.py), and every result is
written back to its own row. With data parallel each rank orders its own rows.
"""
from __future__ import annotations

import torch

from trainer.models.batch import TokenBatch


def length_order(batch: TokenBatch) -> torch.Tensor:
    """Row indices (CPU) by total length (prompt + completion tokens), the longest first; ties keep row order."""
    return torch.argsort(batch.attention_mask.sum(1).cpu(), descending=True, stable=True)


def micro_batch_rows(batch: TokenBatch, size: int, order: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The row indices of each micro-batch of at most ``size`` rows, on the batch's device.

    ``order``: the rows in the order to cut them (default ``length_order``).
    """
    order = length_order(batch) if order is None else order
    device = batch.mask.device
    return [order[start:start + size].to(device) for start in range(0, len(batch), size)]
