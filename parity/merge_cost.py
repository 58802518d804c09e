"""What merging a LoRA update into the base weight costs in the engine's dtype.

A merged sync sends ``round(W + Δ)`` with Δ = s·B·A: W already sits on the dtype's grid, so every element of Δ
smaller than half a grid step of W rounds back to W, and the rest move by whole steps. Over a set of weights:

    merge_update_error  = ‖round(W + Δ) − W − Δ‖ / ‖Δ‖     (0: the engine applies the trainer's update exactly)
    merge_unchanged_frac = share of elements with round(W + Δ) == W

The first is the relative error of the update the engine applies; the second says how much of it never arrives.
Both are computed in float64 from the float32 merge both sides trust (``parity.lora``), so the figure is the
rounding's alone. ``merge_cost_sums`` gives the sums of one weight so that several weights (and ranks) pool before
the one division (``merge_cost_metrics``).
"""
from __future__ import annotations

import math

import torch

__all__ = ["MERGE_COST_KEYS", "merge_cost_metrics", "merge_cost_sums"]

MERGE_COST_KEYS = ("err2", "delta2", "unchanged", "numel")


def merge_cost_sums(base: torch.Tensor, merged_fp32: torch.Tensor, dtype: torch.dtype) -> dict[str, float]:
    """Sums over one weight: ``err2`` = ‖round(W+Δ) − W − Δ‖², ``delta2`` = ‖Δ‖², ``unchanged`` = #{round(W+Δ) == W},
    ``numel``.

    ``base``: W as the engine holds it (the model dtype); ``merged_fp32``: W + Δ as the merge computes it in
    float32 (``parity.lora.merged_lora_weight``), Δ being its difference from W; ``dtype``: the engine's.
    """
    if base.shape != merged_fp32.shape:
        raise ValueError(f"base {tuple(base.shape)} and merged {tuple(merged_fp32.shape)} differ in shape")
    w = base.detach().double()
    exact = merged_fp32.detach().double()
    delta = exact - w
    rounded = merged_fp32.detach().to(dtype).double()
    return {"err2": float((rounded - exact).pow(2).sum()), "delta2": float(delta.pow(2).sum()),
            "unchanged": float((rounded == w).sum()), "numel": float(w.numel())}


def merge_cost_metrics(sums: dict[str, float], prefix: str = "sync/") -> dict[str, float]:
    """``sync/merge_update_error`` and ``sync/merge_unchanged_frac`` of pooled sums; the error is left out while the
    update is zero (a fresh adapter: nothing to lose yet)."""
    out = {f"{prefix}merge_unchanged_frac": sums["unchanged"] / sums["numel"]} if sums.get("numel") else {}
    if sums.get("delta2", 0.0) > 0.0:
        out[f"{prefix}merge_update_error"] = math.sqrt(sums["err2"] / sums["delta2"])
    return out
