"""The learning-rate schedule both the RL loop and SFT train with."""
from __future__ import annotations

import math

import torch


def make_scheduler(optimizer, schedule: str, warmup: int, total: int):
    """LambdaLR: linear warm-up over ``warmup`` steps, then constant / linear decay / cosine decay to 0."""

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
