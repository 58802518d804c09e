"""PPO's per-batch targets: KL-shaped token rewards, GAE advantages and value returns, controller, warnings.

The formulas are pure functions in ``trainer/algorithms/ppo.py``; this module only feeds
them the batch's ``Scores`` (``trainer.rl.update.score_pass`` with the value head and the
reference policy) and keeps the two pieces of state PPO carries across steps: the
reward-KL controller and a watch on the sign of the reference KL.
"""
from __future__ import annotations

import warnings
from collections import deque

import torch

from trainer.algorithms import AdvantageInputs, explained_variance, make_kl_controller, ppo_returns
from trainer.algorithms.distill import add_distillation
from trainer.algorithms.ppo import ppo_token_rewards
from trainer.algorithms.sequence import whiten
from trainer.measurement.scoring import Scores


class NegativeKLWatch:
    """Warns when the policy's KL to the reference is negative on average over recent steps.

    KL(pi || ref) >= 0, and on tokens sampled from pi its k1 estimate log pi - log ref is
    non-negative in expectation. A mean that stays below zero means the tokens were NOT
    drawn from pi's own distribution -- generation settings that force or suppress tokens
    (min_tokens blocking EOS, bad words, a logit bias): the reward's -beta*KL term then
    *pays* the policy to drift. This is the failure the StackLLaMA write-up describes
    (https://huggingface.co/blog/stackllama, "negative KL"). parityrl refuses those
    sampler options, so a warning here points at a sampler/trainer mismatch or a bug.
    """

    def __init__(self, window: int = 5, tolerance: float = 1e-4) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.tolerance = tolerance

    def update(self, step: int, kl_token_mean: float) -> bool:
        self.values.append(kl_token_mean)
        mean = sum(self.values) / len(self.values)
        if len(self.values) == self.values.maxlen and mean < -self.tolerance:
            warnings.warn(
                f"step {step}: the reference KL has been NEGATIVE on average over the last {len(self.values)} steps "
                f"(mean per-token k1 {mean:.3g}). The sampled tokens are not distributed as the policy says they are, "
                "and the -beta*KL reward term rewards drifting away from the reference. Check the sampler settings "
                "and the parity metrics (StackLLaMA's 'negative KL' failure).", RuntimeWarning, stacklevel=2)
            return True
        return False


def ppo_targets(scored: Scores, rewards: torch.Tensor, mask: torch.Tensor, group_size: int, cfg, controller,
                all_sum=None, distill: torch.Tensor | None = None):
    """(advantages [S, C], returns [S, C], metrics) for one batch, and the controller updated.

    scored: ``score_pass`` output with ``logprobs`` (pi_old), ``ref_logprobs`` and ``values``.
    rewards: [S] sequence scores. The reward of token t is -beta * KL_t (estimator
    ``cfg.reward_kl_estimator``) plus the score at the last token (scaled to unit variance over
    the batch, mean kept, with ``cfg.whiten_rewards``); GAE then gives the
    advantages (whitened if configured) and the returns (unwhitened advantages + values).
    distill: [S, C] a teacher's per-token reward -(log pi_student - log pi_teacher) (``distill_rewards``), or
    None: ``algorithm.distill_coef`` times it joins each token's reward before GAE (and before the rewards'
    whitening, as the KL penalty), so the critic learns the shaped return -- the per-token KL-in-reward of
    InstructGPT / TRL's PPO, here against the teacher instead of the reference.
    all_sum: with data parallel, ``DataParallel.all_sum``: the whitening statistics and the
    per-sequence KL the controller steers by are the whole batch's, so every rank keeps the
    same beta (each rank's own KL would move each rank's beta apart) and the advantages are
    one process's. The other metrics are this rank's (the loop averages them over ranks).
    """
    a = cfg.algorithm.options
    beta = controller.value
    token_rewards, kl = ppo_token_rewards(rewards, scored.logprobs, scored.ref_logprobs, mask, beta,
                                          a.reward_kl_estimator)
    if distill is not None:
        token_rewards = add_distillation(token_rewards, distill, mask, cfg.algorithm.distill_coef)
    if a.whiten_rewards:
        token_rewards = whiten(token_rewards, mask, shift_mean=False, all_sum=all_sum)
    inputs = AdvantageInputs(rewards=rewards, mask=mask, group_size=group_size, values=scored.values,
                             token_rewards=token_rewards, all_sum=all_sum)
    advantages = cfg.algorithm.record.advantage(inputs, a)
    returns = ppo_returns(inputs, a)
    valid = mask > 0
    kl_sum_and_count = torch.stack([kl.sum().double(), torch.tensor(float(mask.shape[0]), dtype=torch.float64,
                                                                    device=kl.device)])
    if all_sum is not None:
        kl_sum_and_count = all_sum(kl_sum_and_count)
    seq_kl = float(kl_sum_and_count[0] / kl_sum_and_count[1])
    metrics = {
        "train/kl_ref": float(kl[valid].mean()),  # per token, with the reward's estimator
        "train/kl_ref_seq": seq_kl,  # per sequence (sum over tokens): what the controller steers
        "train/reward_kl_coef": beta,
        "train/value_mean": float(scored.values[valid].mean()),
        "train/return_mean": float(returns[valid].mean()),
        "train/explained_variance": explained_variance(scored.values, returns, mask),
    }
    controller.update(seq_kl, int(kl_sum_and_count[1]))
    return advantages, returns, metrics


__all__ = ["NegativeKLWatch", "make_kl_controller", "ppo_targets"]
