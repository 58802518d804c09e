"""Canonical parity metrics: how far the trainer's log-probs are from the rollout engine's.

One definition per key, here and nowhere else (the table in DESIGN.md mirrors it). Over
the valid completion tokens (``mask``), with ``lp_r`` the engine's log-prob of the sampled
token, ``lp_t`` the trainer's, ``d = lp_t - lp_r`` and ``rho = exp(d)``. Tokens were sampled
by the engine, so the k1/k2/k3 estimators estimate KL(pi_rollout || pi_train)
(Schulman, "Approximating KL divergence", http://joschu.net/blog/kl-approx.html).

| key                                 | definition                                                    |
|-------------------------------------|---------------------------------------------------------------|
| parity/num_tokens                   | number of valid tokens                                        |
| parity/mae                          | mean |d|                                                      |
| parity/rmse                         | sqrt(mean d^2)                                                |
| parity/pearson                      | Pearson correlation of lp_t and lp_r                          |
| parity/max_abs                      | max |d|                                                       |
| parity/p99_abs                      | 99th percentile (nearest rank) of |d|, from a histogram       |
| parity/kl_k1                        | mean(-d)                    (unbiased, noisy, can be < 0)     |
| parity/kl_k2                        | mean(d^2 / 2)               (biased, low variance)            |
| parity/kl_k3                        | mean(rho - 1 - d)           (unbiased, >= 0)                  |
| parity/prob_mae                     | mean |exp(lp_t) - exp(lp_r)|  (verl rollout_probs_diff_mean) |
| parity/pearson_prob                 | Pearson of exp(lp_t), exp(lp_r) (verl rollout_actor_probs_pearson_corr) |
| parity/token_mult_prob_error        | mean exp(|d|)               (NeMo-RL's; 1.0 is ideal)         |
| parity/frac_rho_outside_0.9_1.1     | share of tokens with rho < 0.9 or rho > 1.1                   |
| parity/chi2                         | mean(rho^2) - 1             (chi^2(pi_train || pi_rollout) estimate; verl rollout_corr) |
| parity/rho_min, parity/rho_max      | min / max of rho over the tokens                              |
| parity/seq_log_ratio_mean           | mean over sequences of S = sum_t d (log sequence IS ratio)    |
| parity/seq_log_ratio_abs_max        | max over sequences of |S|                                     |
| parity/seq_log_ratio_norm_mean      | mean over sequences of S / L (log geometric-mean token ratio) |
| parity/seq_log_ratio_norm_abs_max   | max over sequences of |S / L|                                 |
| parity/topk_kl                      | KL(rollout || train) on the engine's top-k + "rest" buckets   |
| parity/turn_<k>/mae, .../kl_k3      | mae and kl_k3 over the sampled tokens of assistant turn k     |

(L = the sequence's number of valid tokens; sequences with L = 0 are not counted.)

Reduction across data-parallel ranks. ``sufficient_stats`` returns float64 tensors that
combine exactly: keys ending in ``_max`` by max, every other key by sum (``reduction(key)``
says which; ``torch.distributed.all_reduce`` with SUM / MAX does it in place). Pearson is
then computed from the pooled sums, not as a mean of per-rank correlations. The one
statistic that cannot be pooled exactly, the 99th percentile, comes from a pooled
histogram of |d| with 100 log-spaced bins per decade over [1e-7, 1e3) plus an underflow
and an overflow bin; the reported value is the upper edge of the bin holding the
nearest-rank 99th percentile, capped at max |d|. It is therefore never below the exact
value and at most 10**0.01 - 1 = 2.3% above it (or 1e-7 absolute, below 1e-7).

Edge cases (never a NaN to the logger):
* no valid tokens: ``finalize`` returns only ``parity/num_tokens`` = 0 (and ``parity/topk_kl``
  if top-k statistics with tokens were given); the other keys are omitted rather than
  zeroed, because 0 would read as "perfect parity";
* zero variance on either side (or fewer than 2 tokens): ``parity/pearson`` is 1.0 if the
  two sides are identical on every token (max |d| = 0) and 0.0 otherwise; the same rule
  for ``parity/pearson_prob``. A variance counts as zero when it is below 1e-12 of the
  raw second moment (float64 round-off of the pooled sums);
* a non-finite log-prob (-inf, +inf, NaN) at a valid position raises ValueError naming the
  side and the count; values at masked positions are never read.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence

import torch

__all__ = [
    "compare",
    "compare_by_turn",
    "turn_index",
    "sufficient_stats",
    "merge_stats",
    "finalize",
    "reduction",
    "topk_kl",
    "topk_kl_stats",
    "error_by_position",
    "error_by_rollout_prob",
    "error_by_entropy",
    "worst_tokens",
    "TokenRow",
    "RHO_LOW",
    "RHO_HIGH",
]

RHO_LOW, RHO_HIGH = 0.9, 1.1

# |d| histogram for the pooled p99: bin 0 = [0, LO), bins 1..DECADES*PER_DECADE are
# log-spaced over [LO, LO * 10**DECADES), the last bin is [HI, inf).
_HIST_LO = 1e-7
_HIST_PER_DECADE = 100
_HIST_DECADES = 10
_HIST_BINS = _HIST_DECADES * _HIST_PER_DECADE + 2

_ZERO_VAR_REL = 1e-12

Stats = Dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------


def _check_mask(mask: torch.Tensor, shape, name: str = "mask") -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.shape != shape:
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(getattr(mask, 'shape', ()))}")
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError(f"{name}: expected bool or 0/1 values, got other values (dtype {mask.dtype})")
        mask = mask != 0
    return mask


def _check_finite(x: torch.Tensor, mask: torch.Tensor, name: str, allow_neg_inf: bool = False) -> None:
    bad = ~torch.isfinite(x) & mask
    if allow_neg_inf:
        bad &= x != -math.inf
    if bool(bad.any()):
        vals = x[bad]
        n_neg = int((vals == -math.inf).sum())
        n_pos = int((vals == math.inf).sum())
        n_nan = int(torch.isnan(vals).sum())
        why = []  # only the causes the values point at
        if n_neg:
            why.append("a -inf log-prob means that side gave the sampled token zero probability (e.g. a top-k/top-p "
                       "filtered distribution)")
        if n_nan or n_pos:
            why.append("a NaN (or +inf) log-prob means that side's forward did not compute a number: its weights or "
                       "activations are not finite (an overflow, or an update that wrote NaN)")
        raise ValueError(f"{name}: {int(bad.sum())} of {int(mask.sum())} valid (mask=1) tokens are not finite "
                         f"({n_neg} -inf, {n_pos} +inf, {n_nan} nan); " + "; ".join(why))


def _prepare(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor):
    """Validate; return float64 copies with masked positions zeroed, and the bool mask."""
    if not isinstance(train, torch.Tensor) or train.dim() != 2:
        raise ValueError(f"train_logprobs: expected a [B, T] tensor, got {tuple(getattr(train, 'shape', ()))}")
    if not isinstance(rollout, torch.Tensor) or rollout.shape != train.shape:
        raise ValueError(
            f"rollout_logprobs: expected shape {tuple(train.shape)} (as train_logprobs), got "
            f"{tuple(getattr(rollout, 'shape', ()))}"
        )
    mask = _check_mask(mask, train.shape)
    _check_finite(train, mask, "train_logprobs")
    _check_finite(rollout, mask, "rollout_logprobs")
    zero = torch.zeros((), dtype=torch.float64, device=train.device)
    t = torch.where(mask, train.detach().double(), zero)
    r = torch.where(mask, rollout.detach().double(), zero)
    return t, r, mask


# ----------------------------------------------------------------------------------
# Sufficient statistics
# ----------------------------------------------------------------------------------


def reduction(key: str) -> str:
    """How statistic ``key`` combines across shards: "max" for ``*_max`` keys, else "sum"."""
    return "max" if key.endswith("_max") else "sum"


def _abs_hist(a: torch.Tensor) -> torch.Tensor:
    """Counts of the 1-D non-negative values ``a`` in the p99 histogram bins (float64 [_HIST_BINS])."""
    inner = torch.floor(torch.log10(a.clamp(min=_HIST_LO) / _HIST_LO) * _HIST_PER_DECADE).long() + 1
    idx = torch.where(a < _HIST_LO, torch.zeros_like(inner), inner.clamp(max=_HIST_BINS - 1))
    return torch.bincount(idx, minlength=_HIST_BINS).double()


def _hist_quantile(hist: torch.Tensor, q: float, cap: float) -> float:
    """Upper edge of the bin holding the nearest-rank q-quantile, capped at ``cap`` (the max)."""
    n = float(hist.sum())
    rank = max(1, math.ceil(q * n - 1e-9))
    k = int(torch.searchsorted(torch.cumsum(hist, 0), float(rank)))  # a scalar: on the histogram's device
    upper = _HIST_LO * 10 ** (k / _HIST_PER_DECADE) if k < _HIST_BINS - 1 else math.inf
    return min(upper, cap)


def log10_abs_histogram(hist: torch.Tensor, per_decade: int = 10) -> tuple[list[float], list[float]]:
    """The pooled |d| histogram (``stats["abs_d_hist"]``) as (counts, edges) over log10 |d|, for wandb.

    The p99 histogram's 100 bins per decade are summed into ``per_decade`` (which must divide
    100); the bin of |d| < 1e-7 (exact zeros included) becomes [-8, -7), the overflow bin
    (|d| >= 1e3) [3, 4). Empty bins before the first and after the last count are dropped, so
    the chart spans the data (one bin [-8, -7) when there is no count at all).
    """
    if _HIST_PER_DECADE % per_decade:
        raise ValueError(f"per_decade={per_decade}: must divide {_HIST_PER_DECADE}")
    h = hist.double().cpu()
    inner = h[1:-1].reshape(-1, _HIST_PER_DECADE // per_decade).sum(1)
    counts = [float(h[0]), *inner.tolist(), float(h[-1])]
    lo = math.log10(_HIST_LO)
    edges = [lo - 1.0, *[lo + k / per_decade for k in range(len(inner) + 1)], lo + _HIST_DECADES + 1.0]
    nz = [i for i, c in enumerate(counts) if c > 0]
    first, last = (nz[0], nz[-1]) if nz else (0, 0)
    return counts[first:last + 1], [round(e, 6) for e in edges[first:last + 2]]


def sufficient_stats(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    train_topk_logprobs: Optional[torch.Tensor] = None,
    rollout_topk_logprobs: Optional[torch.Tensor] = None,
) -> Stats:
    """Additive (or max-reducible) float64 statistics from which ``finalize`` computes every metric.

    Args:
        train_logprobs, rollout_logprobs: [B, T] log-probs of the sampled tokens.
        mask: [B, T] bool or 0/1, True on valid completion tokens.
        train_topk_logprobs, rollout_topk_logprobs: optional [B, T, k], see ``topk_kl``.

    Returns:
        dict of 0-d tensors (and the [1002] histogram ``abs_d_hist``); combine shards with
        ``merge_stats`` or all_reduce each value with ``reduction(key)``.
    """
    t, r, mask = _prepare(train_logprobs, rollout_logprobs, mask)
    m = mask.double()
    d = t - r  # zero at masked positions
    ad = d.abs()
    pt, pr = torch.exp(t) * m, torch.exp(r) * m
    seq_len = m.sum(-1)
    has = seq_len > 0
    seq = d.sum(-1)[has]
    seq_norm = seq / seq_len[has]
    zero = torch.zeros((), dtype=torch.float64, device=d.device)
    stats: Stats = {
        "n": m.sum(),
        "sum_d": d.sum(),
        "sum_abs_d": ad.sum(),
        "sum_d2": (d * d).sum(),
        "sum_k3": ((torch.expm1(d) - d) * m).sum(),
        "sum_exp_abs_d": (torch.exp(ad) * m).sum(),
        "n_rho_out": (((d < math.log(RHO_LOW)) | (d > math.log(RHO_HIGH))) & mask).double().sum(),
        "sum_rho2": (torch.exp(2 * d) * m).sum(),
        # max over valid tokens of d and of -d (both max-reducible): rho_max, rho_min
        "d_max": torch.where(mask, d, -math.inf).max() if mask.any() else zero,
        "neg_d_max": torch.where(mask, -d, -math.inf).max() if mask.any() else zero,
        "abs_d_max": ad.max() if ad.numel() else zero,
        "abs_d_hist": _abs_hist(ad[mask]),
        "sum_t": t.sum(),
        "sum_r": r.sum(),
        "sum_t2": (t * t).sum(),
        "sum_r2": (r * r).sum(),
        "sum_tr": (t * r).sum(),
        "sum_pt": pt.sum(),
        "sum_pr": pr.sum(),
        "sum_pt2": (pt * pt).sum(),
        "sum_pr2": (pr * pr).sum(),
        "sum_ptpr": (pt * pr).sum(),
        "sum_abs_dp": (pt - pr).abs().sum(),
        "n_seq": has.double().sum(),
        "sum_seq": seq.sum(),
        "seq_abs_max": seq.abs().max() if seq.numel() else zero,
        "sum_seq_norm": seq_norm.sum(),
        "seq_norm_abs_max": seq_norm.abs().max() if seq_norm.numel() else zero,
    }
    if (train_topk_logprobs is None) != (rollout_topk_logprobs is None):
        raise ValueError("train_topk_logprobs / rollout_topk_logprobs: give both or neither")
    if train_topk_logprobs is not None:
        stats.update(topk_kl_stats(train_topk_logprobs, rollout_topk_logprobs, mask))
    return stats


def merge_stats(stats_list: Iterable[Stats]) -> Stats:
    """Combine statistics of disjoint token sets (shards, micro-batches) exactly."""
    stats_list = list(stats_list)
    if not stats_list:
        raise ValueError("stats_list: expected at least one stats dict, got none")
    keys = set(stats_list[0])
    for i, s in enumerate(stats_list[1:], 1):
        if set(s) != keys:
            raise ValueError(f"stats_list[{i}]: keys {sorted(set(s) ^ keys)} differ from stats_list[0]'s")
    out: Stats = {}
    for k in stats_list[0]:
        vals = torch.stack([s[k] for s in stats_list])
        out[k] = vals.amax(0) if reduction(k) == "max" else vals.sum(0)
    return out


def _pearson(n, sx, sy, sxx, syy, sxy, identical: bool) -> float:
    var_x = sxx - sx * sx / n
    var_y = syy - sy * sy / n
    if n < 2 or var_x <= _ZERO_VAR_REL * sxx or var_y <= _ZERO_VAR_REL * syy:
        return 1.0 if identical else 0.0
    cov = sxy - sx * sy / n
    return max(-1.0, min(1.0, cov / math.sqrt(var_x * var_y)))


def finalize(stats: Stats) -> Dict[str, float]:
    """Metric values (python floats, keys as in the module table) from (merged) statistics."""
    s = {k: float(v) for k, v in stats.items() if k != "abs_d_hist"}
    out: Dict[str, float] = {"parity/num_tokens": s["n"]}
    if s.get("topk_num_tokens", 0.0) > 0:
        out["parity/topk_kl"] = s["topk_kl_sum"] / s["topk_num_tokens"]
    n = s["n"]
    if n == 0:
        return out
    identical = s["abs_d_max"] == 0.0
    out.update({
        "parity/mae": s["sum_abs_d"] / n,
        "parity/rmse": math.sqrt(s["sum_d2"] / n),
        "parity/pearson": _pearson(n, s["sum_t"], s["sum_r"], s["sum_t2"], s["sum_r2"], s["sum_tr"], identical),
        "parity/max_abs": s["abs_d_max"],
        "parity/p99_abs": _hist_quantile(stats["abs_d_hist"].double().cpu(), 0.99, s["abs_d_max"]),
        "parity/kl_k1": -s["sum_d"] / n,
        "parity/kl_k2": s["sum_d2"] / (2 * n),
        "parity/kl_k3": s["sum_k3"] / n,
        "parity/prob_mae": s["sum_abs_dp"] / n,
        "parity/pearson_prob": _pearson(
            n, s["sum_pt"], s["sum_pr"], s["sum_pt2"], s["sum_pr2"], s["sum_ptpr"], identical
        ),
        "parity/token_mult_prob_error": s["sum_exp_abs_d"] / n,
        "parity/frac_rho_outside_0.9_1.1": s["n_rho_out"] / n,
        "parity/chi2": s["sum_rho2"] / n - 1.0,
        "parity/rho_min": math.exp(-s["neg_d_max"]),
        "parity/rho_max": math.exp(s["d_max"]),
        "parity/seq_log_ratio_mean": s["sum_seq"] / s["n_seq"],
        "parity/seq_log_ratio_abs_max": s["seq_abs_max"],
        "parity/seq_log_ratio_norm_mean": s["sum_seq_norm"] / s["n_seq"],
        "parity/seq_log_ratio_norm_abs_max": s["seq_norm_abs_max"],
    })
    return out


def compare(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    train_topk_logprobs: Optional[torch.Tensor] = None,
    rollout_topk_logprobs: Optional[torch.Tensor] = None,
) -> Dict[str, float]:
    """All scalar parity metrics for one batch: ``finalize(sufficient_stats(...))``.

    Args:
        train_logprobs, rollout_logprobs: [B, T] float log-probs of the sampled tokens.
        mask: [B, T] bool / 0-1, True on valid completion tokens (prompt and padding False).
        train_topk_logprobs, rollout_topk_logprobs: optional [B, T, k]; adds ``parity/topk_kl``.
    """
    return finalize(
        sufficient_stats(
            train_logprobs, rollout_logprobs, mask,
            train_topk_logprobs=train_topk_logprobs, rollout_topk_logprobs=rollout_topk_logprobs,
        )
    )


def turn_index(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] long: the assistant turn (1, 2, ...) of each valid token, 0 where ``mask`` is 0.

    In a multi-turn episode the completion is one token stream: each assistant turn's sampled tokens,
    then the environment's reply (context, mask 0), then the next turn. A turn is therefore a maximal
    run of valid tokens: turn k starts at the k-th 0 -> 1 step of the mask along a row. A single-turn
    completion is turn 1 throughout.
    """
    m = _check_mask(mask, mask.shape).long()
    starts = m - torch.nn.functional.pad(m[:, :-1], (1, 0))
    return (starts.clamp(min=0).cumsum(1) * m).long()


