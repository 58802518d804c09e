"""Shared pieces of the sequence-level algorithms (RLOO, GSPO, PMD, REINFORCE++-baseline).

Outcome-reward algorithms compute ONE advantage per sequence. To fit the uniform
``adv_fn(AdvantageInputs, cfg) -> Tensor[S, T]`` signature it is broadcast over the
sequence's valid tokens (``broadcast_to_tokens``); a sequence-level loss recovers it
with ``per_sequence``, which reads the value at the sequence's first valid token and
refuses a row that is not constant over its valid tokens (per-token advantages, e.g.
GAE's, handed to a sequence-level loss would otherwise be silently truncated).

Group layout is the one of ``AdvantageInputs``: samples are group-contiguous, sample
``i`` answers prompt ``i // group_size``.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

# Bessel-corrected variance plus this under the square root, as TRL's ``masked_whiten``
# and verl's ``verl_F.masked_whiten``.
WHITEN_EPS = 1e-8


def check_finite_rewards(who: str, rewards: torch.Tensor) -> None:
    """ValueError naming the first (up to 10) sequence indices whose reward is NaN/inf."""
    finite = torch.isfinite(rewards.detach())
    if not finite.all():
        bad = torch.nonzero(~finite).flatten().tolist()
        raise ValueError(f"{who}: rewards are not finite at sequence indices {bad[:10]}")


def grouped_rewards(who: str, rewards: torch.Tensor, group_size: int, min_size: int = 2) -> torch.Tensor:
    """rewards [S] -> float64 [S / group_size, group_size], after checking they are finite.

    ``min_size``: the smallest group the caller's baseline is defined for.
    """
    if group_size < min_size:
        raise ValueError(f"{who}: group_size must be >= {min_size} for a group baseline, got {group_size}")
    check_finite_rewards(who, rewards)
    return rewards.detach().to(torch.float64).reshape(-1, group_size)


def constant_groups(r: torch.Tensor) -> torch.Tensor:
    """[G, n] -> [G, 1] bool: the group's rewards are all exactly equal (no signal).

    Used to return exact zeros for such groups: mean() of equal floats can miss them by
    an ulp (0.1 x 3 in float64: -1.4e-17), which any later normalisation would amplify.
    """
    return (r == r[:, :1]).all(dim=-1, keepdim=True)


def leave_one_out_mean(r: torch.Tensor) -> torch.Tensor:
    """[G, n] -> [G, n]: mean of the OTHER n - 1 rewards of each sample's group, n >= 2.

    b_i = (sum_j r_j - r_i) / (n - 1)   (RLOO, Ahmadian et al., arXiv 2402.14740)
    """
    n = r.shape[-1]
    return (r.sum(dim=-1, keepdim=True) - r) / (n - 1)


def broadcast_to_tokens(per_seq: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """per_seq [S] -> [S, T] in ``dtype``: the sequence's value on each valid token, exactly 0 on padding."""
    x = per_seq.reshape(-1, 1).to(dtype)
    return torch.where(mask != 0, x, torch.zeros((), dtype=dtype, device=x.device))


def sequence_lengths(mask: torch.Tensor) -> torch.Tensor:
    """mask [S, T] -> [S] int64: valid tokens per sequence (|y_i|)."""
    return (mask != 0).sum(dim=-1)


