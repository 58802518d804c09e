import dataclasses
import math

import pytest
import torch

from trainer.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    AdaptiveKLController,
    AdvantageInputs,
    FixedKLController,
    LossInputs,
    LossNormalizer,
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

F64 = torch.float64
NAN = float("nan")
LN2 = math.log(2.0)


def test_registered():
    assert ADVANTAGES.get("ppo") is ppo_advantages and POLICY_LOSSES.get("ppo") is ppo_loss


# ---------------------------------------------------------------- token rewards


def test_token_rewards_hand_computed_k1_and_k3():
    # rows: [1,1,1] (last valid t=2), [1,1,0] (t=1), [1,0,1] (a hole; last valid t=2)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.4, NAN], [-1.0, NAN, -1.0]], dtype=F64)
    ref = lp - torch.tensor([[0.5, -0.5, 0.0], [1.0, 0.0, 0.0], [0.25, 0.0, 0.0]], dtype=F64)  # lp - ref
    scores = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    rewards, kl = ppo_token_rewards(scores, lp, ref, mask, beta=0.1)
    # k1 = lp - ref; rewards = -0.1 * k1 + score at the last valid token
    torch.testing.assert_close(kl, torch.tensor([[0.5, -0.5, 0.0], [1.0, 0.0, 0.0], [0.25, 0.0, 0.0]], dtype=F64))
    expected = [[-0.05, 0.05, 1.0], [-0.1, -0.5, 0.0], [-0.025, 0.0, 2.0]]
    torch.testing.assert_close(rewards, torch.tensor(expected, dtype=F64))
    # k3 with ref - lp = -0.5: e^-0.5 + 0.5 - 1 = 0.1065307; with +0.5: e^0.5 - 0.5 - 1 = 0.1487213
    _, kl3 = ppo_token_rewards(scores, lp, ref, mask, beta=0.1, kl_estimator="k3")
    assert kl3[0, 0].item() == pytest.approx(0.1065307) and kl3[0, 1].item() == pytest.approx(0.1487213)
    # the controller's current_kl: mean per-sequence k1 sum = (0 + 1 + 0.25) / 3
    assert kl.sum(-1).mean().item() == pytest.approx(1.25 / 3)


def test_token_rewards_errors():
    mask = torch.tensor([[1, 1], [0, 0]])
    z = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"sequences \[1\] have no valid token for their score"):
        ppo_token_rewards(torch.zeros(2), z, z, mask, 0.1)
    with pytest.raises(ValueError, match=r"scores are not finite at sequence indices \[0\]"):
        ppo_token_rewards(torch.tensor([NAN, 0.0]), z, z, torch.ones(2, 2), 0.1)
    with pytest.raises(ValueError, match="unknown kl_estimator 'k4'"):
        ppo_token_rewards(torch.zeros(2), z, z, torch.ones(2, 2), 0.1, "k4")
    with pytest.raises(ValueError, match=r"ref_logprobs are not finite on valid tokens of sequences \[1\]"):
        ppo_token_rewards(torch.zeros(2), z, torch.tensor([[0.0, 0.0], [0.0, -math.inf]]), torch.ones(2, 2), 0.1)
    with pytest.raises(ValueError, match="beta must be a finite number >= 0"):
        ppo_token_rewards(torch.zeros(2), z, z, torch.ones(2, 2), -1.0)


# ---------------------------------------------------------------- GAE


def _gae_reference(rewards, values, mask, gamma, lam):
    """Textbook GAE on each row's valid tokens (as a list), written as a plain Python loop."""
    s, t = mask.shape
    adv = [[0.0] * t for _ in range(s)]
    for i in range(s):
        idx = [j for j in range(t) if mask[i, j]]
        r = [rewards[i, j].item() for j in idx]
        v = [values[i, j].item() for j in idx] + [0.0]  # the episode ends after the last valid token
        last = 0.0
        for k in reversed(range(len(idx))):
            delta = r[k] + gamma * v[k + 1] - v[k]
            last = delta + gamma * lam * last
            adv[i][idx[k]] = last
    return torch.tensor(adv, dtype=F64)


