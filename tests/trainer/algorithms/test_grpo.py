import math
import statistics

import pytest
import torch

from trainer.algorithms import (
    AGG_MODES,
    AdvantageInputs,
    GRPOConfig,
    LossInputs,
    LossNormalizer,
    grpo_advantages,
    grpo_loss,
)
from trainer.algorithms.grpo import LOG_RATIO_CLAMP

F64 = torch.float64
NAN = float("nan")
LN2 = math.log(2.0)

# ---------------------------------------------------------------- advantages

# 3 groups of 3 (group-contiguous), padded to T = 3.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.1, 0.1, 0.1, 3.0, 1.0, 2.0])
ADV_MASK = torch.tensor(
    [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 0, 0]]
)


def _adv(cfg, rewards=REWARDS, mask=ADV_MASK, g=3):
    return grpo_advantages(AdvantageInputs(rewards=rewards, mask=mask, group_size=g), cfg)


def test_advantages_with_std_hand_computed():
    adv = _adv(GRPOConfig(scale_rewards=True, eps=1e-6))
    # group [1,0,0]: mean 1/3, centred [2/3,-1/3,-1/3], unbiased var (4/9+1/9+1/9)/2 = 1/3,
    #   std = 1/sqrt(3) = 0.5773503 -> A = [2/sqrt3, -1/sqrt3, -1/sqrt3] = [1.1547005, -0.5773503, -0.5773503]
    # group [.1,.1,.1]: all equal -> exactly 0
    # group [3,1,2]: mean 2, centred [1,-1,0], unbiased var 2/2 = 1 -> std 1 -> A = [1,-1,0]
    #   (the biased std sqrt(2/3) would give 1.2247: this pins the unbiased choice)
    a = [1.1547005, -0.5773503, -0.5773503, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0]
    expected = torch.tensor(a)[:, None] * ADV_MASK
    torch.testing.assert_close(adv, expected, atol=3e-6, rtol=0)  # eps shifts values by < 2e-6
    assert adv.dtype == torch.float32 and adv.shape == (9, 3)


def test_advantages_without_std_hand_computed():
    adv = _adv(GRPOConfig(scale_rewards=False))
    # Dr. GRPO: r - mean only: [2/3,-1/3,-1/3], [0,0,0], [1,-1,0]
    a = [2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(a)[:, None] * ADV_MASK)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_equal_rewards_give_exact_zeros_not_nan_even_with_tiny_eps(dtype):
    # In float64, mean(0.1, 0.1, 0.1) - 0.1 = -1.4e-17 (not 0) while the std of the three equal
    # residuals is 0, so without a guard A = -1.4e-17 / 1e-20 ~ -1400 for the whole group.
    rewards = torch.full((6,), 0.1, dtype=dtype)
    for scale in (True, False):
        adv = _adv(GRPOConfig(scale_rewards=scale, eps=1e-20), rewards, ADV_MASK[:6])
        assert torch.equal(adv, torch.zeros(6, 3, dtype=dtype)), scale


def test_advantages_match_a_python_loop_reference():
    gen = torch.Generator().manual_seed(0)
    g, groups, t = 4, 5, 6
    rewards = torch.randint(0, 3, (g * groups,), generator=gen).double() / 2  # ties and equal groups likely
    mask = torch.rand(g * groups, t, generator=gen) < 0.7
    cfg = GRPOConfig(eps=1e-6)
    adv = _adv(cfg, rewards, mask, g)
    for i in range(g * groups):
        group = rewards[(i // g) * g : (i // g + 1) * g].tolist()
        centred = rewards[i].item() - statistics.fmean(group)
        a = 0.0 if len(set(group)) == 1 else centred / (statistics.stdev(group) + cfg.eps)
        torch.testing.assert_close(adv[i], torch.where(mask[i], a, 0.0).to(adv.dtype))


def test_advantage_errors():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        _adv(GRPOConfig(), g=1)
    rewards = REWARDS.clone()
    rewards[4] = NAN
    with pytest.raises(ValueError, match=r"rewards are not finite at sequence indices \[4\]"):
        _adv(GRPOConfig(), rewards)


# ---------------------------------------------------------------- loss

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def _loss_inputs(lp, old, adv, mask=MASK, max_len=4, **kw):
    return LossInputs(
        logprobs=lp, old_logprobs=old, advantages=adv, mask=mask,
        normalizer=LossNormalizer.from_mask(mask, max_len=max_len), **kw,
    )


def _unclipped_case():
    # rho = 1 everywhere (lp == old), so the per-token loss is -A; padding holds NaN.
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, NAN]], dtype=F64)
    lp = torch.where(MASK.bool(), old, torch.tensor(NAN, dtype=F64)).requires_grad_(True)
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]], dtype=F64)
    return lp, old, adv


