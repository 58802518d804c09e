"""What merging a LoRA update into the base weight costs in what the engine stores.

A merged sync sends ``round(W + Δ)`` with Δ = s·B·A: W already sits on the dtype's grid, so every element of Δ
smaller than half a grid step of W rounds back to W, and the rest move by whole steps. The engine may then store
the weight in a coarser form still: an FP8 engine (the fp8 precision recipes) multiplies by Q(round(W + Δ)), Q
the block-FP8 quantize-dequantize ``parity.precision.fake_quant_weight`` (E4M3, 128x128 blocks, one scale per
block: on CUDA the pushed codes and scales, on CPU the emulation's re-quantization, the same values). With S the
engine's store (the identity, or Q after the rounding), the update the engine applies is S(W + Δ) − S(W), and over
a set of weights:

    merge_update_error  = ‖S(W + Δ) − S(W) − Δ‖ / ‖Δ‖     (0: the engine applies the trainer's update exactly)
    merge_unchanged_frac = share of elements with S(W + Δ) == S(W)

The first is the relative error of the update the engine applies; the second says how much of it never arrives.
With S = round, S(W) = W (W is on the grid) and the error is ‖round(W + Δ) − W − Δ‖ / ‖Δ‖. Under Q it counts FP8's
rounding (3 mantissa bits: a spacing of 2^-3 relative against bf16's 2^-7) and a block's scale moving with its
largest element, not the engine's FP8 error on W itself, which parity/* measures. Both are computed in float64 from
the float32 merge both sides trust (``parity.lora``), so the figure is the rounding's alone. ``merge_cost_sums``
gives the sums of one weight so that several weights (and ranks) pool before the one division
(``merge_cost_metrics``).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

__all__ = ["MERGE_COST_KEYS", "merge_cost_metrics", "merge_cost_sums"]

MERGE_COST_KEYS = ("err2", "delta2", "unchanged", "numel")


def merge_cost_sums(base: torch.Tensor, merged_fp32: torch.Tensor, dtype: torch.dtype,
                    store: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> dict[str, float]:
    """Sums over one weight: ``err2`` = ‖S(W+Δ) − S(W) − Δ‖², ``delta2`` = ‖Δ‖², ``unchanged`` = #{S(W+Δ) == S(W)},
    ``numel``.

    ``base``: W, the trainer's base weight (the model dtype); ``merged_fp32``: W + Δ as the merge computes it in
    float32 (``parity.lora.merged_lora_weight``), Δ being its difference from W; ``dtype``: the dtype the sync
    sends; ``store``: what the engine makes of a weight sent in ``dtype``, as the values it multiplies by (None: it
    keeps it as sent; an FP8 engine's layers: ``parity.precision.fake_quant_weight``). S = store after rounding.
    """
    if base.shape != merged_fp32.shape:
        raise ValueError(f"base {tuple(base.shape)} and merged {tuple(merged_fp32.shape)} differ in shape")
    w = base.detach()
    exact = merged_fp32.detach().double()
    delta = exact - w.double()
    before, after = w.to(dtype), merged_fp32.detach().to(dtype)
    if store is not None:
        before, after = store(before), store(after)
    before, after = before.double(), after.double()
    return {"err2": float((after - before - delta).pow(2).sum()), "delta2": float(delta.pow(2).sum()),
            "unchanged": float((after == before).sum()), "numel": float(w.numel())}


def merge_cost_metrics(sums: dict[str, float], prefix: str = "sync/") -> dict[str, float]:
    """``sync/merge_update_error`` and ``sync/merge_unchanged_frac`` of pooled sums; the error is left out while the
    update is zero (a fresh adapter: nothing to lose yet)."""
    out = {f"{prefix}merge_unchanged_frac": sums["unchanged"] / sums["numel"]} if sums.get("numel") else {}
    if sums.get("delta2", 0.0) > 0.0:
        out[f"{prefix}merge_update_error"] = math.sqrt(sums["err2"] / sums["delta2"])
    return out