def compare_by_turn(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    num_turns: Optional[int] = None,
    *,
    stats: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Stats]] = None,
) -> Dict[str, float]:
    """``parity/turn_<k>/mae`` and ``parity/turn_<k>/kl_k3`` for k = 1 .. ``num_turns`` (default: the most turns in the
    batch), each over the tokens ``turn_index`` assigns to turn k; a turn no row reached reports NaN.

    ``stats``: how a turn's sufficient statistics are gathered (default ``sufficient_stats`` of these tensors; data
    parallel passes its pooled version, which every rank must call the same ``num_turns`` times)."""
    turns = turn_index(mask)
    k_max = int(turns.max().item()) if num_turns is None and turns.numel() else int(num_turns or 0)
    gather = stats or sufficient_stats
    out: Dict[str, float] = {}
    for k in range(1, k_max + 1):
        fin = finalize(gather(train_logprobs, rollout_logprobs, turns == k))
        out[f"parity/turn_{k}/mae"] = fin.get("parity/mae", float("nan"))
        out[f"parity/turn_{k}/kl_k3"] = fin.get("parity/kl_k3", float("nan"))
    return out


# ----------------------------------------------------------------------------------
# Top-k KL
# ----------------------------------------------------------------------------------


def topk_kl_stats(
    train_topk_logprobs: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    rest_floor: float = 1e-12,
) -> Stats:
    """Summed bucket KL and token count (``topk_kl_sum``, ``topk_num_tokens``); see ``topk_kl``."""
    if not isinstance(rollout_topk_logprobs, torch.Tensor) or rollout_topk_logprobs.dim() != 3:
        raise ValueError(
            f"rollout_topk_logprobs: expected a [B, T, k] tensor, got "
            f"{tuple(getattr(rollout_topk_logprobs, 'shape', ()))}"
        )
    if not isinstance(train_topk_logprobs, torch.Tensor) or train_topk_logprobs.shape != rollout_topk_logprobs.shape:
        raise ValueError(
            f"train_topk_logprobs: expected shape {tuple(rollout_topk_logprobs.shape)} (as rollout_topk_logprobs), "
            f"got {tuple(getattr(train_topk_logprobs, 'shape', ()))}"
        )
    if not rest_floor > 0:
        raise ValueError(f"rest_floor: expected > 0, got {rest_floor!r}")
    mask = _check_mask(mask, rollout_topk_logprobs.shape[:2])
    tok_mask = mask.unsqueeze(-1).expand_as(rollout_topk_logprobs)
    lr = rollout_topk_logprobs.detach().double()
    lt = train_topk_logprobs.detach().double()
    # The engine may report -inf for a top-k entry it gives zero probability; that bucket
    # then contributes 0. So may the trainer where the engine does too (truncated sampling: both sides normalise
    # over the engine's kept set, outside which both give probability 0). A zero train probability under a
    # positive rollout one makes the KL infinite, which is a bug to surface, not log.
    _check_finite(lr, tok_mask, "rollout_topk_logprobs", allow_neg_inf=True)
    _check_finite(lt, tok_mask, "train_topk_logprobs", allow_neg_inf=True)
    lost = tok_mask & torch.isneginf(lt) & torch.isfinite(lr)
    if bool(lost.any()):
        raise ValueError(f"train_topk_logprobs: {int(lost.sum())} top-k entries have probability 0 on the trainer's "
                         "side and a positive one on the engine's (an infinite KL)")
    zero = torch.zeros((), dtype=torch.float64, device=lr.device)
    lr = torch.where(tok_mask, lr, zero)
    lt = torch.where(tok_mask, lt, zero)
    q, p = torch.exp(lr), torch.exp(lt)
    head = torch.where(q > 0, q * (lr - lt), zero).sum(-1)
    rest_q = (1.0 - q.sum(-1)).clamp(min=rest_floor)
    rest_p = (1.0 - p.sum(-1)).clamp(min=rest_floor)
    kl = head + rest_q * (torch.log(rest_q) - torch.log(rest_p))
    return {"topk_kl_sum": torch.where(mask, kl, zero).sum(), "topk_num_tokens": mask.double().sum()}


