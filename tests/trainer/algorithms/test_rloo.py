import math
import statistics

import pytest
import torch

from trainer.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    AdvantageInputs,
    LossInputs,
    LossNormalizer,
    RLOOConfig,
    rloo_advantages,
    rloo_loss,
)

F64 = torch.float64
NAN = float("nan")
LN2 = math.log(2.0)


def _adv(rewards, mask, g):
    return rloo_advantages(AdvantageInputs(rewards=rewards, mask=mask, group_size=g), None)


def test_registered():
    assert ADVANTAGES.get("rloo") is rloo_advantages and POLICY_LOSSES.get("rloo") is rloo_loss


def test_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 1.0, 0.0, 0.1, 0.1, 0.1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [0, 0], [1, 1], [1, 0], [1, 1]])
    adv = _adv(rewards, mask, 3)
    # [1,0,0]: LOO means [0, .5, .5] -> [1, -.5, -.5]   (= 3/2 * (r - 1/3))
    # [.5,1,0]: LOO means [.5, .25, .75] -> [0, .75, -.75]
    # [.1,.1,.1]: exactly 0
    a = [1.0, -0.5, -0.5, 0.0, 0.75, -0.75, 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(a)[:, None] * mask)
    assert adv.dtype == torch.float32 and torch.equal(adv[6:], torch.zeros(3, 2))


def test_advantages_match_a_python_loop_reference():
    gen = torch.Generator().manual_seed(0)
    g, groups = 4, 6
    rewards = torch.randint(0, 3, (g * groups,), generator=gen).double() / 2
    mask = torch.rand(g * groups, 5, generator=gen) < 0.7
    adv = _adv(rewards, mask, g)
    for i in range(g * groups):
        group = rewards[(i // g) * g : (i // g + 1) * g].tolist()
        others = group[: i % g] + group[i % g + 1 :]
        a = rewards[i].item() - statistics.fmean(others)
        torch.testing.assert_close(adv[i], torch.where(mask[i], a, 0.0).to(adv.dtype))


def test_advantage_errors():
    with pytest.raises(ValueError, match="rloo_advantages: group_size must be >= 2"):
        _adv(torch.zeros(3), torch.ones(3, 2), 1)
    with pytest.raises(ValueError, match=r"rloo_advantages: rewards are not finite at sequence indices \[2\]"):
        _adv(torch.tensor([0.0, 1.0, NAN, 1.0]), torch.ones(4, 2), 2)


# ---------------------------------------------------------------- loss


def _inputs(lp, old, adv, mask, **kw):
    return LossInputs(lp, old, adv, mask, LossNormalizer.from_mask(mask, max_len=8), **kw)


def _clip_case():
    # old = 0; each row's log-ratio sum Delta_i chosen; clip 0.2 symmetric; G = 4 sequences.
    #   row 0: A=+1, lp=[ln1.5,0,0]  rho=1.5 > 1.2, A>0 -> clipped:   -min(1.5, 1.2)   = -1.2, grad 0
    #   row 1: A=-2, lp=[ln.5,0,pad] rho=0.5 < 0.8, A<0 -> clipped:   -min(-1, -1.6)   =  1.6, grad 0
    #   row 2: A=+2, lp=[ln1.1,pad,pad] rho=1.1 inside             :   -2.2, d/dlp = -rho*A = -2.2
    #   row 3: A=-1, lp=[ln1.5,0,0]  rho=1.5, A<0 -> not clipped     :   -min(-1.5, -1.2) = 1.5, d/dlp = 1.5
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]])
    lp = torch.tensor(
        [[math.log(1.5), 0, 0], [math.log(0.5), 0, NAN], [math.log(1.1), NAN, NAN], [math.log(1.5), 0, 0]], dtype=F64
    ).requires_grad_(True)
    old = torch.where(mask.bool(), 0.0, NAN).to(F64)
    adv = torch.tensor([1.0, -2.0, 2.0, -1.0], dtype=F64)[:, None] * mask
    return lp, old, adv, mask


def test_loss_clipping_values_gradients_and_metrics():
    lp, old, adv, mask = _clip_case()
    out = rloo_loss(_inputs(lp, old, adv, mask), RLOOConfig())
    # (-1.2 + 1.6 - 2.2 + 1.5) / 4 = -0.3 / 4 = -0.075
    assert out.loss.item() == pytest.approx(-0.075)
    assert out.metrics["train/pg_loss"] == pytest.approx(-0.075)
    out.loss.backward()
    # per sequence: d loss / d lp[i, t] = d l_i / d Delta_i / 4 on each valid token
    grad = [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-0.55, 0.0, 0.0], [0.375, 0.375, 0.375]]
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=F64))
    assert out.metrics["train/seq_ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1 + 1.5) / 4)
    assert out.metrics["train/seq_clip_frac_low"] == pytest.approx(0.25)  # row 1
    assert out.metrics["train/seq_clip_frac_high"] == pytest.approx(0.25)  # row 0
    assert "train/kl_ref" not in out.metrics


def test_on_policy_gradient_is_reinforce_with_loo_baseline():
    # rho = 1: d loss / d lp[i, t] = -A_i / G on every valid token, whatever the length
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, NAN, NAN]], dtype=F64, requires_grad=True)
    adv = torch.tensor([0.5, -1.5], dtype=F64)[:, None] * mask
    out = rloo_loss(_inputs(lp, lp.detach(), adv, mask), RLOOConfig())
    assert out.loss.item() == pytest.approx((-0.5 + 1.5) / 2)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, -0.25, -0.25], [0.75, 0.0, 0.0]], dtype=F64))


