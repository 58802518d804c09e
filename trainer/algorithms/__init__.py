"""Algorithms as pure tensor functions, one registered record (``record.Algorithm``) per algorithm.

Importing this package registers every built-in algorithm. The trainer does
``rec = ALGORITHMS.get(cfg.algorithm.name)``, then ``rec.advantage(AdvantageInputs(...), options)``
and ``rec.loss(LossInputs(...), options)``, and asks ``rec`` for its capabilities; it never
branches on ``name``.

Registered names: grpo, dr_grpo, gspo, rloo, reinforce_pp_baseline, pmd_mean, pmd_part, ppo, opd
(on-policy distillation, ``distill``). DAPO is grpo + settings + the dynamic-sampling
filter (``filters.groups_with_signal``), see ``filters``.
"""
from trainer.algorithms import (  # noqa: F401  (register the rest)
    distill,
    dr_grpo,
    grpo,  # noqa: F401  (registers "grpo")
    gspo,
    pmd,
    ppo,
    reinforce_pp,
    rloo,
)
from trainer.algorithms.aggregation import AGG_MODES, LossNormalizer, aggregate
from trainer.algorithms.distill import (
    OPDConfig,
    add_distillation,
    distill_returns,
    distill_rewards,
    opd_advantages,
    reverse_kl,
)
from trainer.algorithms.dr_grpo import DrGRPOConfig, dr_grpo_advantages, dr_grpo_loss
from trainer.algorithms.filters import groups_with_signal
from trainer.algorithms.grpo import GRPOConfig, clipped_surrogate, grpo_advantages, grpo_loss
from trainer.algorithms.gspo import GSPOConfig, gspo_loss
from trainer.algorithms.kl import kl_k1, kl_k2, kl_k3
from trainer.algorithms.pmd import PMDConfig, pmd_loss, pmd_part_advantages
from trainer.algorithms.ppo import (
    AdaptiveKLController,
    FixedKLController,
    PPOConfig,
    clipped_value_loss,
    explained_variance,
    gae,
    make_kl_controller,
    ppo_advantages,
    ppo_loss,
    ppo_returns,
    ppo_token_rewards,
)
from trainer.algorithms.record import Algorithm, OptionError
from trainer.algorithms.registry import (
    ADVANTAGES,
    ALGORITHMS,
    POLICY_LOSSES,
    AdvantageInputs,
    LossInputs,
    LossOutput,
    Registry,
    register_algorithm,
)
from trainer.algorithms.reinforce_pp import ReinforcePPConfig, reinforce_pp_baseline_advantages
from trainer.algorithms.rloo import RLOOConfig, rloo_advantages, rloo_loss
from trainer.algorithms.sequence import whiten

__all__ = [
    "ADVANTAGES",
    "ALGORITHMS",
    "Algorithm",
    "DrGRPOConfig",
    "OPDConfig",
    "OptionError",
    "ReinforcePPConfig",
    "register_algorithm",
    "AGG_MODES",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AdvantageInputs",
    "FixedKLController",
    "GRPOConfig",
    "GSPOConfig",
    "LossInputs",
    "LossNormalizer",
    "LossOutput",
    "PMDConfig",
    "PPOConfig",
    "RLOOConfig",
    "Registry",
    "add_distillation",
    "aggregate",
    "clipped_surrogate",
    "clipped_value_loss",
    "distill_returns",
    "distill_rewards",
    "dr_grpo_advantages",
    "dr_grpo_loss",
    "explained_variance",
    "gae",
    "groups_with_signal",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "make_kl_controller",
    "opd_advantages",
    "pmd_loss",
    "pmd_part_advantages",
    "ppo_advantages",
    "ppo_loss",
    "ppo_returns",
    "ppo_token_rewards",
    "reinforce_pp_baseline_advantages",
    "reverse_kl",
    "rloo_advantages",
    "rloo_loss",
    "whiten",
]