@pytest.mark.parametrize(
    "mode, expected_loss, expected_grad",
    [
        # per-token -A = [-1,-2,-3],[-4,-5]; d(-rho*A)/d lp = -rho*A = -A at rho = 1
        # token_mean: -15 / 5 = -3; grad -A/5
        ("token_mean", -3.0, [[-0.2, -0.4, -0.6], [-0.8, -1.0, 0.0]]),
        # seq means -6/3 = -2 and -9/2 = -4.5 -> -3.25; grad -A / (L_s * 2)
        ("seq_mean_token_mean", -3.25, [[-1 / 6, -2 / 6, -3 / 6], [-1.0, -1.25, 0.0]]),
        # (-6/4 + -9/4) / 2 = -1.875; grad -A / (4 * 2)
        ("seq_mean_token_sum_norm", -1.875, [[-0.125, -0.25, -0.375], [-0.5, -0.625, 0.0]]),
    ],
)
def test_loss_per_aggregation_mode(mode, expected_loss, expected_grad):
    lp, old, adv = _unclipped_case()
    out = grpo_loss(_loss_inputs(lp, old, adv), GRPOConfig(loss_agg=mode))
    assert out.loss.item() == pytest.approx(expected_loss)
    assert out.metrics["train/pg_loss"] == pytest.approx(expected_loss)
    assert out.metrics["train/ratio_mean"] == pytest.approx(1.0)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor(expected_grad, dtype=F64))
    assert "train/kl_ref" not in out.metrics


def _clipping_case():
    # old = 0, lp = log rho. eps_low 0.2 -> floor 0.8; eps_high 0.28 -> ceiling 1.28 (asymmetric).
    #   (0,0) A=+1 rho=1.5  -> clipped high: -min(1.5, 1.28)     = -1.28, grad 0
    #   (0,1) A=-1 rho=0.5  -> clipped low:  -min(-0.5, -0.8)    =  0.8,  grad 0
    #   (0,2) A=+1 rho=0.5  -> not clipped:  -min(0.5, 0.8)      = -0.5,  d/dlp = -rho*A = -0.5
    #   (1,0) A=-1 rho=1.5  -> not clipped:  -min(-1.5, -1.28)   =  1.5,  d/dlp = -rho*A = 1.5
    #   (1,1) A=+2 rho=1.25 -> inside 1.28 (a symmetric 0.2 clip would cut it): -2.5, d/dlp = -2.5
    #   (1,2) padding
    rho = torch.tensor([[1.5, 0.5, 0.5], [1.5, 1.25, 1.0]], dtype=F64)
    lp = rho.log().requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 2.0, 0.0]], dtype=F64)
    return lp, torch.zeros(2, 3, dtype=F64), adv


def test_clipping_both_sides_values_gradients_and_fractions():
    lp, old, adv = _clipping_case()
    out = grpo_loss(_loss_inputs(lp, old, adv), GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.28))
    # (-1.28 + 0.8 - 0.5 + 1.5 - 2.5) / 5 = -1.98 / 5 = -0.396
    assert out.loss.item() == pytest.approx(-0.396)
    out.loss.backward()
    # per-token gradients / 5; clipped tokens (0,0), (0,1) and padding get exactly 0
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -0.1], [0.3, -0.5, 0.0]], dtype=F64))
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 1].item() == 0.0
    assert out.metrics["train/clip_frac_low"] == pytest.approx(1 / 5)  # token (0,1)
    assert out.metrics["train/clip_frac_high"] == pytest.approx(1 / 5)  # token (0,0)
    # (1.5 + 0.5 + 0.5 + 1.5 + 1.25) / 5 = 5.25 / 5
    assert out.metrics["train/ratio_mean"] == pytest.approx(1.05)


