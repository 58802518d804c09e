"""``m2po``: Second-Moment Trust Policy Optimization (Zheng et al. 2025, "Prosperity before Collapse: How Far Can
Off-Policy RL Reach with Stale Data on LLMs?", arXiv 2510.01161).

    M2 = mean over the batch's tokens of (log pi_prox - log pi_behaviour)^2
    mask the tokens of largest (log pi_prox - log pi_behaviour)^2, one by one, until the mean over those kept is
    below algorithm.m2_threshold (tau_M2; the paper's default 0.04)

A bound on the second moment of the log importance weight rather than on each token's ratio: only the extreme
outliers stale data produces are dropped, however many steps old the batch is, where a per-token clip at large
staleness clips many informative tokens (the paper trains on data 256 updates stale without collapse). The kept
tokens' terms are the algorithm's own surrogate against pi_behaviour (anchor ``behaviour``, as AReaL's
implementation applies the mask before its PPO loss: ``areal/engine/ppo/actor.py``, ``_apply_m2po_masking``); a
masked token's weight is 0 and it still counts in the loss's token normaliser, as the paper's objective divides by
every sampled token (AReaL's divides by the kept ones: at the few tokens M2PO masks the two differ by that share).
The mask is taken over the rank's whole batch at the start of the step (pi_prox: the policy before the update,
one no-grad forward), not per micro-batch.
"""
import torch

from trainer.off_policy.record import OffPolicyObjective, register_objective


def m2po_mask(prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor,
              threshold: float) -> tuple[torch.Tensor, dict]:
    """1 for the tokens kept, 0 for those masked and outside ``mask`` [S, C] (float32, no gradient): the fewest
    tokens of largest (log pi_prox - log pi_behaviour)^2 masked so that the mean over the rest is below
    ``threshold``; at least one token is kept. With the M2 of the batch before and after, and the share masked."""
    if prox.shape != behaviour.shape or prox.shape != mask.shape:
        raise ValueError(f"m2po_mask: shapes {tuple(prox.shape)}, {tuple(behaviour.shape)}, {tuple(mask.shape)} "
                         "differ")
    live = mask > 0
    m2 = (prox.detach().double() - behaviour.detach().double())[live] ** 2
    keep = torch.zeros(mask.shape, dtype=torch.bool, device=mask.device)
    n = m2.numel()
    if n == 0:
        return keep.float(), {"staleness/m2po_m2": 0.0, "staleness/m2po_m2_kept": 0.0, "staleness/m2po_masked_frac": 0.0}
    order = torch.argsort(m2, descending=True, stable=True)
    ranked = m2[order]
    # mean of ranked[i:] for every i: the M2 left after masking the i largest
    tail_mean = ranked.flip(0).cumsum(0).flip(0) / torch.arange(n, 0, -1, dtype=torch.float64, device=m2.device)
    below = torch.nonzero(tail_mean < threshold)
    masked = int(below[0]) if below.numel() else n - 1
    kept_flat = torch.ones(n, dtype=torch.bool, device=m2.device)
    kept_flat[order[:masked]] = False
    keep[live] = kept_flat
    return keep.float(), {"staleness/m2po_m2": float(m2.mean()), "staleness/m2po_m2_kept": float(tail_mean[masked]),
                          "staleness/m2po_masked_frac": masked / n}


M2PO = register_objective(OffPolicyObjective(
    name="m2po",
    doc="the algorithm's surrogate against pi_behaviour on the tokens kept when the batch's second moment of "
        "log(pi_prox / pi_behaviour) is held below m2_threshold (M2PO)",
    reference="Zheng et al. 2025 (M2PO), arXiv 2510.01161",
    anchor="behaviour",
    weight=m2po_mask,
    parameter="m2_threshold",
))