def per_sequence(who: str, name: str, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[S, T] constant-per-sequence tensor -> [S] (detached): its value at each row's first valid token.

    Rows without valid tokens give 0. Raises ValueError if a row is not constant over its
    valid tokens (compared exactly: a broadcast value is bit-identical on every token) or
    holds NaN/inf on a valid token. ``who``/``name`` only label the error message.
    """
    valid = mask != 0
    x = x.detach()
    bad = valid & ~torch.isfinite(x)
    if bad.any():
        rows = torch.nonzero(bad.any(dim=-1)).flatten().tolist()
        raise ValueError(f"{who}: {name} are not finite on valid tokens of rows {rows[:10]}")
    first = valid.to(torch.int32).argmax(dim=-1)  # index of the first valid token (0 for empty rows)
    value = x.gather(-1, first[:, None])
    same = torch.where(valid, x == value, torch.ones((), dtype=torch.bool, device=x.device)).all(dim=-1)
    if not same.all():
        rows = torch.nonzero(~same).flatten().tolist()
        raise ValueError(
            f"{who}: {name} must be one value per sequence (broadcast over its valid tokens), "
            f"but rows {rows[:10]} vary across tokens; a sequence-level loss cannot use per-token {name}"
        )
    has_tokens = valid.any(dim=-1)
    return torch.where(has_tokens, value.squeeze(-1), torch.zeros((), dtype=x.dtype, device=x.device))


def sequence_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Delta_i = sum_t (logprobs - old_logprobs) over the valid tokens of each row: [S].

    Gradient flows to ``logprobs``; ``old_logprobs`` is detached. Padding is ignored even if
    NaN/inf (masked with ``where`` before the subtraction, so no NaN reaches the gradient).
    Computed in at least float32.
    """
    valid = mask != 0
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logprobs.device)
    lp = torch.where(valid, logprobs.to(dtype), zero)
    old = torch.where(valid, old_logprobs.detach().to(dtype), zero)
    return (lp - old).sum(dim=-1)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = WHITEN_EPS,
           all_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """Masked whitening of ``x`` [S, T] over its valid tokens; exactly 0 on padding.

        m = mean of the valid x,  v = sum (x - m)^2 / (N - 1)   (Bessel-corrected, N valid tokens)
        out = (x - m) / sqrt(v + eps)          if shift_mean
        out = (x - m) / sqrt(v + eps) + m      otherwise (scale only, keep the mean)

    As TRL's ``masked_whiten`` (PPO advantages) and verl's ``masked_whiten`` (REINFORCE++).
    ``all_sum``: with data parallel, sums a tensor over the ranks (``DataParallel.all_sum``),
    so m, v and N are the whole batch's, as one process holding every rank's rows would
    compute them (two reductions: the sum and count, then the squared deviations); None =
    ``x`` is the whole batch.
    Raises ValueError with fewer than 2 valid tokens (the unbiased variance is undefined).
    Padding values are ignored even if NaN/inf. Returns a detached tensor (advantages and
    rewards are constants of the loss) computed in at least float32.
    """
    if x.shape != mask.shape:
        raise ValueError(f"whiten: mask has shape {tuple(mask.shape)}, expected {tuple(x.shape)} (x's)")
    total = all_sum or (lambda t: t)
    valid = mask != 0
    dtype = torch.promote_types(x.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=x.device)
    xv = torch.where(valid, x.detach().to(dtype), zero)
    # float64 for the reduction: exact for the count, and the sum's own value comes back unchanged.
    sum_and_count = total(torch.stack([xv.sum().double(), valid.sum().double()]))
    n = int(sum_and_count[1].item())
    if n < 2:
        raise ValueError(f"whiten: needs at least 2 valid tokens for an unbiased variance, got {n}")
    mean = sum_and_count[0].to(dtype) / n
    centred = torch.where(valid, xv - mean, zero)
    var = total(centred.square().sum().double()).to(dtype) / (n - 1)
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, zero)


def sequence_terms(who: str, batch) -> tuple[torch.Tensor, torch.dtype, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every sequence-level loss starts from, for a ``LossInputs`` batch:
    (valid [S, T] bool, dtype (float32 at least), a zero of it, A [S] (``per_sequence`` of the
    advantages), Delta [S] (``sequence_log_ratio``: sum of log pi - log pi_old over valid tokens))."""
    valid = batch.mask != 0
    dtype = torch.promote_types(batch.logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=batch.logprobs.device)
    adv = per_sequence(who, "advantages", batch.advantages, batch.mask).to(dtype)
    return valid, dtype, zero, adv, sequence_log_ratio(batch.logprobs, batch.old_logprobs, batch.mask)