def topk_kl(
    train_topk_logprobs: torch.Tensor,
    rollout_topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    rest_floor: float = 1e-12,
) -> float:
    """KL(rollout || train) on the engine's top-k tokens plus one "rest" bucket, averaged over valid positions.

    Args:
        train_topk_logprobs: [B, T, k] trainer log-probs of the engine's top-k token ids.
        rollout_topk_logprobs: [B, T, k] engine log-probs of the same ids (-inf allowed: prob 0).
        mask: [B, T] valid positions.
        rest_floor: the rest bucket's mass, 1 - sum of the k probabilities, is clamped at
            this floor (it can be <= 0 from rounding when the top-k hold almost all the mass).

    Per position, with q the engine's and p the trainer's bucket probabilities
    (q_i = exp(rollout_i) for the k tokens, q_rest = max(1 - sum_i q_i, rest_floor); p alike):
        KL = sum_i q_i (log q_i - log p_i) + q_rest (log q_rest - log p_rest).
    Merging tokens into buckets is a deterministic map of the outcome, so by the
    data-processing inequality this is a lower bound on the full-vocabulary
    KL(pi_rollout || pi_train) at that position (Cover & Thomas, Elements of Information
    Theory, 2nd ed., Thm 2.8.1 / the log-sum inequality). The bound is exact up to input
    rounding: float32 log-probs resolve the rest bucket to ~1e-7.

    Returns 0.0 when no position is valid.
    """
    s = topk_kl_stats(train_topk_logprobs, rollout_topk_logprobs, mask, rest_floor=rest_floor)
    n = float(s["topk_num_tokens"])
    return float(s["topk_kl_sum"]) / n if n > 0 else 0.0


