"""``behaviour_clip``: PPO's ratio and clip taken against the behaviour policy, pi_theta / pi_behaviour.

The standard off-policy surrogate (Schulman et al. 2017 with pi_old := the policy that sampled): the trust
region is centred on a policy that may be k updates old, so at large k the clip both lets the current policy
drift and clips tokens whose ratio moved only because of the lag. In AReaL's staleness sweep (arXiv 2505.24298)
it loses accuracy as staleness grows (AIME24 23.3 at staleness 4 against 42.2 with ``decoupled``). It is the
default because it is the on-policy update at k = 0 and costs no extra forward.
"""
from trainer.off_policy.record import OffPolicyObjective, register_objective

BEHAVIOUR_CLIP = register_objective(OffPolicyObjective(
    name="behaviour_clip",
    doc="ratio pi_theta / pi_behaviour, clipped (the standard off-policy PPO surrogate)",
    reference="Schulman et al. 2017, arXiv 1707.06347",
    anchor="behaviour",
))
