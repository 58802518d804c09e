"""Algorithms as pure tensor functions: advantage estimators and policy losses in registries.

Importing this package registers every built-in algorithm. The trainer does
``ADVANTAGES.get(name)(AdvantageInputs(...), cfg)`` and
``POLICY_LOSSES.get(name)(LossInputs(...), cfg)`` and never branches on ``name``.
"""
from trainer.algorithms import grpo  # noqa: F401  (registers "grpo")
from trainer.algorithms.aggregation import AGG_MODES, LossNormalizer, aggregate
from trainer.algorithms.grpo import GRPOConfig, clipped_surrogate, grpo_advantages, grpo_loss
from trainer.algorithms.kl import kl_k1, kl_k2, kl_k3
from trainer.algorithms.registry import (
    ADVANTAGES,
    POLICY_LOSSES,
    AdvantageInputs,
    LossInputs,
    LossOutput,
    Registry,
)

__all__ = [
    "ADVANTAGES",
    "AGG_MODES",
    "POLICY_LOSSES",
    "AdvantageInputs",
    "GRPOConfig",
    "LossInputs",
    "LossNormalizer",
    "LossOutput",
    "Registry",
    "aggregate",
    "clipped_surrogate",
    "grpo_advantages",
    "grpo_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
]