def test_gae_hand_computed():
    r = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    v = torch.tensor([[0.5, 0.6, 0.7]], dtype=F64)
    m = torch.ones(1, 3)
    # gamma 1, lam 0.5: delta = [0.6-0.5, 0.7-0.6, 1-0.7] = [.1, .1, .3]
    #   A2 = .3; A1 = .1 + .5*.3 = .25; A0 = .1 + .5*.25 = .225; returns = A + V = [.725, .85, 1.0]
    adv, ret = gae(r, v, m, 1.0, 0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.225, 0.25, 0.3]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0.725, 0.85, 1.0]], dtype=F64))
    # lam = 1: Monte Carlo, A_t = R - V_t = 1 - V; lam = 0: A = delta
    torch.testing.assert_close(gae(r, v, m, 1.0, 1.0)[0], torch.tensor([[0.5, 0.4, 0.3]], dtype=F64))
    torch.testing.assert_close(gae(r, v, m, 1.0, 0.0)[0], torch.tensor([[0.1, 0.1, 0.3]], dtype=F64))
    # gamma 0.5, lam 1: returns = [0.25, 0.5, 1] (discounted score), A = returns - V
    torch.testing.assert_close(gae(r, v, m, 0.5, 1.0)[1], torch.tensor([[0.25, 0.5, 1.0]], dtype=F64))


def test_gae_skips_holes_and_ignores_nan_padding():
    # [1, 0, 1, 0]: the hole at t=1 is skipped -- same result as the compressed row [r0, r2], [v0, v2]
    mask = torch.tensor([[1, 0, 1, 0]])
    r = torch.tensor([[0.0, NAN, 1.0, NAN]], dtype=F64)
    v = torch.tensor([[0.5, NAN, 0.7, math.inf]], dtype=F64)
    adv, ret = gae(r, v, mask, 1.0, 0.5)
    # compressed: delta = [0.7 - 0.5, 1 - 0.7] = [.2, .3]; A = [.2 + .5*.3, .3] = [.35, .3]
    torch.testing.assert_close(adv, torch.tensor([[0.35, 0.0, 0.3, 0.0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0.85, 0.0, 1.0, 0.0]], dtype=F64))


def test_gae_equals_the_python_loop_exactly():
    gen = torch.Generator().manual_seed(0)
    s, t = 7, 9
    rewards = torch.randn(s, t, generator=gen, dtype=F64)
    values = torch.randn(s, t, generator=gen, dtype=F64)
    mask = torch.rand(s, t, generator=gen) < 0.75  # holes, trailing padding, maybe empty rows
    mask[0] = False
    mask[1, :4] = True
    mask[1, 4:] = False
    for gamma, lam in ((0.99, 0.95), (1.0, 1.0), (0.9, 0.0)):
        adv, ret = gae(rewards, values, mask, gamma, lam)
        ref = _gae_reference(rewards, values, mask, gamma, lam)
        assert torch.equal(adv, ref), (gamma, lam)
        assert torch.equal(ret, torch.where(mask, ref + values, 0.0))


def test_gae_errors():
    m = torch.ones(1, 2)
    with pytest.raises(ValueError, match="gae: values are not finite on valid tokens of sequences \\[0\\]"):
        gae(torch.zeros(1, 2), torch.tensor([[0.0, NAN]]), m, 1.0, 0.95)
    with pytest.raises(ValueError, match="gae: lam must be a number in \\[0, 1\\], got 1.5"):
        gae(torch.zeros(1, 2), torch.zeros(1, 2), m, 1.0, 1.5)
    with pytest.raises(ValueError, match=r"gae: values has shape \(1, 3\), expected \(1, 2\)"):
        gae(torch.zeros(1, 2), torch.zeros(1, 3), m, 1.0, 0.95)


# ---------------------------------------------------------------- registered advantage


def test_ppo_advantages_whitened_gae_and_returns():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, NAN]], dtype=F64)
    v = torch.tensor([[0.5, 0.6, 0.7], [0.1, 0.2, NAN]], dtype=F64)
    batch = AdvantageInputs(rewards=torch.zeros(2), mask=mask, group_size=1, values=v, token_rewards=r)
    cfg = PPOConfig(gamma=1.0, lam=0.5, whiten_advantages=False)
    # row 0 as in test_gae_hand_computed; row 1: delta = [.2 - .1, -1 - .2] = [.1, -1.2] -> A = [.1 - .6, -1.2]
    raw = torch.tensor([[0.225, 0.25, 0.3], [-0.5, -1.2, 0.0]], dtype=F64)
    torch.testing.assert_close(ppo_advantages(batch, cfg), raw)
    torch.testing.assert_close(ppo_returns(batch, cfg), torch.where(mask.bool(), raw + v, 0.0))
    white = ppo_advantages(batch, dataclasses.replace(cfg, whiten_advantages=True))
    vals = white[mask.bool()]
    assert vals.mean().item() == pytest.approx(0.0, abs=1e-12) and vals.std().item() == pytest.approx(1.0, rel=1e-6)
    assert white[1, 2] == 0


