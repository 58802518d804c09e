"""Importance weights that correct for the rollout/trainer mismatch (TIS, MIS, sequence MIS).

Tokens are sampled by the engine (pi_rollout) but the loss is computed under the trainer's
policy (pi_train); even with identical weights the two differ numerically (kernels,
precision). A training loss multiplies its per-token loss by ``weights`` to correct for
that. With ``lp_t`` / ``lp_r`` the trainer's / engine's log-prob of the sampled token,
``d = lp_t - lp_r`` (detached) and ``rho = exp(d)``, on valid tokens (``mask``):

| mode      | weight                                                                 |
|-----------|------------------------------------------------------------------------|
| none      | 1                                                                      |
| tis       | min(rho, tis_cap)                   token-level truncated IS           |
| mis       | 1 if low <= rho <= high else 0      token-level masking                |
| seq_mis   | 1 if low <= exp(mean_t d) <= high else 0, for every token of the row   |

Padding (mask = 0) always gets weight 0, and its values are never read (they may be inf/NaN).

* ``tis``: Yao, Liu, et al. (2025), "Your Efficient RL Framework Secretly Brings You
  Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl ; verl's rollout
  importance sampling (``rollout_is``, token level, truncate mode).
* ``mis``: IcePop, Ling Team / inclusionAI (2025), "Every Step Evolves: Scaling
  Reinforcement Learning for Trillion-Scale Thinking Model" (Ring-1T), arXiv:2510.18855:
  tokens whose train/rollout probability ratio leaves a band are dropped from the gradient
  instead of being reweighted (their IS weight is unbounded, so truncation would still
  let them bias the update).
* ``seq_mis``: the same rule on the length-normalised (geometric-mean) sequence ratio
  exp(sum_t d / L), as verl's geometric-level rollout IS in mask mode; unlike the raw
  sequence ratio exp(sum_t d) it does not shrink/explode with length L.

Metrics (python floats; always all four keys, so a logger sees a stable set):

| key                        | definition                                                          |
|----------------------------|---------------------------------------------------------------------|
| correction/num_tokens      | N, the number of valid tokens                                       |
| correction/frac_clipped    | tis: share of valid tokens with rho > tis_cap; 0.0 in other modes   |
| correction/frac_masked     | share of valid tokens given weight 0 (the mis / seq_mis drop rate)  |
| correction/ess             | (sum w)^2 / (N * sum w^2) over valid tokens                         |

``correction/ess`` is the Kish effective sample size as a fraction of N (Kish 1965; Owen,
"Monte Carlo theory, methods and examples", ch. 9, https://artowen.su.domains/mc/):
1.0 when all weights are equal (no samples lost), down to 1/N when one token carries all
the weight. When every weight is 0 (all masked), or N = 0, it is 0.0 ("no effective
samples"), never NaN; with N = 0 the two shares are 0.0 (nothing was clipped or masked),
and ``correction/num_tokens`` = 0 tells that case apart.

Comparisons are done on d in float64 (``d > log(tis_cap)``, ``log(low) <= d <= log(high)``),
so a ratio within a few ulps of a bound may fall either side of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from parity.metrics import _check_finite, _check_mask

__all__ = ["CorrectionConfig", "importance_weights", "VALID_MODES"]

VALID_MODES = ("none", "tis", "mis", "seq_mis")


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class CorrectionConfig:
    """How to weight each token's loss; see the module docstring for the formulas.

    mode: one of ``VALID_MODES``.
    tis_cap: C in min(rho, C) for ``tis``; > 0.
    low, high: the kept band [low, high] of rho (``mis``) or of the geometric-mean sequence
        ratio (``seq_mis``); 0 < low < 1 < high, so a perfectly matched token is always kept.
    Frozen, so a validated config stays valid.
    """

    mode: str = "none"
    tis_cap: float = 2.0
    low: float = 0.5
    high: float = 2.0

    def __post_init__(self) -> None:
        if self.mode not in VALID_MODES:
            raise ValueError(f"mode: expected one of {list(VALID_MODES)}, got {self.mode!r}")
        if not (_is_real(self.tis_cap) and self.tis_cap > 0):
            raise ValueError(f"tis_cap: expected a finite number > 0, got {self.tis_cap!r}")
        if not (_is_real(self.low) and 0 < self.low < 1):
            raise ValueError(f"low: expected a finite number with 0 < low < 1, got {self.low!r}")
        if not (_is_real(self.high) and self.high > 1):
            raise ValueError(f"high: expected a finite number > 1, got {self.high!r}")


def importance_weights(
    train_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: CorrectionConfig,
) -> Tuple[torch.Tensor, Dict[str, float]]:
    """Per-token loss weights correcting for the engine/trainer mismatch, and their metrics.

    Args:
        train_logprobs: [S, T] trainer log-probs of the sampled tokens (may require grad;
            the weights never carry it: they are constants of the loss).
        rollout_logprobs: [S, T] engine log-probs of the same tokens.
        mask: [S, T] bool or 0/1, True on valid completion tokens; masked values are never read.
        cfg: a ``CorrectionConfig``.

    Returns:
        weights: [S, T] float32, detached, 0 on padding (see the module table per mode).
        metrics: dict with the ``correction/*`` keys of the module docstring.

    Raises:
        ValueError: bad shapes / mask values, or a non-finite log-prob at a valid position
            (the message names ``train_logprobs`` or ``rollout_logprobs``).
    """
    if not isinstance(cfg, CorrectionConfig):
        raise ValueError(f"cfg: expected a CorrectionConfig, got {type(cfg).__name__}")
    if not isinstance(train_logprobs, torch.Tensor) or train_logprobs.dim() != 2:
        raise ValueError(
            f"train_logprobs: expected a [S, T] tensor, got {tuple(getattr(train_logprobs, 'shape', ()))}"
        )
    if not isinstance(rollout_logprobs, torch.Tensor) or rollout_logprobs.shape != train_logprobs.shape:
        raise ValueError(
            f"rollout_logprobs: expected shape {tuple(train_logprobs.shape)} (as train_logprobs), got "
            f"{tuple(getattr(rollout_logprobs, 'shape', ()))}"
        )
    mask = _check_mask(mask, train_logprobs.shape)
    _check_finite(train_logprobs, mask, "train_logprobs")
    _check_finite(rollout_logprobs, mask, "rollout_logprobs")

    # Zero each side before subtracting: padding may hold inf/NaN, and inf - inf = NaN.
    zero = torch.zeros((), dtype=torch.float64, device=train_logprobs.device)
    d = torch.where(mask, train_logprobs.detach().double(), zero) - torch.where(
        mask, rollout_logprobs.detach().double(), zero
    )
    m = mask.double()
    n = float(m.sum())
    frac_clipped = 0.0

    if cfg.mode == "none":
        w = m
    elif cfg.mode == "tis":
        clipped = (d > math.log(cfg.tis_cap)) & mask
        w = torch.where(clipped, torch.full_like(d, cfg.tis_cap), torch.exp(d)) * m
        frac_clipped = float(clipped.sum()) / n if n > 0 else 0.0
    elif cfg.mode == "mis":
        keep = (d >= math.log(cfg.low)) & (d <= math.log(cfg.high))
        w = (keep & mask).double()
    elif cfg.mode == "seq_mis":
        seq_len = m.sum(-1)
        # Rows with no valid token get mean 0 here, but all their weights are 0 anyway.
        mean_d = d.sum(-1) / seq_len.clamp(min=1)
        keep = (mean_d >= math.log(cfg.low)) & (mean_d <= math.log(cfg.high))
        w = keep.double().unsqueeze(-1) * m
    else:  # unreachable: CorrectionConfig validates mode
        raise ValueError(f"cfg.mode: expected one of {list(VALID_MODES)}, got {cfg.mode!r}")

    sum_w, sum_w2 = float(w.sum()), float((w * w).sum())
    metrics = {
        "correction/num_tokens": n,
        "correction/frac_clipped": frac_clipped,
        "correction/frac_masked": float(((w == 0) & mask).sum()) / n if n > 0 else 0.0,
        "correction/ess": sum_w * sum_w / (n * sum_w2) if sum_w2 > 0 else 0.0,
    }
    return w.float(), metrics
