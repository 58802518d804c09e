"""Policy mirror descent (PMD): the Kimi k1.5/K2 loss, as PMD-mean and PMD-part.

Each step of PMD solves max_pi E_pi[r] - tau * KL(pi || pi_old), whose solution is
pi*(y|x) = pi_old(y|x) exp(r(x,y)/tau) / Z(x). Instead of a policy gradient, the policy's
sequence log-ratio is REGRESSED onto that target (Kimi k1.5, arXiv 2501.12599, Eq. 3; Kimi K2,
arXiv 2507.20534):
    L = mean_i (A_i - tau * Delta_i)^2 / (2 tau |y_i|),   Delta_i = sum_t (log pi - log pi_old)(y_i,t)
with A_i = r_i - tau log Z(x) estimated from the other samples of the prompt. No ratio, no
clipping, no KL term: tau is the proximal (mirror-descent) weight. The 1/|y_i| length scaling is
the reference implementation's (OpenKimi ``compute_policy_loss_opmd``, "seq-mean-token-mean").

Two estimates of tau log Z (Xu et al., "Approximation of Log-Partition Function in Policy Mirror
Descent Induces Implicit Regularization for LLM Post-Training", arXiv 2602.05933; code: OpenKimi,
https://github.com/horizon-rl/OpenKimi):
- PMD-mean: the leave-one-out MEAN reward, A_i = r_i - mean_{j != i} r_j (the RLOO advantage).
  The paper shows this adds an implicit chi^2 regulariser (more conservative updates).
- PMD-part: the leave-one-out log-partition, A_i = r_i - tau log((1/(n-1)) sum_{j != i} exp(r_j / tau))
  (OpenKimi's ``ploo``). tau -> inf gives PMD-mean's advantage (log-mean-exp -> mean);
  tau -> 0 gives r_i - max_{j != i} r_j.

Registered as ``"pmd_mean"`` and ``"pmd_part"`` in both registries (one loss, two advantages).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trainer.algorithms.kl import kl_k3
from trainer.algorithms.record import Algorithm, OptionError, check_options
from trainer.algorithms.registry import AdvantageInputs, LossInputs, LossOutput, register_algorithm
from trainer.algorithms.rloo import rloo_advantages
from trainer.algorithms.sequence import (
    broadcast_to_tokens,
    constant_groups,
    grouped_rewards,
    per_sequence,
    sequence_lengths,
    sequence_terms,
)


@dataclass
class PMDConfig:
    """The attributes PMD reads from its (duck-typed) ``cfg``.

    tau: the KL weight of the mirror-descent step, > 0; read by ``pmd_part_advantages`` and
      ``pmd_loss`` (the authors use 0.01-0.1; OpenKimi's default 0.01).
    kl_coef: must be 0 -- PMD has no KL-to-reference term (``pmd_loss`` refuses a positive value
      rather than silently ignoring a configured penalty).
    """

    tau: float = 0.01
    kl_coef: float = 0.0

    def __post_init__(self) -> None:
        _check_tau("PMDConfig", self.tau)
        check_options(self, [(self.kl_coef == 0, "kl_coef",
                              "0 (PMD has no KL-to-reference term, tau is its proximal weight)")])


def _check_tau(who: str, tau: Any) -> None:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0):
        raise OptionError(who, "tau", tau, "a finite number > 0", f"{who}: tau must be a finite number > 0, got {tau!r}")


def pmd_part_advantages(batch: AdvantageInputs, cfg: Any) -> torch.Tensor:
    """Leave-one-out log-partition advantages broadcast to tokens: [S, T], zero on padding.

    For each group of n = ``group_size`` samples with rewards r:
        A_i = r_i - tau * log( (1/(n-1)) * sum_{j != i} exp(r_j / tau) )
    computed as r_i - tau * (logsumexp_{j != i}(r_j / tau) - log(n - 1)): the max shift inside
    ``logsumexp`` keeps exp(r/tau) finite for small tau (exp(1/0.01) overflows float32), and the
    sum runs over j != i directly, never "total minus own term" (catastrophic cancellation when r_i
    dominates). A group whose rewards are all equal gives exactly 0.

    Reads cfg.tau. Requires group_size >= 2; NaN/inf rewards raise naming the sample index.
    Computed in float64, returned in float32 (or the wider rewards dtype).
    """
    tau = cfg.tau
    _check_tau("pmd_part_advantages", tau)
    r = grouped_rewards("pmd_part_advantages", batch.rewards, batch.group_size)
    n = r.shape[-1]
    self_pair = torch.eye(n, dtype=torch.bool, device=r.device)
    others = (r / tau)[:, None, :].expand(-1, n, n).masked_fill(self_pair, -math.inf)  # [G, i, j], j != i
    baseline = tau * (torch.logsumexp(others, dim=-1) - math.log(n - 1))
    adv = torch.where(constant_groups(r), torch.zeros_like(r), r - baseline)
    return broadcast_to_tokens(adv.flatten(), batch.mask, torch.promote_types(batch.rewards.dtype, torch.float32))


def pmd_loss(batch: LossInputs, cfg: Any) -> LossOutput:
    """PMD regression loss on one micro-batch (the same for PMD-mean and PMD-part).

    Per sequence i with valid length L_i >= 1, advantage A_i (read at its first valid token, see
    ``sequence.per_sequence``), Delta_i = sum_t (logprobs - old_logprobs) over its valid tokens,
    w_i its importance weight (``is_weights``, constant per sequence; 1 if None), G = normalizer.num_seqs:
        loss = sum_i w_i * (A_i - tau * Delta_i)^2 / (2 tau L_i) / G
    Sequences without valid tokens contribute 0 (and are not counted in G).

    Gradient w.r.t. logprobs[i, t] (valid t): -w_i (A_i - tau Delta_i) / (L_i G). Hence
    - at Delta = 0 (on-policy, first step): -A_i / (L_i G) on every token of sequence i, i.e. the
      length-normalised policy gradient -1/G sum_i (A_i / L_i) grad sum_t log pi(y_i,t), whatever tau;
    - the loss is minimal at Delta_i = A_i / tau, i.e. pi(y_i)/pi_old(y_i) = exp(A_i / tau), the
      mirror-descent target; as tau -> inf that target -> pi_old (a stiffer proximal term: the
      curvature tau / L_i grows while the first step stays the same).

    Reads cfg.tau (and cfg.kl_coef only to refuse a positive value: PMD has no KL term).
    Raises if advantages or is_weights vary within a sequence. No exp anywhere: a large
    off-policy Delta cannot overflow. Computed in float32 at least.

    Metrics (micro-batch contributions; sum over micro-batches and ranks):
      train/pg_loss: equal to ``loss``.
      train/seq_log_ratio_mean: mean Delta_i over non-empty sequences.
      train/kl_ref: mean k3 over valid tokens (monitoring only; when ``ref_logprobs`` is given).
    """
    who = "pmd_loss"
    tau = cfg.tau
    _check_tau(who, tau)
    kl_coef = getattr(cfg, "kl_coef", 0.0)
    if kl_coef:
        raise ValueError(
            f"{who}: cfg.kl_coef={kl_coef} but PMD has no KL term (tau is its proximal weight); set it to 0"
        )
    valid, dtype, zero, adv, delta = sequence_terms(who, batch)
    g = batch.normalizer.num_seqs
    lengths = sequence_lengths(batch.mask).clamp(min=1).to(dtype)  # empty rows: A = 0, Delta = 0 -> 0
    per_seq = (adv - tau * delta).square() / (2 * tau * lengths)
    if batch.is_weights is not None:
        per_seq = per_seq * per_sequence(who, "is_weights", batch.is_weights, batch.mask).to(dtype)
    loss = per_seq.sum() / g

    metrics = {"train/pg_loss": loss.item(), "train/seq_log_ratio_mean": (delta.detach().sum() / g).item()}
    if batch.ref_logprobs is not None:
        with torch.no_grad():
            lp = torch.where(valid, batch.logprobs.detach().to(dtype), zero)
            kl = torch.where(valid, kl_k3(lp, torch.where(valid, batch.ref_logprobs.detach().to(dtype), zero)), zero)
            metrics["train/kl_ref"] = (kl.sum() / batch.normalizer.num_tokens).item()
    return LossOutput(loss=loss, metrics=metrics)


_PMD_PAPER = "PMD (arXiv 2602.05933); tau's default is OpenKimi's 0.01 (the authors use 0.01-0.1)"
register_algorithm(Algorithm(name="pmd_mean", options=PMDConfig, advantage=rloo_advantages, loss=pmd_loss,
                             token_weights=False, paper=_PMD_PAPER))
register_algorithm(Algorithm(name="pmd_part", options=PMDConfig, advantage=pmd_part_advantages, loss=pmd_loss,
                             token_weights=False, paper=_PMD_PAPER))
