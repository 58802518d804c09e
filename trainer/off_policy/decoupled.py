"""``decoupled``: AReaL's decoupled PPO objective (Fu et al. 2025, arXiv 2505.24298).

    J = E_{tokens ~ pi_behaviour} [ w * min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) ],
    r = pi_theta / pi_prox,   w = pi_prox / pi_behaviour  (a constant: no gradient)

The trust region is centred on pi_prox, the policy before this step's update, however old the data; the
importance weight w carries the expectation from the behaviour policy's samples to pi_prox. Tokens with w above
``algorithm.behaviour_weight_cap`` are left out of the loss (weight 0), as AReaL's ``behav_imp_weight_cap`` does
(a filter, not a truncation: ``realhf/impl/model/utils/ppo_functional.py``); its example recipes set 5.
Cost: pi_prox is one more no-grad forward per step when the batch gets a single update (with several, the
staleness measurement already scores it).
"""
import torch

from trainer.off_policy.record import OffPolicyObjective, register_objective


def decoupled_weights(prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
                      cap: float) -> tuple[torch.Tensor, dict]:
    """w = pi_prox / pi_behaviour per token [S, C] (float32, no gradient), 0 where it exceeds ``cap`` or the mask
    is 0; with the share of the mask's tokens filtered and the mean of w over the mask's tokens."""
    if prox.shape != behaviour.shape or prox.shape != mask.shape:
        raise ValueError(f"decoupled_weights: shapes {tuple(prox.shape)}, {tuple(behaviour.shape)}, "
                         f"{tuple(mask.shape)} differ")
    w = torch.exp(prox.detach().float() - behaviour.detach().float())
    keep = (w <= cap) & (mask > 0)
    w = torch.where(keep, w, torch.zeros_like(w))
    n = float(mask.sum())
    filtered = float(((mask > 0) & ~keep).sum())
    return w, {"staleness/decoupled_weight_mean": float(w.sum()) / max(n, 1.0),
               "staleness/decoupled_filtered_frac": filtered / max(n, 1.0)}


DECOUPLED = register_objective(OffPolicyObjective(
    name="decoupled",
    doc="ratio pi_theta / pi_prox clipped, times w = pi_prox / pi_behaviour, tokens with w > cap filtered (AReaL)",
    reference="Fu et al. 2025 (AReaL), arXiv 2505.24298",
    anchor="proximal",
    weight=decoupled_weights,
    parameter="behaviour_weight_cap",
))
