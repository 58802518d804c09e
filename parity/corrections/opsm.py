"""DeepSeek-V3.2's off-policy sequence mask (OPSM): drop a negative-advantage sequence the engine drifted from.

DeepSeek-AI (2025), "DeepSeek-V3.2", arXiv 2512.02556, Sec. 3.1 "Off-Policy Sequence Masking": token t of
sequence i gets weight

    M_{i,t} = 0   if A_{i,t} < 0 and (1 / |o_i|) sum_t log(pi_old(o_t) / pi_theta(o_t)) > delta
    M_{i,t} = 1   otherwise

with pi_old the policy that sampled (here the engine, pi_rollout) and pi_theta the policy being updated: the
sequence mean of k1 = -d, so a sequence is masked when its mean log-ratio says the current policy finds it less
likely than the engine did by more than delta, and its advantage would push its probability down further. TRL's
``off_policy_mask_threshold`` (huggingface/trl PR 4689; PR 4857 took the engine's log-probs as pi_old, as here;
``get_off_policy_mask`` takes pi_theta from the update's own detached log-probs).

pi_theta moves between the updates of one batch (``algorithm.epochs`` x ``mini_batches`` > 1), and the paper's
mask follows it: its pi_old is the inference framework's sampling probability, so the divergence from the current
policy covers both sources of off-policyness, the engine's numerics and the updates already taken. So the rule reads the current policy
(``policy="current"``): the loop computes it again at every update from that update's own forward
(trainer/rl/update.py), not once from pi_old; at the first update (and in the single on-policy one) the two are
the same policy.
With a sequence's advantages constant over its tokens (GRPO, RLOO, PMD) the mask is one value per sequence; with
per-token advantages (PPO) it follows each token's sign, as M_{i,t} is written.

delta: the paper gives none and TRL has no default; 0.1 sits in the 0.05 - 0.2 range Trinity-RFT measured as
reasonable (agentscope-ai/Trinity-RFT PR 420).
"""
from __future__ import annotations

from dataclasses import dataclass

from parity.corrections.record import CorrectionInputs, Rule, RuleOutput, check_options, kept, real
from parity.corrections.registry import register_rule


@dataclass(frozen=True)
class OPSMOptions:
    """delta: the largest kept sequence mean of -d for a negative-advantage token, >= 0 (0.1: within Trinity-RFT's
    measured 0.05 - 0.2; DeepSeek-V3.2 and TRL give none)."""

    delta: float = 0.1

    def __post_init__(self) -> None:
        check_options("opsm", self, [(real(self.delta) and self.delta >= 0, "delta", "a finite number >= 0 (nats)")])


def opsm(inputs: CorrectionInputs, o: OPSMOptions) -> RuleOutput:
    """Keep (i, t) unless A_{i,t} < 0 and mean_t(-d_{i,t}) > delta, d = lp_theta - lp_rollout under the policy being
    updated."""
    drifted = inputs.per_token(inputs.seq_mean(-inputs.d) > o.delta)
    return kept(inputs, ~((inputs.advantages < 0) & drifted))


register_rule(Rule(name="opsm", kind="reject", level="sequence", options=OPSMOptions, apply=opsm,
                   formula="drop token if A < 0 and mean_t(lp_r - lp_theta) > delta, at every update",
                   needs_advantages=True, policy="current",
                   source="DeepSeek-V3.2, arXiv 2512.02556, Sec. 3.1; TRL off_policy_mask_threshold"))
