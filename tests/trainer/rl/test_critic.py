"""trainer.rl.critic: PPO's per-batch targets from scored tensors (hand-checkable cases)."""
import pytest
import torch

from trainer.algorithms import PPOConfig, make_kl_controller
from trainer.algorithms.distill import distill_rewards
from trainer.config import AlgorithmConfig, RunConfig
from trainer.measurement.scoring import Scores
from trainer.rl.critic import NegativeKLWatch, ppo_targets


def _scored():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.2, 0.0]])
    ref = torch.tensor([[-1.5, -2.0, -0.5], [-0.3, -0.7, 0.0]])
    return Scores(logprobs=lp, ref_logprobs=ref, values=torch.zeros(2, 3)), mask


def _cfg(**algo):
    cfg = RunConfig()
    cfg.algorithm = AlgorithmConfig(name="ppo", options=PPOConfig(gamma=1.0, lam=1.0, whiten_advantages=False, **algo))
    return cfg


def test_targets_kl_shaping_and_controller_update():
    scored, mask = _scored()
    cfg = _cfg(reward_kl_coef=0.1, reward_kl_target=1.0, reward_kl_horizon=10)
    ctl = make_kl_controller(cfg.algorithm.options)
    adv, ret, m = ppo_targets(scored, torch.tensor([1.0, 0.0]), mask, 1, cfg, ctl)
    # k1 per token: [0.5, 0, 0], [0, 0.5]; rewards -0.1*k1 + score at the last token
    # gamma = lam = 1, V = 0: returns = reward-to-go
    torch.testing.assert_close(ret, torch.tensor([[0.95, 1.0, 1.0], [-0.05, -0.05, 0.0]]))
    torch.testing.assert_close(adv, ret)  # V = 0 and no whitening
    assert m["train/kl_ref_seq"] == pytest.approx(0.5) and m["train/reward_kl_coef"] == 0.1
    assert m["train/kl_ref"] == pytest.approx(1.0 / 5)
    # adaptive: KL 0.5 below target 1 -> error clipped to -0.2... here -0.5 -> -0.2; beta *= 1 - 0.2 * 2/10
    assert ctl.value == pytest.approx(0.1 * (1 - 0.2 * 2 / 10))


def test_distill_coef_joins_each_token_reward_before_gae():
    # one sequence of 3 valid tokens (and one pad), by hand: score 1, beta 0 (no reference KL term),
    # gamma 0.9, lam 0.5, values V = [0.2, -0.1, 0.4, 7 (pad)], distill_coef 0.5
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    lp = torch.tensor([[-1.0, -0.5, -2.0, 0.0]])  # the student engine's log-probs of its sampled ids
    teacher = torch.tensor([[-0.5, -1.5, -2.0, -9.0]])
    scored = Scores(logprobs=lp, ref_logprobs=lp.clone(), values=torch.tensor([[0.2, -0.1, 0.4, 7.0]]))
    distill = distill_rewards(lp, teacher, mask)  # -(lp - teacher) = [0.5, -1.0, 0.0, 0 (pad)]
    cfg = _cfg(reward_kl_coef=0.0)
    cfg.algorithm.options.gamma, cfg.algorithm.options.lam = 0.9, 0.5
    cfg.algorithm.distill_coef = 0.5
    adv, ret, _ = ppo_targets(scored, torch.tensor([1.0]), mask, 1, cfg, make_kl_controller(cfg.algorithm.options),
                              distill=distill)
    # r = 0.5 * distill + the score at the last token = [0.25, -0.5, 1.0]; gamma * lam = 0.45
    # delta_2 = 1.0 - 0.4 = 0.6;                      A_2 = 0.6
    # delta_1 = -0.5 + 0.9 * 0.4 - (-0.1) = -0.04;    A_1 = -0.04 + 0.45 * 0.6 = 0.23
    # delta_0 = 0.25 + 0.9 * (-0.1) - 0.2 = -0.04;    A_0 = -0.04 + 0.45 * 0.23 = 0.0635
    torch.testing.assert_close(adv, torch.tensor([[0.0635, 0.23, 0.6, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[0.2635, 0.13, 1.0, 0.0]]))  # A + V
    # without the teacher: r = [0, 0, 1]; A_1 = 0.46 + 0.27 = 0.73, A_0 = -0.29 + 0.45 * 0.73 = 0.0385
    plain, _, _ = ppo_targets(scored, torch.tensor([1.0]), mask, 1, cfg, make_kl_controller(cfg.algorithm.options))
    torch.testing.assert_close(plain, torch.tensor([[0.0385, 0.73, 0.6, 0.0]]))


def test_reward_whitening_scales_but_keeps_the_mean():
    scored, mask = _scored()
    plain = ppo_targets(scored, torch.tensor([1.0, 0.0]), mask, 1, _cfg(reward_kl_coef=0.1),
                        make_kl_controller(_cfg(reward_kl_coef=0.1).algorithm.options))[1]
    cfg = _cfg(reward_kl_coef=0.1, whiten_rewards=True)
    ret = ppo_targets(scored, torch.tensor([1.0, 0.0]), mask, 1, cfg, make_kl_controller(cfg.algorithm.options))[1]
    # token rewards r = [[-0.05, 0, 1], [0, -0.05]]: mean 0.18, unbiased std s; whitened r' = (r - m)/s + m
    r = torch.tensor([-0.05, 0.0, 1.0, 0.0, -0.05])
    w = (r - r.mean()) / torch.sqrt(r.var() + 1e-8) + r.mean()
    torch.testing.assert_close(ret[0, 0], w[:3].sum(), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(ret, plain)


def test_negative_kl_watch_warns_only_on_a_sustained_negative_mean():
    watch = NegativeKLWatch(window=3, tolerance=1e-4)
    assert not watch.update(1, -0.01) and not watch.update(2, 0.02)
    assert not watch.update(3, -0.005)  # mean +0.0017
    with pytest.warns(RuntimeWarning, match="NEGATIVE on average"):
        assert watch.update(4, -0.05)
