"""Per-token estimators of KL(pi_rollout || pi_train) from d = lp_t - lp_r on tokens the engine sampled.

Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html, with the ratio r = pi_train /
pi_rollout = exp(d) of a token drawn from pi_rollout:

- k1 = -d                   unbiased, signed: a rejection on k1 is a band on the ratio (``low <= rho <= high``)
- k2 = d**2 / 2             biased, symmetric, >= 0
- k3 = rho - 1 - d          unbiased, >= 0; asymmetric: a ratio above 1 costs more than its inverse below

The rejection rules compare these (per token, or their sequence sum / mean / max) with a threshold. All
functions take and return float64 [B, T] tensors; padding is the caller's to mask.
"""
from __future__ import annotations

import torch


def k1(d: torch.Tensor) -> torch.Tensor:
    return -d


def k2(d: torch.Tensor) -> torch.Tensor:
    return d * d / 2


def k3(d: torch.Tensor) -> torch.Tensor:
    return torch.expm1(d) - d  # expm1: exact near d = 0, where k3 ~ d**2 / 2


ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3}
