"""``staleness/*``: how far the policy that generated a batch (its behaviour policy) is from the one that trains it.

The lag of a token is the number of optimizer steps between the weights that sampled it and the trainer's weights
before this step's update: 0 on-policy, k from step k + 1 on with ``rollout.max_staleness: k``
(trainer/sampling/async_prefetch.py). Without in-flight updates every token of a batch has its batch's lag, and a
step has one: ``staleness/lag``. With them (trainer/sampling/in_flight.py) the lag is per token: the step logs
``staleness/lag_mean``, ``staleness/lag_max`` (also as ``staleness/lag``), the share of its sampled tokens at each
lag ``staleness/lag_<j>/share`` and a lag histogram. Either way the figures (behaviour vs current log-probs of the
sampled tokens, ``parity.metrics``'s definitions) are also filed under each lag, ``staleness/lag_<j>/*``, so wandb
draws one curve per lag and a run's mismatch reads against how stale its data was.
"""
from __future__ import annotations

from typing import Optional, Union

import torch


def staleness_metrics(dp, current: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                      lag: Optional[Union[int, torch.Tensor]]) -> dict:
    """``staleness/*`` of a batch: current vs behaviour log-probs pooled over ranks, and with a ``lag`` (an
    off-policy run's batch: one int, or [S, C] per token) the same under ``staleness/lag_<j>/`` with the lag's
    figures; None: an on-policy run, whose lag is 0 by construction. ``dp``: the run's DataParallel
    (``pooled_parity``; off-policy runs have one process, trainer/rl/loop.py, so every rank sees the same lags)."""
    out = dp.pooled_parity(current, behaviour, mask, prefix="staleness/")
    if lag is None:
        return out
    if not isinstance(lag, torch.Tensor):
        if lag < 0:
            raise ValueError(f"a batch's lag is {lag}: its behaviour weights are newer than the trainer's")
        by_lag = {f"staleness/lag_{lag}/{k.split('/', 1)[1]}": v for k, v in out.items()}
        return {**out, **by_lag, "staleness/lag": float(lag)}
    sampled = mask != 0
    lags = lag[sampled]
    if lags.numel() and int(lags.min()) < 0:
        raise ValueError(f"a token's lag is {int(lags.min())}: its behaviour weights are newer than the trainer's")
    total = max(int(lags.numel()), 1)
    present = sorted(int(j) for j in torch.unique(lags).tolist())
    for j in present:
        at = mask * (lag == j).to(mask.dtype)
        share = float((lags == j).sum()) / total
        part = dp.pooled_parity(current, behaviour, at, prefix=f"staleness/lag_{j}/")
        out.update(part)
        out[f"staleness/lag_{j}/share"] = share
    lag_max = float(max(present)) if present else 0.0
    out.update({"staleness/lag_mean": float(lags.float().mean()) if lags.numel() else 0.0,
                "staleness/lag_max": lag_max, "staleness/lag": lag_max})
    return out


def lag_histogram(lag: torch.Tensor, mask: torch.Tensor) -> tuple[list[float], list[float]]:
    """(counts, edges) of the sampled tokens' lags, one bin per integer lag from 0 to the largest."""
    lags = lag[mask != 0]
    top = int(lags.max()) if lags.numel() else 0
    counts = torch.bincount(lags.long(), minlength=top + 1).float().tolist() if lags.numel() else [0.0]
    return counts, [j - 0.5 for j in range(top + 2)]


def stale_kv_metrics(dp, train: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor, stale: torch.Tensor) -> dict:
    """``parity/stale_kv/*``: the engine against the trainer (each under the token's own version) on the tokens an
    in-flight ``keep`` sampled over older weights' KV, and their share of the sampled tokens. The engine's side
    of those tokens saw a context another version encoded, so this is what ``keep`` adds to the numerics."""
    sampled = dp.sum_metrics({"all": float((mask != 0).sum()), "stale": float(((mask != 0) & (stale != 0)).sum())})
    out = {"parity/stale_kv/share": sampled["stale"] / max(sampled["all"], 1.0)}
    if sampled["stale"]:
        out.update(dp.pooled_parity(train, engine, mask * stale, prefix="parity/stale_kv/"))
    return out
