"""The behaviour policy of a batch whose tokens several weight versions sampled (in-flight updates,
trainer/sampling/in_flight.py): each token's behaviour log-prob is the trainer's under the version that sampled it.

One no-grad scoring pass per version present, under that version's snapshot (``behaviour_weights``), then each
token takes its own version's values. Every field of ``Scores`` that is per token ([S, C] or [S, C, k]) is taken per
token; the batch-level routing sums of an MoE model are the newest version's (the pass whose routes the engine's
latest tokens followed); a critic's values and the reference policy do not depend on the behaviour version, and
the algorithms with a critic refuse ``max_staleness`` (trainer/config/validate.py).
"""
from __future__ import annotations

from dataclasses import fields, replace
from typing import Callable, TypeVar

import torch

# trainer.measurement.scoring.Scores (a dataclass of per-token tensors); any such dataclass combines the same way
Scores = TypeVar("Scores")


def versions_present(versions: torch.Tensor, mask: torch.Tensor) -> list[int]:
    """The versions of the batch's sampled tokens, oldest first."""
    return sorted(int(v) for v in torch.unique(versions[mask != 0]).tolist())


def combine_by_version(parts: dict[int, Scores], versions: torch.Tensor) -> Scores:
    """One ``Scores`` whose per-token entries come from ``parts[v]`` where the token's version is v (0 where no
    part's version matches: padding). Every part scored the same batch."""
    if not parts:
        raise ValueError("combine_by_version: no scoring passes")
    newest = parts[max(parts)]
    out = {}
    for f in fields(newest):
        like = getattr(newest, f.name)
        if not isinstance(like, torch.Tensor) or f.name in ("values", "ref_logprobs"):
            continue
        if like.shape[:2] != versions.shape:
            raise ValueError(f"combine_by_version: Scores.{f.name} has shape {tuple(like.shape)}, the batch's "
                             f"versions {tuple(versions.shape)}")
        acc = torch.zeros_like(like)
        for v, p in parts.items():
            t = getattr(p, f.name)
            where = (versions == v).to(t.device).reshape(*versions.shape, *[1] * (t.dim() - versions.dim()))
            acc = torch.where(where, t, acc)
        out[f.name] = acc
    return replace(newest, **out)


def score_by_version(score: Callable[[], Scores], weights: Callable[[int], object], versions: torch.Tensor,
                     mask: torch.Tensor) -> Scores:
    """``score()`` once inside ``weights(v)`` (a context manager putting version v's weights in place) for every
    version of the batch's sampled tokens, combined per token."""
    parts = {}
    for v in versions_present(versions, mask):
        with weights(v):
            parts[v] = score()
    return combine_by_version(parts, versions)