def test_kl_is_summed_per_sequence_and_is_weights_scale_sequences():
    # A = 0; row 0: ref - lp = [ln2, -ln2] -> k3 sum = (1 - ln2) + (ln2 - 0.5) = 0.5; row 1: [0, pad] -> 0
    mask = torch.tensor([[1, 1], [1, 0]])
    lp = torch.zeros(2, 2, dtype=F64, requires_grad=True)
    ref = torch.tensor([[LN2, -LN2], [0.0, NAN]], dtype=F64)
    zeros = torch.zeros(2, 2, dtype=F64)
    w = torch.tensor([[3.0, 3.0], [5.0, NAN]], dtype=F64)
    out = rloo_loss(_inputs(lp, zeros, zeros, mask, ref_logprobs=ref, is_weights=w), RLOOConfig(kl_coef=0.1))
    # 0.1 * (3 * 0.5 + 5 * 0) / 2 sequences = 0.075
    assert out.loss.item() == pytest.approx(0.075)
    assert out.metrics["train/kl_ref"] == pytest.approx(0.5 / 3)  # token mean over 3 valid tokens, unweighted
    out.loss.backward()
    # d/dlp = 0.1 * 3 * (1 - e^(ref - lp)) / 2 = 0.15 * [-1, 0.5]
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.15, 0.075], [0.0, 0.0]], dtype=F64))


def test_loss_errors():
    lp, old, adv, mask = _clip_case()
    bad = adv.clone()
    bad[3, 2] = 7.0  # per-token advantages
    with pytest.raises(ValueError, match=r"rloo_loss: advantages must be one value per sequence .* rows \[3\]"):
        rloo_loss(_inputs(lp, old, bad, mask), RLOOConfig())
    w = torch.ones(4, 3, dtype=F64)
    w[0, 1] = 2.0
    with pytest.raises(ValueError, match=r"rloo_loss: is_weights must be one value per sequence .* rows \[0\]"):
        rloo_loss(_inputs(lp, old, adv, mask, is_weights=w), RLOOConfig())
    with pytest.raises(ValueError, match=r"kl_coef=0.05 > 0 but LossInputs.ref_logprobs is None"):
        rloo_loss(_inputs(lp, old, adv, mask), RLOOConfig(kl_coef=0.05))
    with pytest.raises(ValueError, match=r"clip_eps_low must be in \[0, 1\)"):
        RLOOConfig(clip_eps_low=1.0)


def test_micro_batch_sum_equals_full_batch():
    gen = torch.Generator().manual_seed(2)
    s, t = 6, 5
    lengths = torch.tensor([5, 2, 0, 3, 1, 4])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(s, t, generator=gen, dtype=F64) * 3
    lp_full = old + 0.15 * torch.randn(s, t, generator=gen, dtype=F64)
    adv = torch.randn(s, 1, generator=gen, dtype=F64).expand(s, t) * mask
    w = (torch.rand(s, 1, generator=gen, dtype=F64) + 0.5).expand(s, t)
    ref = old + 0.2 * torch.randn(s, t, generator=gen, dtype=F64)
    norm = LossNormalizer.from_mask(mask, max_len=8)
    cfg = RLOOConfig(kl_coef=0.05)

    def run(rows):
        lp = lp_full[rows].clone().requires_grad_(True)
        out = rloo_loss(LossInputs(lp, old[rows], adv[rows], mask[rows], norm, ref_logprobs=ref[rows], is_weights=w[rows]), cfg)
        out.loss.backward()
        return out, lp.grad

    full, full_grad = run(slice(0, s))
    assert full.metrics["train/seq_clip_frac_low"] + full.metrics["train/seq_clip_frac_high"] > 0
    parts = [run(rows) for rows in (slice(0, 1), slice(1, 4), slice(4, 6))]
    torch.testing.assert_close(sum(p.loss for p, _ in parts), full.loss)
    torch.testing.assert_close(torch.cat([g for _, g in parts]), full_grad)
    for key, value in full.metrics.items():
        assert sum(p.metrics[key] for p, _ in parts) == pytest.approx(value, abs=1e-12), key