def test_ppo_advantages_name_the_missing_input():
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="ppo_advantages: AdvantageInputs.values is None"):
        ppo_advantages(AdvantageInputs(torch.zeros(2), mask, 1, token_rewards=torch.zeros(2, 2)), PPOConfig())
    with pytest.raises(ValueError, match="ppo_advantages: AdvantageInputs.token_rewards is None; build them with ppo_token_rewards"):
        ppo_advantages(AdvantageInputs(torch.zeros(2), mask, 1, values=torch.zeros(2, 2)), PPOConfig())
    with pytest.raises(ValueError, match="ppo_returns: AdvantageInputs.values is None"):
        ppo_returns(AdvantageInputs(torch.zeros(2), mask, 1), PPOConfig())


# ---------------------------------------------------------------- losses


def test_clipped_value_loss_hand_computed():
    # V_old = 1, R = 2, clip 0.2 -> V_c in [0.8, 1.2]
    #   V=1.5 : (V-R)^2 = .25,  V_c=1.2 -> .64 larger -> .32, clipped (gradient 0)
    #   V=0.5 : 2.25 vs V_c=.8 -> 1.44          -> 1.125, unclipped, d/dV = V - R = -1.5
    #   V=1.05: inside the range, both .9025    -> .45125, d/dV = -0.95
    v = torch.tensor([1.5, 0.5, 1.05], dtype=F64, requires_grad=True)
    loss, clipped = clipped_value_loss(v, torch.ones(3, dtype=F64), torch.full((3,), 2.0, dtype=F64), 0.2)
    torch.testing.assert_close(loss, torch.tensor([0.32, 1.125, 0.45125], dtype=F64))
    assert clipped.tolist() == [True, False, False]
    loss.sum().backward()
    torch.testing.assert_close(v.grad, torch.tensor([0.0, -1.5, -0.95], dtype=F64))
    unclipped, none = clipped_value_loss(v.detach(), None, torch.full((3,), 2.0, dtype=F64), None)
    torch.testing.assert_close(unclipped, torch.tensor([0.125, 1.125, 0.45125], dtype=F64))
    assert not none.any()


def _ppo_case():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, NAN, NAN]], dtype=F64)
    lp = old.clone().requires_grad_(True)  # rho = 1
    adv = torch.tensor([[1.0, -1.0, 2.0], [0.5, NAN, NAN]], dtype=F64)
    values = torch.tensor([[1.5, 0.5, 1.05], [2.0, NAN, NAN]], dtype=F64, requires_grad=True)
    old_values = torch.tensor([[1.0, 1.0, 1.0], [2.0, NAN, NAN]], dtype=F64)
    returns = torch.tensor([[2.0, 2.0, 2.0], [2.0, NAN, NAN]], dtype=F64)
    entropy = torch.tensor([[1.0, 2.0, 3.0], [2.0, NAN, NAN]], dtype=F64, requires_grad=True)
    batch = LossInputs(lp, old, adv, mask, LossNormalizer.from_mask(mask, max_len=4),
                       values=values, old_values=old_values, returns=returns, entropy=entropy)
    return batch