# ----------------------------------------------------------------------------------
# Breakdowns (plain python rows, for tables and plots)
# ----------------------------------------------------------------------------------


def _binned(values: torch.Tensor, d: torch.Tensor, edges: Sequence[float], start_key: str, end_key: str):
    """Rows {start_key, end_key, num_tokens, mean_abs_d, mean_d} per non-empty bin [e_i, e_i+1).

    The last bin is closed on the right; values outside [edges[0], edges[-1]] are not counted.
    """
    edges = [float(e) for e in edges]
    if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"edges: expected at least two strictly increasing values, got {edges}")
    rows = []
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        last = i == len(edges) - 2
        sel = (values >= lo) & ((values <= hi) if last else (values < hi))
        cnt = int(sel.sum())
        if cnt == 0:
            continue
        rows.append({
            start_key: lo, end_key: hi, "num_tokens": cnt,
            "mean_abs_d": float(d[sel].abs().mean()), "mean_d": float(d[sel].mean()),
        })
    return rows


def error_by_position(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    edges: Optional[Sequence[int]] = None,
) -> List[dict]:
    """Mean |d| by completion position, in buckets.

    The position of a valid token is the number of valid tokens before it in its row
    (0 = first completion token), so prompt and padding never shift it. Default buckets
    double in width: [0,1), [1,2), [2,4), [4,8), ... up to the longest completion.
    Returns rows {"position_start", "position_end", "num_tokens", "mean_abs_d", "mean_d"}
    for non-empty buckets ([start, end), the last one closed).
    """
    t, r, mask = _prepare(train_logprobs, rollout_logprobs, mask)
    pos = (torch.cumsum(mask.long(), -1) - 1)[mask].double()
    d = (t - r)[mask]
    if d.numel() == 0:
        return []
    if edges is None:
        top = int(pos.max()) + 1
        edges = [0] + [2**i for i in range(max(1, math.ceil(math.log2(top))) + 1)]
    return _binned(pos, d, edges, "position_start", "position_end")


