"""What a correction did to one batch: the raw ratio before any truncation, and what the rules' weights changed.

One definition per key, here (docs/parity-metrics.md lists them). Over valid tokens, with d = lp_t - lp_r,
rho = exp(d) the token ratio, S = sum_t d over a sequence's valid tokens and rho_seq = exp(S) its product ratio,
w the applied weight (``plan.CorrectionPlan.apply``) and A the advantages:

| key                                  | definition                                                          |
|--------------------------------------|---------------------------------------------------------------------|
| correction/num_tokens, num_seqs      | N valid tokens, N_s sequences with at least one                      |
| correction/raw/ratio_mean            | mean rho, before any truncation (TRL issue 5231)                     |
| correction/raw/ratio_p1, ratio_p99   | 1st / 99th percentile of rho (pooled histogram, see below)           |
| correction/raw/ratio_max             | max rho                                                              |
| correction/raw/chi2_token            | mean(rho^2) - 1  (chi^2(pi_train || pi_rollout): the IS variance)    |
| correction/raw/ess_token             | (sum rho)^2 / (N sum rho^2): Kish ESS of the untruncated token ratios |
| correction/raw/seq_ratio_mean, _p1, _p99, _max | the same over sequences, of rho_seq                        |
| correction/raw/chi2_seq              | mean_s(rho_seq^2) - 1 (verl's chi2_seq)                              |
| correction/raw/ess_seq               | (sum rho_seq)^2 / (N_s sum rho_seq^2)                                |
| correction/frac_clipped              | share of tokens whose weight a rule truncated                        |
| correction/frac_masked               | share of tokens a rule gave weight 0                                 |
| correction/frac_seqs_masked          | share of sequences with at least one token given weight 0 (verl's rollout_rs_seq_masked_fraction) |
| correction/weight_mean               | mean w                                                               |
| correction/ess                       | (sum w)^2 / (N sum w^2): Kish ESS of the applied weights, 0 if all are 0 |
| correction/loss_change               | -mean((w - 1) A): the change of the ratio-1 policy-gradient loss (token mean) |
| correction/signal_kept               | sum w |A| / sum |A| (1 without any advantage): the advantage weight the rules keep |
| correction/batch_norm_factor         | the IS weights' batch mean they were divided by (``batch_normalize``) |
| correction/<rule>/frac_clipped, frac_masked | per rule, when several are combined                           |

Kish ESS as a fraction of N (Kish 1965; Owen, "Monte Carlo theory, methods and examples", ch. 9): 1 when all
weights are equal, down to 1/N when one carries them all. Ratios use d clamped to [-20, 20] (exp(20) = 4.9e8, verl's
SAFETY_BOUND), so a larger ratio reads as 4.9e8 and nothing overflows. The percentiles come from pooled histograms of
|d| (separately for d < 0 and d >= 0; parity.metrics' bins: 100 per decade over [1e-7, 1e3)) and report the bin edge
further from 0, capped at the extreme: never less extreme than the exact nearest-rank value, at most one bin (2.3%
of |log rho|) beyond it. Reduction over data-parallel ranks: keys ending in ``_max`` by max, the others by sum
(``reduction``); ``finalize`` then computes every metric from the pooled sums. A batch without valid tokens gives
only the two counts (0 would read as "nothing clipped").
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

from parity.corrections.plan import CorrectionPlan, PlanOutput
from parity.corrections.record import CorrectionInputs
from parity.metrics import _HIST_BINS, _HIST_LO, _HIST_PER_DECADE, _abs_hist

Stats = Dict[str, torch.Tensor]
SAFE_LOG = 20.0


def reduction(key: str) -> str:
    """How statistic ``key`` combines across ranks: "max" for ``*_max`` keys, else "sum"."""
    return "max" if key.endswith("_max") else "sum"


def _signed_hists(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _abs_hist((-x[x < 0])), _abs_hist(x[x >= 0])


def _edge(k: int) -> float:
    return _HIST_LO * 10 ** (k / _HIST_PER_DECADE) if k < _HIST_BINS - 1 else math.inf


def signed_quantile(neg: torch.Tensor, pos: torch.Tensor, q: float, lowest: float, highest: float) -> float:
    """The nearest-rank ``q``-quantile of the values whose |x| histograms are ``neg`` (x < 0) and ``pos`` (x >= 0):
    the edge of its bin further from 0, kept within [lowest, highest] (the values' extremes)."""
    n_neg, n = float(neg.sum()), float(neg.sum() + pos.sum())
    rank = max(1, math.ceil(q * n - 1e-9))
    if rank <= n_neg:  # the (n_neg - rank + 1)-th smallest |x| among the negatives
        k = int(torch.searchsorted(torch.cumsum(neg, 0), float(n_neg - rank + 1)))
        return max(-_edge(k), lowest)
    k = int(torch.searchsorted(torch.cumsum(pos, 0), float(rank - n_neg)))
    return min(_edge(k), highest)


def correction_stats(inputs: CorrectionInputs, out: PlanOutput, plan: Optional[CorrectionPlan] = None) -> Stats:
    """Additive (or max-reducible) float64 statistics of ``out`` (``plan.apply(inputs)``) for ``finalize``."""
    mask, md = inputs.mask, inputs.mask.double()
    zero = torch.zeros((), dtype=torch.float64, device=md.device)
    d = inputs.d.clamp(-SAFE_LOG, SAFE_LOG)
    rho = torch.exp(d) * md
    has = inputs.lengths > 0
    s = inputs.seq_sum(inputs.d)[has].clamp(-SAFE_LOG, SAFE_LOG)
    rho_s = torch.exp(s)
    dv = d[mask]
    w = out.weights * md
    neg, pos = _signed_hists(dv)
    sneg, spos = _signed_hists(s)
    stats: Stats = {
        "n": md.sum(), "n_seq": has.double().sum(),
        "sum_rho": rho.sum(), "sum_rho2": (rho * rho).sum(),
        "d_max": dv.max() if dv.numel() else zero, "neg_d_max": (-dv).max() if dv.numel() else zero,
        "d_hist_neg": neg, "d_hist_pos": pos,
        "sum_seq_rho": rho_s.sum(), "sum_seq_rho2": (rho_s * rho_s).sum(),
        "seq_d_max": s.max() if s.numel() else zero, "seq_neg_d_max": (-s).max() if s.numel() else zero,
        "seq_hist_neg": sneg, "seq_hist_pos": spos,
        "sum_w": w.sum(), "sum_w2": (w * w).sum(),
        "n_clipped": out.clipped.double().sum(), "n_masked": out.masked.double().sum(),
        "n_seq_masked": (out.masked.any(-1) & has).double().sum(),
    }
    if inputs.advantages is not None:
        a = inputs.advantages * md
        stats.update({"sum_a": a.sum(), "sum_wa": (w * a).sum(), "sum_abs_a": a.abs().sum(),
                      "sum_w_abs_a": (w * a.abs()).sum()})
    if out.norm_factor is not None:  # already pooled (the same on every rank): max-reduced
        stats["norm_factor_max"] = torch.tensor(out.norm_factor, dtype=torch.float64, device=md.device)
    if plan is not None and len(plan.rules) > 1:
        for name, r in out.per_rule.items():
            stats[f"{name}.n_clipped"] = (r.clipped & mask).double().sum()
            stats[f"{name}.n_masked"] = (r.masked & mask).double().sum()
    return stats


def finalize(stats: Stats) -> Dict[str, float]:
    """The ``correction/*`` metrics (python floats, keys as in the module table) from (pooled) statistics."""
    s = {k: float(v) for k, v in stats.items() if v.dim() == 0}
    n, n_seq = s["n"], s["n_seq"]
    out = {"correction/num_tokens": n, "correction/num_seqs": n_seq}
    if n == 0:
        return out
    h = {k: stats[k].double().cpu() for k in ("d_hist_neg", "d_hist_pos", "seq_hist_neg", "seq_hist_pos")}
    out.update({
        "correction/raw/ratio_mean": s["sum_rho"] / n,
        "correction/raw/ratio_p1": math.exp(signed_quantile(h["d_hist_neg"], h["d_hist_pos"], 0.01,
                                                            -s["neg_d_max"], s["d_max"])),
        "correction/raw/ratio_p99": math.exp(signed_quantile(h["d_hist_neg"], h["d_hist_pos"], 0.99,
                                                             -s["neg_d_max"], s["d_max"])),
        "correction/raw/ratio_max": math.exp(s["d_max"]),
        "correction/raw/chi2_token": s["sum_rho2"] / n - 1.0,
        "correction/raw/ess_token": s["sum_rho"] ** 2 / (n * s["sum_rho2"]),
        "correction/raw/seq_ratio_mean": s["sum_seq_rho"] / n_seq,
        "correction/raw/seq_ratio_p1": math.exp(signed_quantile(h["seq_hist_neg"], h["seq_hist_pos"], 0.01,
                                                                -s["seq_neg_d_max"], s["seq_d_max"])),
        "correction/raw/seq_ratio_p99": math.exp(signed_quantile(h["seq_hist_neg"], h["seq_hist_pos"], 0.99,
                                                                 -s["seq_neg_d_max"], s["seq_d_max"])),
        "correction/raw/seq_ratio_max": math.exp(s["seq_d_max"]),
        "correction/raw/chi2_seq": s["sum_seq_rho2"] / n_seq - 1.0,
        "correction/raw/ess_seq": s["sum_seq_rho"] ** 2 / (n_seq * s["sum_seq_rho2"]),
        "correction/frac_clipped": s["n_clipped"] / n,
        "correction/frac_masked": s["n_masked"] / n,
        "correction/frac_seqs_masked": s["n_seq_masked"] / n_seq,
        "correction/weight_mean": s["sum_w"] / n,
        "correction/ess": s["sum_w"] ** 2 / (n * s["sum_w2"]) if s["sum_w2"] > 0 else 0.0,
    })
    if "sum_a" in s:
        out["correction/loss_change"] = (s["sum_a"] - s["sum_wa"]) / n
        out["correction/signal_kept"] = s["sum_w_abs_a"] / s["sum_abs_a"] if s["sum_abs_a"] > 0 else 1.0
    if "norm_factor_max" in s:
        out["correction/batch_norm_factor"] = s["norm_factor_max"]
    for key in sorted(k for k in s if k.endswith(".n_masked")):
        name = key[: -len(".n_masked")]
        out[f"correction/{name}/frac_clipped"] = s[f"{name}.n_clipped"] / n
        out[f"correction/{name}/frac_masked"] = s[key] / n
    return out


Pool = Callable[[Stats], Stats]


def correction_metrics(inputs: CorrectionInputs, plan: CorrectionPlan,
                       all_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                       pool: Optional[Pool] = None) -> tuple[Dict[str, float], PlanOutput]:
    """(the ``correction/*`` metrics of ``plan`` on ``inputs``, its output). ``all_sum`` / ``pool``: data parallel's
    sum of a tensor and pooling of a stats dict (``reduction``); None = these rows are the whole batch."""
    out = plan.apply(inputs, all_sum=all_sum)
    stats = correction_stats(inputs, out, plan)
    return finalize(pool(stats) if pool is not None else stats), out
