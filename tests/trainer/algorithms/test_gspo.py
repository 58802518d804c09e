import math

import pytest
import torch

from trainer.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    GRPOConfig,
    GSPOConfig,
    LossInputs,
    LossNormalizer,
    grpo_advantages,
    grpo_loss,
    gspo_loss,
)

F64 = torch.float64
NAN = float("nan")
LN2 = math.log(2.0)
WIDE = GSPOConfig(clip_eps_low=0.2, clip_eps_high=0.2)  # a PPO-size clip range, for readable hand values


def _inputs(lp, old, adv, mask, max_len=8, **kw):
    return LossInputs(lp, old, adv, mask, LossNormalizer.from_mask(mask, max_len=max_len), **kw)


def test_registered_and_paper_defaults():
    assert ADVANTAGES.get("gspo") is grpo_advantages and POLICY_LOSSES.get("gspo") is gspo_loss
    cfg = GSPOConfig()
    assert (cfg.clip_eps_low, cfg.clip_eps_high) == (3e-4, 4e-4)


def _case():
    # old = 0; G = 3 sequences, 6 valid tokens.
    #   row 0: A=+1, lp=[ln2,0,0]: s = 2^(1/3) = 1.2599 > 1.2 -> whole sequence clipped: -1.2 per token, grad 0
    #          (GRPO would clip only token 0 and keep the gradient of tokens 1, 2 at rho = 1)
    #   row 1: A=+2, lp=[ln1.1, ln1.1]: s = 1.1 -> -2.2 per token; grad -s*A/(L*G) = -2.2/(2*3)
    #   row 2: A=-1, lp=[ln.5]: s = 0.5 < 0.8 -> clipped low: -min(-0.5, -0.8) = 0.8, grad 0
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    lp = torch.tensor([[LN2, 0, 0], [math.log(1.1), math.log(1.1), NAN], [math.log(0.5), NAN, NAN]], dtype=F64)
    old = torch.where(mask.bool(), 0.0, NAN).to(F64)
    adv = torch.tensor([1.0, 2.0, -1.0], dtype=F64)[:, None] * mask
    return lp.requires_grad_(True), old, adv, mask


def test_sequence_level_clipping_values_gradient_and_metrics():
    lp, old, adv, mask = _case()
    out = gspo_loss(_inputs(lp, old, adv, mask), WIDE)
    # token means per sequence: -1.2, -2.2, 0.8 -> (-1.2 - 2.2 + 0.8) / 3 = -2.6 / 3
    assert out.loss.item() == pytest.approx(-2.6 / 3)
    assert out.metrics["train/pg_loss"] == pytest.approx(-2.6 / 3)
    out.loss.backward()
    grad = [[0.0, 0.0, 0.0], [-2.2 / 6, -2.2 / 6, 0.0], [0.0, 0.0, 0.0]]
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=F64))
    # mean s_i: (2^(1/3) + 1.1 + 0.5) / 3 = (1.2599210 + 1.6) / 3 = 0.9533070
    assert out.metrics["train/seq_ratio_mean"] == pytest.approx((2 ** (1 / 3) + 1.6) / 3)
    assert out.metrics["train/clip_frac_high"] == pytest.approx(3 / 6)  # all of row 0's tokens
    assert out.metrics["train/clip_frac_low"] == pytest.approx(1 / 6)  # row 2's token

    # Contrast: GRPO's token-level ratio leaves tokens 1, 2 of row 0 unclipped (rho = 1).
    lp2, old2, adv2, _ = _case()
    grpo_loss(_inputs(lp2, old2, adv2, mask), GRPOConfig(loss_agg="seq_mean_token_mean")).loss.backward()
    assert lp2.grad[0, 0] == 0 and lp2.grad[0, 1] != 0


def test_gradient_is_the_papers_sequence_level_gradient():
    # No clipping active (wide range): d loss / d lp[i, t] = -s_i A_i / (L_i G), s_i = exp(mean_t (lp - old)).
    gen = torch.Generator().manual_seed(0)
    s, t = 5, 4
    lengths = torch.tensor([4, 1, 3, 2, 4])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(s, t, generator=gen, dtype=F64) * 2
    lp = (old + 0.3 * torch.randn(s, t, generator=gen, dtype=F64)).requires_grad_(True)
    a = torch.randn(s, generator=gen, dtype=F64)
    out = gspo_loss(_inputs(lp, old, a[:, None] * mask, mask), GSPOConfig(clip_eps_low=0.99, clip_eps_high=100.0))
    out.loss.backward()
    s_i = torch.exp(torch.where(mask, lp.detach() - old, 0.0).sum(-1) / lengths)
    expected = (-s_i * a / (lengths * s))[:, None] * mask
    torch.testing.assert_close(lp.grad, expected)
    torch.testing.assert_close(out.loss, (-s_i * a).sum() / s)


