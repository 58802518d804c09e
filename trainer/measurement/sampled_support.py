"""What truncated sampling leaves out, as the trainer sees it: ``sampling/*`` of a step (DESIGN.md, "The sampled
support").

With top-k / top-p / min-p the engine samples from its kept set S at each position, and the trainer's log-probs are
normalised over S (``parity.fused_logprobs``'s ``support``). How much of the trainer's own distribution S holds says
how far the truncated policy is from the untruncated one, and how near a token's ratio would have been to log(kept
mass) had the trainer normalised over the whole vocabulary:

| key | definition |
|---|---|
| ``sampling/kept_mass`` | mean over sampled tokens of the trainer's full-softmax probability mass inside S |
| ``sampling/kept_mass_p1`` | its 1st percentile (the tokens sampled from the most truncated distributions) |
| ``sampling/kept_tokens`` | mean size of S over sampled tokens |

Pooled over the data-parallel ranks (every rank's tokens gathered for the percentile).
"""
from __future__ import annotations

import torch

from trainer.models.batch import TokenBatch


def kept_metrics(kept_logmass: torch.Tensor, batch: TokenBatch, dp) -> dict[str, float]:
    """``sampling/*`` of a batch: ``kept_logmass`` [S, C] (``Scores.kept``), the batch's kept sets and mask."""
    mask = batch.mask > 0
    mass = kept_logmass[mask].double().exp().cpu()
    c = batch.mask.shape[1]
    sampled_sizes = [sup.sizes[:min(len(sup), c)][mask[i, :min(len(sup), c)].cpu()] for i, sup in enumerate(batch.support)]
    s = dp.sum_metrics({"n": float(mass.numel()), "mass": float(mass.sum()), "kept": float(sum(x.sum() for x in sampled_sizes))})
    everyone = torch.cat([torch.as_tensor(x, dtype=torch.float64) for x in dp.gather_objects(mass.tolist())])
    n = max(s["n"], 1.0)
    return {"sampling/kept_mass": s["mass"] / n,
            "sampling/kept_mass_p1": float(torch.quantile(everyone, 0.01)) if everyone.numel() else 1.0,
            "sampling/kept_tokens": s["kept"] / n}