def test_symmetric_clip_cuts_the_token_asymmetric_one_keeps():
    lp, old, adv = _clipping_case()
    out = grpo_loss(_loss_inputs(lp, old, adv), GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.2))
    # ceiling 1.2: (0,0) -min(1.5, 1.2) = -1.2; (1,1) -min(2.5, 2*1.2) = -2.4; the rest unchanged
    # (0.8, -0.5, 1.5) -> (-1.2 + 0.8 - 0.5 + 1.5 - 2.4) / 5 = -1.8 / 5 = -0.36
    assert out.loss.item() == pytest.approx(-0.36)
    assert out.metrics["train/clip_frac_high"] == pytest.approx(2 / 5)


def test_kl_term_value_gradient_and_metric():
    # A = 0 so the surrogate is 0 with zero gradient; only the KL term acts.
    # ref - lp = [ln2, 0, -ln2] in row 0; row 1 = [0, padding].
    #   k3 = [1 - ln2, 0, ln2 - 0.5] = [0.306853, 0, 0.193147]; sum = 0.5 over 4 valid tokens
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    lp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    ref = torch.tensor([[LN2, 0.0, -LN2], [0.0, NAN, NAN]], dtype=F64)
    batch = _loss_inputs(lp, torch.zeros(2, 3, dtype=F64), torch.zeros(2, 3, dtype=F64), mask, ref_logprobs=ref)
    out = grpo_loss(batch, GRPOConfig(kl_coef=0.1))
    # loss = 0.1 * 0.5 / 4 = 0.0125
    assert out.loss.item() == pytest.approx(0.0125)
    assert out.metrics["train/kl_ref"] == pytest.approx(0.5 / 4)
    out.loss.backward()
    # d/dlp = 0.1 * (1 - e^(ref - lp)) / 4 = 0.025 * [-1, 0, 0.5]
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.025, 0.0, 0.0125], [0.0, 0.0, 0.0]], dtype=F64))


def test_kl_metric_without_penalty_and_missing_ref_error():
    lp, old, adv = _unclipped_case()
    ref = old - 1.0  # ref - lp = -1: k3 = e^-1 + 1 - 1 = 0.3678794 per token
    out = grpo_loss(_loss_inputs(lp, old, adv, ref_logprobs=ref), GRPOConfig(kl_coef=0.0))
    assert out.loss.item() == pytest.approx(-3.0)  # unchanged by the KL
    assert out.metrics["train/kl_ref"] == pytest.approx(math.exp(-1))
    with pytest.raises(ValueError, match=r"kl_coef=0.04 > 0 but LossInputs.ref_logprobs is None"):
        grpo_loss(_loss_inputs(lp, old, adv), GRPOConfig(kl_coef=0.04))


def test_is_weights_scale_per_token_loss_and_gradient():
    lp, old, adv = _unclipped_case()
    w = torch.tensor([[2.0, 0.5, 1.0], [0.0, 3.0, NAN]], dtype=F64)
    out = grpo_loss(_loss_inputs(lp, old, adv, is_weights=w), GRPOConfig())
    # -A * w = [-2, -1, -3], [0, -15] -> -21 / 5 = -4.2
    assert out.loss.item() == pytest.approx(-4.2)
    assert out.metrics["train/pg_loss"] == pytest.approx(-4.2)
    out.loss.backward()
    # -A * w / 5
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.4, -0.2, -0.6], [0.0, -3.0, 0.0]], dtype=F64))


