"""Argument checks of the log-prob functions, their compute dtype, and the logit transform (package docstring)."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

IGNORE_INDEX = -100


class _Transform(NamedTuple):
    """z = mult * softcap(u): ``mult`` = logit_scale / T, ``cap`` None or the softcap."""

    mult: float
    cap: Optional[float]


def _transform(temperature, logit_softcap, logit_scale) -> _Transform:
    if logit_softcap is not None and not (isinstance(logit_softcap, (int, float)) and math.isfinite(logit_softcap)
                                          and logit_softcap > 0):
        raise ValueError(f"logit_softcap: expected None or a finite number > 0, got {logit_softcap!r}")
    if not (isinstance(logit_scale, (int, float)) and math.isfinite(logit_scale) and logit_scale > 0):
        raise ValueError(f"logit_scale: expected a finite number > 0, got {logit_scale!r}")
    # 1/T first, as before the transform existed: without one the bits are unchanged.
    mult = 1.0 / float(temperature)
    if logit_scale != 1.0:
        mult *= float(logit_scale)
    return _Transform(mult, None if logit_softcap is None else float(logit_softcap))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _validate(hidden, weight, targets, bias, temperature, chunk_size, vocab_chunk_size, ignore_index):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        raise ValueError(
            f"hidden: expected a [N, H] or [B, T, H] tensor, got "
            f"{tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__}"
        )
    if not hidden.is_floating_point():
        raise ValueError(f"hidden: expected a floating dtype, got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError(f"weight: expected a [V, H] tensor, got shape {tuple(getattr(weight, 'shape', ()))}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight: hidden size {weight.shape[1]} (shape {tuple(weight.shape)}) does not match "
            f"hidden's last dimension {hidden.shape[-1]}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight: dtype {weight.dtype} differs from hidden's {hidden.dtype}; cast one of them "
            f"(the matmul runs in the input dtype)"
        )
    if weight.device != hidden.device:
        raise ValueError(f"weight: on {weight.device}, hidden on {hidden.device}")
    if not isinstance(targets, torch.Tensor) or targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets: expected shape {tuple(hidden.shape[:-1])} (hidden's leading dims), got "
            f"{tuple(getattr(targets, 'shape', ()))}"
        )
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise ValueError(f"targets: expected an integer dtype, got {targets.dtype}")
    vocab = weight.shape[0]
    bad = (targets != ignore_index) & ((targets < 0) | (targets >= vocab))
    if bool(bad.any()):
        raise ValueError(
            f"targets: {int(bad.sum())} ids outside [0, {vocab}) (and not ignore_index={ignore_index}), "
            f"e.g. {int(targets[bad][0])}"
        )
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (vocab,):
            raise ValueError(f"bias: expected shape ({vocab},), got {tuple(getattr(bias, 'shape', ()))}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature: expected a finite number > 0, got {temperature!r}")
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name}: expected a positive int or None, got {value!r}")
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1).long()
    return flat_h, flat_t, bias, targets.shape