def test_ppo_loss_hand_computed_values_gradients_and_metrics():
    batch = _ppo_case()
    out = ppo_loss(batch, PPOConfig(vf_coef=0.5, ent_coef=0.01, value_clip=0.2))
    # N = 4 tokens. policy: -A = [-1, 1, -2, -0.5] -> -2.5 / 4 = -0.625
    # value: [.32, 1.125, .45125, 0] -> 1.89625 / 4 = 0.4740625; entropy: 8 / 4 = 2
    # loss = -0.625 + 0.5 * 0.4740625 - 0.01 * 2 = -0.40796875
    assert out.loss.item() == pytest.approx(-0.40796875)
    m = out.metrics
    assert m["train/pg_loss"] == pytest.approx(-0.625) and m["train/vf_loss"] == pytest.approx(0.4740625)
    assert m["train/vf_clip_frac"] == pytest.approx(0.25) and m["train/entropy"] == pytest.approx(2.0)
    assert m["train/approx_kl"] == pytest.approx(0.0) and m["train/ratio_mean"] == pytest.approx(1.0)
    out.loss.backward()
    torch.testing.assert_close(batch.logprobs.grad, torch.tensor([[-0.25, 0.25, -0.5], [-0.125, 0, 0]], dtype=F64))
    # vf_coef * dl/dV / N = 0.5 * [0, -1.5, -0.95, 0] / 4
    torch.testing.assert_close(batch.values.grad, torch.tensor([[0.0, -0.1875, -0.11875], [0.0, 0, 0]], dtype=F64))
    # -ent_coef / N = -0.0025 per valid token, 0 on padding
    torch.testing.assert_close(batch.entropy.grad, -0.0025 * batch.mask.to(F64))


def test_ppo_loss_without_value_clip_and_approx_kl_metric():
    batch = _ppo_case()
    batch.logprobs = (batch.old_logprobs + torch.tensor([[LN2, -LN2, 0.0], [0.0, 0.0, 0.0]], dtype=F64)).requires_grad_(True)
    out = ppo_loss(dataclasses.replace(batch, old_values=None), PPOConfig(value_clip=None, vf_coef=1.0))
    # unclipped value: [.125, 1.125, .45125, 0] / 4 = 0.4253125; k3(pi_old || pi): [2-1-ln2, .5-1+ln2] = .5 / 4
    assert out.metrics["train/vf_loss"] == pytest.approx(0.4253125)
    assert out.metrics["train/vf_clip_frac"] == 0.0
    assert out.metrics["train/approx_kl"] == pytest.approx(0.125)


def test_ppo_loss_names_missing_inputs():
    batch = _ppo_case()
    with pytest.raises(ValueError, match="ppo_loss: LossInputs.values is None but cfg.vf_coef=0.1 needs a value loss"):
        ppo_loss(dataclasses.replace(batch, values=None), PPOConfig())
    with pytest.raises(ValueError, match="ppo_loss: LossInputs.returns is None"):
        ppo_loss(dataclasses.replace(batch, returns=None), PPOConfig())
    with pytest.raises(ValueError, match="ppo_loss: LossInputs.old_values is None but cfg.value_clip=0.2"):
        ppo_loss(dataclasses.replace(batch, old_values=None), PPOConfig())
    with pytest.raises(ValueError, match="ppo_loss: LossInputs.entropy is None but cfg.ent_coef=0.01"):
        ppo_loss(dataclasses.replace(batch, entropy=None), PPOConfig(ent_coef=0.01))
    # a policy-only PPO step (critic trained elsewhere): no value or entropy input needed
    bare = dataclasses.replace(batch, values=None, old_values=None, returns=None, entropy=None)
    out = ppo_loss(bare, PPOConfig(vf_coef=0.0))
    assert out.loss.item() == pytest.approx(-0.625) and "train/vf_loss" not in out.metrics


def test_loss_inputs_validate_the_new_optional_fields():
    x = torch.zeros(2, 3)
    norm = LossNormalizer(num_tokens=6.0, num_seqs=2.0, max_len=3)
    with pytest.raises(ValueError, match=r"LossInputs.returns has shape \(2, 2\), expected \(2, 3\)"):
        LossInputs(x, x, x, x, norm, returns=torch.zeros(2, 2))
    with pytest.raises(TypeError, match="LossInputs.entropy must be a torch.Tensor, got list"):
        LossInputs(x, x, x, x, norm, entropy=[0.0])


