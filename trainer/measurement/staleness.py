"""``staleness/*``: how far the policy that generated a batch (its behaviour policy) is from the one that trains it.

The lag of a batch is the number of optimizer steps between its behaviour weights and the trainer's weights
before this step's update: 0 on-policy, k from step k + 1 on with ``rollout.max_staleness: k``
(trainer/sampling/async_prefetch.py). The engine's weights change only between generations, so every token of
a batch has its batch's lag, and a step has one: ``staleness/lag``. Its figures (behaviour vs current log-probs
of the sampled tokens, ``parity.metrics``'s definitions) are also filed under that lag, ``staleness/lag_<j>/*``,
so wandb draws one curve per lag and a run's mismatch reads against how stale its data was.
"""
from __future__ import annotations

from typing import Optional

import torch


def staleness_metrics(dp, current: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                      lag: Optional[int]) -> dict:
    """``staleness/*`` of a batch: current vs behaviour log-probs pooled over ranks, and with a ``lag`` (an
    off-policy run's batch) the same under ``staleness/lag_<lag>/`` and ``staleness/lag``; None: an on-policy
    run, whose lag is 0 by construction. ``dp``: the run's DataParallel (``pooled_parity``)."""
    out = dp.pooled_parity(current, behaviour, mask, prefix="staleness/")
    if lag is None:
        return out
    if lag < 0:
        raise ValueError(f"a batch's lag is {lag}: its behaviour weights are newer than the trainer's")
    by_lag = {f"staleness/lag_{lag}/{k.split('/', 1)[1]}": v for k, v in out.items()}
    return {**out, **by_lag, "staleness/lag": float(lag)}
