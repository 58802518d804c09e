"""The learning-rate schedule of every stage: ``transformers.get_scheduler``.

The recipes' ``lr_schedule`` names (constant, linear, cosine) map to transformers' schedules
(``constant_with_warmup``, ``linear``, ``cosine``), so the RL loop trains with the schedules
the supervised stages get from ``transformers.Trainer`` and users know from HF: a linear
warm-up from 0 (the first step's factor is 0 / warmup, HF's convention), then constant,
linear decay to 0, or half a cosine to 0 over the remaining steps.
"""
from __future__ import annotations

import math

# transformers.get_scheduler's names for the recipes' lr_schedule values (both supervised stages and RL)
HF_SCHEDULES = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}


def warmup_steps(warmup: int, ratio: float, total: int) -> int:
    """The warm-up length: ``warmup`` steps, or ``ceil(ratio x total)`` (``TrainingArguments``' rule for a ratio)."""
    return int(warmup) if warmup else math.ceil(ratio * total)


def make_scheduler(optimizer, schedule: str, warmup: int, total: int, warmup_ratio: float = 0.0):
    """``transformers.get_scheduler`` for a recipe's ``lr_schedule`` (a LambdaLR: checkpoints hold its step)."""
    from transformers import get_scheduler

    return get_scheduler(HF_SCHEDULES[schedule], optimizer, num_warmup_steps=warmup_steps(warmup, warmup_ratio, total),
                         num_training_steps=total)
