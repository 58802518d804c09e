"""DeepSeek-V3.2's off-policy sequence mask (OPSM): drop a negative-advantage sequence the engine drifted from.

DeepSeek-AI (2025), "DeepSeek-V3.2", arXiv 2512.02556, Sec. 3.1 "Off-Policy Sequence Masking": token t of
sequence i gets weight

    M_{i,t} = 0   if A_{i,t} < 0 and (1 / |o_i|) sum_t log(pi_old(o_t) / pi_theta(o_t)) > delta
    M_{i,t} = 1   otherwise

with pi_old the policy that sampled (here the engine, pi_rollout) and pi_theta the trainer's: the sequence mean of
k1 = -d, so a sequence is masked when its mean log-ratio says the trainer finds it less likely than the engine did
by more than delta, and its advantage would push its probability down further. TRL's
``off_policy_mask_threshold`` (huggingface/trl PR 4689; PR 4857 took the engine's log-probs as pi_old, as here).
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
    """Keep (i, t) unless A_{i,t} < 0 and mean_t(-d_{i,t}) > delta."""
    drifted = inputs.per_token(inputs.seq_mean(-inputs.d) > o.delta)
    return kept(inputs, ~((inputs.advantages < 0) & drifted))


register_rule(Rule(name="opsm", kind="reject", level="sequence", options=OPSMOptions, apply=opsm,
                   formula="drop token if A < 0 and mean_t(lp_r - lp_t) > delta", needs_advantages=True,
                   source="DeepSeek-V3.2, arXiv 2512.02556, Sec. 3.1; TRL off_policy_mask_threshold"))