def test_micro_batch_sum_equals_full_batch():
    gen = torch.Generator().manual_seed(5)
    s, t = 6, 5
    lengths = torch.tensor([5, 2, 0, 3, 1, 4])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    rnd = lambda scale=1.0: scale * torch.randn(s, t, generator=gen, dtype=F64)  # noqa: E731
    old = -torch.rand(s, t, generator=gen, dtype=F64) * 3
    lp_full, values_full, ent_full = old + rnd(0.3), rnd(), rnd().abs()
    adv, old_values, returns, ref = rnd(), values_full + rnd(0.3), rnd(), old + rnd(0.2)
    norm = LossNormalizer.from_mask(mask, max_len=8)
    cfg = PPOConfig(vf_coef=0.5, ent_coef=0.01, kl_coef=0.05, loss_agg="seq_mean_token_mean")

    def run(rows):
        lp, v, e = (x[rows].clone().requires_grad_(True) for x in (lp_full, values_full, ent_full))
        out = ppo_loss(LossInputs(lp, old[rows], adv[rows], mask[rows], norm, ref_logprobs=ref[rows], values=v,
                                  old_values=old_values[rows], returns=returns[rows], entropy=e), cfg)
        out.loss.backward()
        return out, torch.cat([lp.grad, v.grad, e.grad], dim=1)

    full, full_grad = run(slice(0, s))
    assert 0 < full.metrics["train/vf_clip_frac"] and full.metrics["train/clip_frac_low"] + full.metrics["train/clip_frac_high"] > 0
    parts = [run(rows) for rows in (slice(0, 1), slice(1, 4), slice(4, 6))]
    torch.testing.assert_close(sum(p.loss for p, _ in parts), full.loss)
    torch.testing.assert_close(torch.cat([g for _, g in parts]), full_grad)
    for key, value in full.metrics.items():
        assert sum(p.metrics[key] for p, _ in parts) == pytest.approx(value, abs=1e-12), key


# ---------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_hand_computed():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    # KL 9: error 9/6 - 1 = 0.5 clipped to 0.2 -> beta * (1 + 0.2 * 256 / 10000) = 0.2 * 1.00512 = 0.201024
    assert ctl.update(9.0, 256) == pytest.approx(0.201024)
    ctl = AdaptiveKLController(0.2, 6.0, 10000)
    # KL 3: error -0.5 -> -0.2 -> 0.2 * (1 - 0.00512) = 0.198976
    assert ctl.update(3.0, 256) == pytest.approx(0.198976)
    # KL 6.6: error 0.1 (inside the clip) -> 0.198976 * (1 + 0.1 * 100 / 10000) = 0.198976 * 1.001
    assert ctl.update(6.6, 100) == pytest.approx(0.198976 * 1.001)
    assert ctl.value == pytest.approx(0.198976 * 1.001)
    # on target: unchanged
    assert ctl.update(6.0, 1000) == pytest.approx(0.198976 * 1.001)
    restored = AdaptiveKLController(0.5, 6.0, 10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


def test_fixed_controller_factory_and_errors():
    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 64) == 0.05 and fixed.state_dict() == {"value": 0.05}
    assert isinstance(make_kl_controller(PPOConfig()), FixedKLController)
    adaptive = make_kl_controller(PPOConfig(reward_kl_coef=0.1, reward_kl_target=6.0, reward_kl_horizon=500))
    assert isinstance(adaptive, AdaptiveKLController) and (adaptive.value, adaptive.horizon) == (0.1, 500)
    with pytest.raises(ValueError, match="target must be a finite number > 0, got 0"):
        AdaptiveKLController(0.1, 0, 10)
    with pytest.raises(ValueError, match="horizon must be an int >= 1"):
        AdaptiveKLController(0.1, 6.0, 0)
    with pytest.raises(ValueError, match="current_kl must be finite"):
        AdaptiveKLController(0.1, 6.0, 10).update(NAN, 1)
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
        FixedKLController(-0.1)


# ---------------------------------------------------------------- metric helpers


def test_explained_variance_hand_computed():
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0, NAN]])
    # R - V = [0, -1, 0, 1]: Var_pop 0.5; Var_pop(R) = 1.25 -> 1 - 0.4 = 0.6
    assert explained_variance(torch.tensor([[1.0, 3.0, 3.0, 3.0, NAN]]), returns, mask) == pytest.approx(0.6)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full((1, 5), 2.5), returns, mask) == pytest.approx(0.0)
    assert math.isnan(explained_variance(returns, torch.ones(1, 5), mask))


# ---------------------------------------------------------------- config


def test_config_validation():
    with pytest.raises(ValueError, match="PPOConfig.lam must be in \\[0, 1\\], got 1.1"):
        PPOConfig(lam=1.1)
    with pytest.raises(ValueError, match="PPOConfig.value_clip must be None or > 0, got 0"):
        PPOConfig(value_clip=0)
    with pytest.raises(ValueError, match="PPOConfig.reward_kl_estimator must be one of k1, k2, k3"):
        PPOConfig(reward_kl_estimator="mse")