def test_is_weights_also_scale_the_kl_term():
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    zeros = torch.zeros(1, 2, dtype=F64)
    ref = torch.tensor([[LN2, -LN2]], dtype=F64)
    w = torch.tensor([[2.0, 4.0]], dtype=F64)
    out = grpo_loss(
        _loss_inputs(lp, zeros, zeros, torch.ones(1, 2), ref_logprobs=ref, is_weights=w), GRPOConfig(kl_coef=1.0)
    )
    # (2 * 0.306853 + 4 * 0.193147) / 2 = (0.613706 + 0.772589) / 2 = 0.6931472 (= ln 2)
    assert out.loss.item() == pytest.approx(LN2)
    assert out.metrics["train/kl_ref"] == pytest.approx(0.25)  # unweighted: 0.5 / 2


def test_constants_are_detached_and_bf16_is_upcast():
    lp = torch.zeros(2, 3, dtype=torch.bfloat16, requires_grad=True)
    old = torch.full((2, 3), -0.1, requires_grad=True)
    adv = torch.ones(2, 3, requires_grad=True)
    out = grpo_loss(_loss_inputs(lp, old, adv), GRPOConfig())
    assert out.loss.dtype == torch.float32
    out.loss.backward()
    assert old.grad is None and adv.grad is None and lp.grad is not None


def test_extreme_log_ratio_stays_finite():
    lp = torch.tensor([[200.0, -200.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[-1.0, 1.0, 1.0]])
    out = grpo_loss(_loss_inputs(lp, torch.zeros(1, 3), adv, torch.ones(1, 3)), GRPOConfig())
    assert math.isfinite(out.loss.item())
    # token 0: A<0, rho = e^20 (clamped) unclipped -> loss e^20; token 1: -e^-20; token 2: -1
    assert out.loss.item() == pytest.approx((math.exp(LOG_RATIO_CLAMP) - math.exp(-LOG_RATIO_CLAMP) - 1) / 3)
    out.loss.backward()
    assert torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_sum_equals_full_batch(mode):
    gen = torch.Generator().manual_seed(1)
    s, t = 6, 5
    lengths = torch.tensor([5, 2, 0, 3, 1, 4])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(s, t, generator=gen, dtype=F64) * 3
    lp_full = (old + 0.4 * torch.randn(s, t, generator=gen, dtype=F64)).detach()  # some tokens clip
    adv = torch.randn(s, t, generator=gen, dtype=F64)
    ref = old + 0.2 * torch.randn(s, t, generator=gen, dtype=F64)
    w = torch.rand(s, t, generator=gen, dtype=F64) + 0.5
    norm = LossNormalizer.from_mask(mask, max_len=8)
    cfg = GRPOConfig(kl_coef=0.05, clip_eps_high=0.28, loss_agg=mode)

    def run(rows):
        lp = lp_full[rows].clone().requires_grad_(True)
        batch = LossInputs(lp, old[rows], adv[rows], mask[rows], norm, ref_logprobs=ref[rows], is_weights=w[rows])
        out = grpo_loss(batch, cfg)
        out.loss.backward()
        return out, lp.grad

    full, full_grad = run(slice(0, s))
    assert full.metrics["train/clip_frac_low"] + full.metrics["train/clip_frac_high"] > 0  # clipping exercised
    parts = [run(rows) for rows in (slice(0, 1), slice(1, 4), slice(4, 6))]
    torch.testing.assert_close(sum(p.loss for p, _ in parts), full.loss)
    torch.testing.assert_close(torch.cat([g for _, g in parts]), full_grad)
    for key, value in full.metrics.items():
        assert sum(p.metrics[key] for p, _ in parts) == pytest.approx(value, abs=1e-12), key


def test_config_validation():
    with pytest.raises(ValueError, match="clip_eps_low must be in \\[0, 1\\), got 1.0"):
        GRPOConfig(clip_eps_low=1.0)
    with pytest.raises(ValueError, match="loss_agg must be one of token_mean, .*got 'mean'"):
        GRPOConfig(loss_agg="mean")
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        GRPOConfig(kl_coef=-0.1)
    with pytest.raises(ValueError, match="eps must be > 0"):
        GRPOConfig(eps=0.0)
    with pytest.raises(ValueError, match="scale_rewards must be a bool"):
        GRPOConfig(scale_rewards="no")