def error_by_turn(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
) -> List[dict]:
    """Mean |d| by assistant turn of multi-turn episodes (``turn_index``; a single-turn batch is one turn).

    Returns rows {"turn", "num_tokens", "mean_abs_d", "mean_d"} for the turns some row reached."""
    t, r, mask = _prepare(train_logprobs, rollout_logprobs, mask)
    turns = turn_index(mask)[mask].double()
    d = (t - r)[mask]
    if d.numel() == 0:
        return []
    rows = _binned(turns, d, list(range(1, int(turns.max()) + 2)), "turn", "turn_end")
    return [{**{k: v for k, v in row.items() if k != "turn_end"}, "turn": int(row["turn"])} for row in rows]


def error_by_rollout_prob(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    edges: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
) -> List[dict]:
    """Mean |d| by the engine's probability of the sampled token, exp(lp_r), in bins.

    Returns rows {"prob_start", "prob_end", "num_tokens", "mean_abs_d", "mean_d"}
    for non-empty bins ([start, end), the last one closed).
    """
    t, r, mask = _prepare(train_logprobs, rollout_logprobs, mask)
    return _binned(torch.exp(r[mask]), (t - r)[mask], edges, "prob_start", "prob_end")


def error_by_entropy(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    entropy: torch.Tensor,
    edges: Sequence[float] = (0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0, math.inf),
) -> List[dict]:
    """Mean |d| by the trainer's entropy at the position (nats, e.g. from fused_logprobs), in bins.

    Returns rows {"entropy_start", "entropy_end", "num_tokens", "mean_abs_d", "mean_d"}
    for non-empty bins ([start, end), the last one closed).
    """
    t, r, mask = _prepare(train_logprobs, rollout_logprobs, mask)
    if not isinstance(entropy, torch.Tensor) or entropy.shape != mask.shape:
        raise ValueError(f"entropy: expected shape {tuple(mask.shape)}, got {tuple(getattr(entropy, 'shape', ()))}")
    _check_finite(entropy, mask, "entropy")
    return _binned(entropy.detach().double()[mask], (t - r)[mask], edges, "entropy_start", "entropy_end")


class TokenRow(NamedTuple):
    """One token of ``worst_tokens``: row index, column index in the [B, T] tensors, values."""

    sample: int
    position: int
    lp_t: float
    lp_r: float
    d: float


def worst_tokens(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    k: int = 10,
) -> List[TokenRow]:
    """The ``k`` valid tokens with the largest |d|, largest first (ties: earlier sample, position)."""
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k: expected a non-negative int, got {k!r}")
    t, r, mask = _prepare(train_logprobs, rollout_logprobs, mask)
    idx = mask.nonzero()  # row-major order, so a stable sort breaks ties by (sample, position)
    d = (t - r)[mask]
    order = torch.sort(d.abs(), descending=True, stable=True).indices[:k]
    return [
        TokenRow(int(idx[j, 0]), int(idx[j, 1]), float(t[idx[j, 0], idx[j, 1]]), float(r[idx[j, 0], idx[j, 1]]), float(d[j]))
        for j in order.tolist()
    ]
