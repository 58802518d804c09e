"""Per-token estimators of KL(pi_theta || pi_ref) from tokens sampled from pi_theta.

With ``logr = ref_logprobs - logprobs`` = log(pi_ref(x) / pi_theta(x)) at the sampled token x
(Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):

- k1 = -logr                    unbiased, high variance, can be negative
- k2 = logr**2 / 2              biased, low variance, non-negative
- k3 = exp(logr) - logr - 1     unbiased, low variance, non-negative (GRPO's penalty,
                                DeepSeekMath arXiv 2402.03300 Eq. 4)

These differ from ``parity/kl_*``: those are batch means over the rollout-vs-trainer
log-ratio (no gradient); these are per-token penalty terms that carry gradient to
``logprobs`` (the policy), with ``ref_logprobs`` treated as constants.
All take and return [S, T] tensors, computed in at least float32; masking and
aggregation are the caller's job.
"""
from __future__ import annotations

import torch


def _log_ratio(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs has shape {tuple(ref_logprobs.shape)}, expected {tuple(logprobs.shape)} (logprobs')"
        )
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    return ref_logprobs.detach().to(dtype) - logprobs.to(dtype)


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = logprobs - ref_logprobs, shape [S, T]."""
    return -_log_ratio(logprobs, ref_logprobs)


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (logprobs - ref_logprobs)**2 / 2, shape [S, T]."""
    return _log_ratio(logprobs, ref_logprobs).square() / 2


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - lp) - (ref - lp) - 1, shape [S, T].

    Gradient w.r.t. logprobs: 1 - exp(ref - lp), i.e. 1 - pi_ref / pi_theta.
    """
    logr = _log_ratio(logprobs, ref_logprobs)
    return torch.expm1(logr) - logr  # expm1: exact near logr = 0, where k3 ~ logr**2 / 2


# exp(20) ~ 4.9e8: keeps the weight finite in float32 (the clipped surrogate clamps its log-ratio the same way).
_LOG_RATIO_CLAMP = 20.0


def behaviour_ratio(logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor) -> torch.Tensor:
    """r = pi_theta / pi_behaviour = exp(logprobs - behaviour_logprobs), [S, T], with gradient through ``logprobs``.

    The weight of the KL penalty's unbiased form (DeepSeek-AI, "DeepSeek-V3.2", arXiv 2512.02556, Sec. 3.1, Eq. 8:
    "unbiased KL estimate"; TRL's ``use_bias_correction_kl``): tokens are sampled from pi_behaviour (the engine), so
    E_behaviour[r * k3] = E_theta[k3] = KL(pi_theta || pi_ref), and since r carries the gradient,
    grad E_behaviour[r * k3] = grad KL(pi_theta || pi_ref) -- which k3 alone in the loss does not give. The
    log-ratio is clamped to +-20 (a token so far off is a broken batch).
    """
    if logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(f"behaviour_logprobs has shape {tuple(behaviour_logprobs.shape)}, expected "
                         f"{tuple(logprobs.shape)} (logprobs')")
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    log_r = logprobs.to(dtype) - behaviour_logprobs.detach().to(dtype)
    return torch.exp(log_r.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
