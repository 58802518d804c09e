"""The record of an off-policy objective: which policy PPO's clip is anchored to, and the per-token weight that
carries the update from the behaviour policy's samples to that anchor.

Three policies meet in an off-policy update (AReaL, Fu et al. 2025, arXiv 2505.24298): pi_behaviour
generated the batch (here: the trainer's pass under the adapter that sampled it, so the engine's numerics stay in
``parity/*`` and the corrections), pi_prox is the trainer's policy before this step's update, pi_theta the one
being updated. An objective says which of the first two the ratio pi_theta / pi_anchor is clipped against, and
what weight w(pi_prox, pi_behaviour) multiplies each token's term (None: none; a weight needs pi_prox, one more
no-grad forward).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Optional

import torch

Weight = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, dict]]


@dataclass(frozen=True)
class OffPolicyObjective:
    name: str
    doc: str
    reference: str
    anchor: Literal["behaviour", "proximal"]  # the policy the ratio is taken (and clipped) against
    # (prox_logprobs, behaviour_logprobs, mask, parameter) -> (weights [S, C], metrics); None: no weight
    weight: Optional[Weight] = None
    parameter: str = ""  # the algorithm key (trainer.config.schema.AlgorithmConfig) whose value the weight takes


OFF_POLICY: dict[str, OffPolicyObjective] = {}


def register_objective(objective: OffPolicyObjective) -> OffPolicyObjective:
    if (objective.weight is None) != (not objective.parameter):
        raise ValueError(f"off-policy objective {objective.name!r}: a weight comes with the parameter it takes")
    if objective.name in OFF_POLICY:
        raise ValueError(f"off-policy objective {objective.name!r} is registered twice")
    OFF_POLICY[objective.name] = objective
    return objective