def test_kl_and_is_weights_compose_per_token():
    # A = 0 and lp = old: only the KL term; ref - lp = [ln2, -ln2] in row 0 -> k3 = [0.306853, 0.193147];
    # weights [2, 4]: row 0 token mean (0.613706 + 0.772589) / 2 = 0.693147; row 1 k3 = 0 -> loss = 0.1 * 0.693147 / 2
    mask = torch.tensor([[1, 1], [1, 0]])
    lp = torch.zeros(2, 2, dtype=F64, requires_grad=True)
    zeros = torch.zeros(2, 2, dtype=F64)
    ref = torch.tensor([[LN2, -LN2], [0.0, NAN]], dtype=F64)
    w = torch.tensor([[2.0, 4.0], [1.0, NAN]], dtype=F64)
    out = gspo_loss(_inputs(lp, zeros, zeros, mask, ref_logprobs=ref, is_weights=w), GSPOConfig(kl_coef=0.1))
    assert out.loss.item() == pytest.approx(0.1 * LN2 / 2)
    assert out.metrics["train/kl_ref"] == pytest.approx(0.5 / 3)
    with pytest.raises(ValueError, match=r"gspo_loss: cfg.kl_coef=0.1 > 0 but LossInputs.ref_logprobs is None"):
        gspo_loss(_inputs(lp, zeros, zeros, mask), GSPOConfig(kl_coef=0.1))


def test_loss_agg_is_fixed_by_the_algorithm():
    lp, old, adv, mask = _case()
    cfg = GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.2, loss_agg="token_mean")  # loss_agg must be ignored
    assert gspo_loss(_inputs(lp, old, adv, mask), cfg).loss.item() == pytest.approx(-2.6 / 3)


def test_paper_clip_range_clips_a_small_drift_and_extreme_ratio_stays_finite():
    mask = torch.ones(2, 2)
    # mean log-ratio 1e-3 -> s = 1.001 > 1 + 4e-4 with A > 0: clipped, no gradient
    lp = torch.tensor([[1e-3, 1e-3], [300.0, -100.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=F64)
    out = gspo_loss(_inputs(lp, torch.zeros(2, 2, dtype=F64), adv, mask), GSPOConfig())
    # row 1: mean log-ratio 100 clamped to 20 -> s = e^20, A < 0 unclipped: loss e^20
    assert out.loss.item() == pytest.approx((-1.0004 + math.exp(20.0)) / 2)
    out.loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0].abs().sum() == 0


def test_micro_batch_sum_equals_full_batch():
    gen = torch.Generator().manual_seed(3)
    s, t = 6, 5
    lengths = torch.tensor([5, 2, 0, 3, 1, 4])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(s, t, generator=gen, dtype=F64) * 3
    lp_full = old + 1e-3 * torch.randn(s, t, generator=gen, dtype=F64)
    adv = torch.randn(s, 1, generator=gen, dtype=F64).expand(s, t) * mask
    ref = old + 0.2 * torch.randn(s, t, generator=gen, dtype=F64)
    w = torch.rand(s, t, generator=gen, dtype=F64) + 0.5
    norm = LossNormalizer.from_mask(mask, max_len=8)
    cfg = GSPOConfig(kl_coef=0.05)

    def run(rows):
        lp = lp_full[rows].clone().requires_grad_(True)
        out = gspo_loss(LossInputs(lp, old[rows], adv[rows], mask[rows], norm, ref_logprobs=ref[rows], is_weights=w[rows]), cfg)
        out.loss.backward()
        return out, lp.grad

    full, full_grad = run(slice(0, s))
    assert full.metrics["train/clip_frac_low"] + full.metrics["train/clip_frac_high"] > 0
    parts = [run(rows) for rows in (slice(0, 1), slice(1, 4), slice(4, 6))]
    torch.testing.assert_close(sum(p.loss for p, _ in parts), full.loss)
    torch.testing.assert_close(torch.cat([g for _, g in parts]), full_grad)
    for key, value in full.metrics.items():
        assert sum(p.metrics[key] for p, _ in parts) == pytest.approx(value, abs=1e-12), key


def test_config_validation():
    with pytest.raises(ValueError, match="clip_eps_high must be >= 0"):
        GSPOConfig(clip_eps_high=-1e-4)
