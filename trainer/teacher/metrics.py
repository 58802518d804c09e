"""What is measured of the teacher each step (``distill/*``), from per-rank sums pooled over ranks.

Over the student's sampled tokens (mask), with lp_s the student's log-prob (its engine's, the one the advantage
uses) and lp_t the teacher engine's of the same id:

- ``distill/reverse_kl``: mean over tokens of lp_s - lp_t, the k1 estimate of KL(pi_s || pi_t) per token (the
  quantity the loss pushes down; can be negative on a batch, its expectation is not).
- ``distill/reverse_kl_seq``: mean over sequences of the sum over their sampled tokens (per-sequence reverse KL).
- ``distill/top1_agree``: share of sampled positions where the student's most likely id (its engine's top-1,
  with ``parity.topk`` >= 1) is the teacher's; absent without the student's top-k.
- ``distill/teacher_noise_frac``: (on teacher-parity steps) teacher_parity/mae / mean |lp_s - lp_t|: how much of
  the distillation signal's size the teacher's own engine-vs-trainer numerics could account for.
"""
from __future__ import annotations

from typing import Optional

import torch


def distill_sums(student_lp: torch.Tensor, teacher_lp: torch.Tensor, mask: torch.Tensor,
                 student_top1: Optional[torch.Tensor] = None,
                 teacher_top1: Optional[torch.Tensor] = None) -> dict[str, float]:
    """This rank's additive sums (tokens, sequences, sum and |sum| of lp_s - lp_t, top-1 matches)."""
    valid = mask != 0
    d = torch.where(valid, student_lp.double() - teacher_lp.double(), torch.zeros((), dtype=torch.float64,
                                                                                  device=mask.device))
    sums = {"n": float(valid.sum()), "seqs": float(valid.any(dim=-1).sum()), "rkl": float(d.sum()),
            "abs": float(d.abs().sum())}
    if student_top1 is not None and teacher_top1 is not None:
        sums["agree"] = float((valid & (student_top1 == teacher_top1)).sum())
    return sums


def distill_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``distill/*`` from sums pooled over ranks (``distill_sums``)."""
    n, seqs = max(sums["n"], 1.0), max(sums["seqs"], 1.0)
    out = {"distill/reverse_kl": sums["rkl"] / n, "distill/reverse_kl_seq": sums["rkl"] / seqs}
    if "agree" in sums:
        out["distill/top1_agree"] = sums["agree"] / n
    return out


def noise_frac(teacher_mae: float, sums: dict[str, float]) -> float:
    """``distill/teacher_noise_frac``: mean |teacher engine - teacher trainer| / mean |lp_s - lp_t| (inf when the
    student and the teacher agree exactly on every token)."""
    signal = sums["abs"] / max(sums["n"], 1.0)
    return teacher_mae / signal if signal > 0 else float("inf")
