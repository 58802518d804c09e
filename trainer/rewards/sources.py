"""Every reward source of an RL recipe's ``reward`` section, by name: rule functions and reward models."""
from __future__ import annotations

from typing import Callable

import torch

from trainer.rewards.functions import resolve_reward
from trainer.rewards.reward_model import RewardModelScorer
from trainer.rewards.time_limit import bounded


def build_reward_sources(reward, device: torch.device | str) -> tuple[dict[str, Callable], dict[str, float]]:
    """All reward sources of a recipe's ``reward`` section: (name -> callable, name -> weight).

    Rule functions (``reward.functions``, resolved by ``trainer.rewards.functions.resolve_reward``)
    and reward models (``reward.models``, each a ``RewardModelScorer`` on ``device``)
    share one namespace: their names become ``reward/<name>`` metrics, so a name used
    by both is refused. Weights default to 1.0; the step's reward is
    ``sum_k weight_k * reward_k`` (``trainer.rewards.functions.compute_rewards``).
    """
    both = sorted(set(reward.functions) & set(reward.models))
    if both:
        raise ValueError(f"reward source name(s) {both} are used by both reward.functions and reward.models; "
                         "each name is one reward/<name> metric, so it must be unique")
    # User functions get reward.timeout_s per call (trainer/rewards/time_limit.py); reward models are the
    # trainer's own forward passes, bounded by their batch sizes.
    fns: dict[str, Callable] = {name: bounded(resolve_reward(spec), name, reward.timeout_s)
                                for name, spec in reward.functions.items()}
    for name, entry in reward.models.items():
        fns[name] = RewardModelScorer(entry.path, name=name, device=device, batch_size=entry.batch_size,
                                      baseline=entry.baseline, max_tokens=entry.max_tokens)
    unknown = sorted(set(reward.weights) - set(fns))
    if unknown:
        raise ValueError(f"reward.weights names {unknown}, which are neither reward.functions nor reward.models "
                         f"({', '.join(fns)})")
    return fns, {name: float(reward.weights.get(name, 1.0)) for name in fns}
