import math
from types import SimpleNamespace

import pytest
import torch

from trainer.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    AdvantageInputs,
    LossInputs,
    LossNormalizer,
    PMDConfig,
    pmd_loss,
    pmd_part_advantages,
    rloo_advantages,
)

F64 = torch.float64
NAN = float("nan")
LN2 = math.log(2.0)


def test_registered():
    assert ADVANTAGES.get("pmd_mean") is rloo_advantages  # A_i = r_i - mean_{j != i} r_j
    assert ADVANTAGES.get("pmd_part") is pmd_part_advantages
    assert POLICY_LOSSES.get("pmd_mean") is pmd_loss and POLICY_LOSSES.get("pmd_part") is pmd_loss


# ---------------------------------------------------------------- PMD-part advantages


def _part(rewards, tau, g=3, mask=None):
    mask = torch.ones(len(rewards), 1) if mask is None else mask
    return pmd_part_advantages(AdvantageInputs(rewards=rewards, mask=mask, group_size=g), PMDConfig(tau=tau))[:, 0]


def test_part_hand_computed_tau_1():
    # group [1, 0, 0], tau = 1:
    #   i=0: others [0, 0] -> log((e^0 + e^0) / 2) = 0           -> A = 1
    #   i=1: others [1, 0] -> log((e + 1) / 2) = log(1.8591409) = 0.6201145 -> A = -0.6201145 (i=2 same)
    # group [.1, .1, .1] -> exactly 0
    adv = _part(torch.tensor([1.0, 0.0, 0.0, 0.1, 0.1, 0.1]), 1.0)
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.6201145, -0.6201145, 0.0, 0.0, 0.0]))
    assert torch.equal(adv[3:], torch.zeros(3))


def test_part_small_tau_is_stable_and_tends_to_the_leave_one_out_max():
    # tau = 0.01 in float32: exp(1 / 0.01) = e^100 would overflow float32 (max ~3.4e38) without the shift.
    #   i=1: others [1, 0] -> 0.01 * log((e^100 + 1) / 2) = 1 + 0.01 * log((1 + e^-100) / 2) = 1 - 0.01 ln2
    #        -> A = -1 + 0.01 ln2 = -0.9930685
    adv = _part(torch.tensor([1.0, 0.0, 0.0], dtype=torch.float32), 0.01)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 + 0.01 * LN2, -1 + 0.01 * LN2]))
    # tau = 1e-3, group [3, 1, 2]: A_i -> r_i - max_{j != i} r_j, here + tau ln2 (one max among 2 others):
    #   [3 - 2, 1 - 3, 2 - 3] + 0.000693 = [1.000693, -1.999307, -0.999307]
    adv = _part(torch.tensor([3.0, 1.0, 2.0], dtype=F64), 1e-3)
    torch.testing.assert_close(adv, torch.tensor([1.0, -2.0, -1.0], dtype=F64) + 1e-3 * LN2)


def test_part_large_tau_tends_to_pmd_mean():
    # tau log mean exp(r / tau) = mean(r) + Var_pop(r) / (2 tau) + O(1 / tau^2): log-mean-exp -> mean.
    # group [1, 0, 0], tau = 1e4: i=1 others [1, 0]: mean .5, Var_pop .25 -> A = -0.5 - 1.25e-5 = -0.5000125
    #                              i=0 others [0, 0]: A = 1 exactly
    rewards = torch.tensor([1.0, 0.0, 0.0], dtype=F64)
    adv = _part(rewards, 1e4)
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5000125, -0.5000125], dtype=F64), atol=1e-9, rtol=0)
    mean_adv = rloo_advantages(AdvantageInputs(rewards, torch.ones(3, 1), 3), None)[:, 0].double()
    gaps = [(_part(rewards, tau) - mean_adv).abs().max().item() for tau in (1.0, 10.0, 100.0, 1000.0)]
    assert all(b < a / 5 for a, b in zip(gaps, gaps[1:]))  # shrinks ~ 1/tau


def test_part_errors():
    with pytest.raises(ValueError, match="pmd_part_advantages: tau must be a finite number > 0, got 0"):
        pmd_part_advantages(AdvantageInputs(torch.zeros(2), torch.ones(2, 1), 2), SimpleNamespace(tau=0))
    with pytest.raises(ValueError, match=r"pmd_part_advantages: rewards are not finite at sequence indices \[0\]"):
        _part(torch.tensor([math.inf, 0.0]), 0.1, g=2)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        _part(torch.tensor([1.0]), 0.1, g=1)


# ---------------------------------------------------------------- loss

# 2 groups of 2, rewards [1, 0 | 2, 0.5] -> PMD-mean (leave-one-out) A = [1, -1, 1.5, -1.5].
REWARDS = torch.tensor([1.0, 0.0, 2.0, 0.5], dtype=F64)
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
# per-token lp - old: Delta = [0.5, -0.4, 0.3, 0]
DIFF = torch.tensor([[0.2, 0.3, NAN], [-0.4, NAN, NAN], [0.1, 0.1, 0.1], [0.0, 0.0, NAN]], dtype=F64)
OLD = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, 0.0], [-3.0, -0.1, -1.0], [-0.7, -0.2, NAN]], dtype=F64)


def _batch(diff=DIFF, tau_cfg=None, **kw):
    adv = rloo_advantages(AdvantageInputs(REWARDS, MASK, 2), None)
    lp = (OLD + diff).requires_grad_(True)
    return lp, LossInputs(lp, OLD, adv, MASK, LossNormalizer.from_mask(MASK, max_len=8), **kw)


def test_loss_and_gradient_hand_computed():
    lp, batch = _batch()
    out = pmd_loss(batch, PMDConfig(tau=0.5))
    # tau = 0.5 -> 2 tau = 1; l_i = (A_i - 0.5 Delta_i)^2 / L_i:
    #   (1 - .25)^2 / 2 = .28125; (-1 + .2)^2 / 1 = .64; (1.5 - .15)^2 / 3 = .6075; (-1.5)^2 / 2 = 1.125
    #   sum 2.65375 / 4 sequences = 0.6634375
    assert out.loss.item() == pytest.approx(0.6634375)
    assert out.metrics["train/pg_loss"] == pytest.approx(0.6634375)
    assert out.metrics["train/seq_log_ratio_mean"] == pytest.approx((0.5 - 0.4 + 0.3 + 0.0) / 4)
    out.loss.backward()
    # d/dlp[i, t] = -(A_i - tau Delta_i) / (L_i G): -.75/8, .8/4, -1.35/12, 1.5/8 on each valid token
    grad = [[-0.09375, -0.09375, 0.0], [0.2, 0.0, 0.0], [-0.1125, -0.1125, -0.1125], [0.1875, 0.1875, 0.0]]
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=F64))


@pytest.mark.parametrize("tau", [0.01, 1.0, 100.0])
def test_on_policy_gradient_is_length_normalised_leave_one_out_policy_gradient(tau):
    # At Delta = 0: d/dlp[i, t] = -(A_i - 0) / (L_i G), i.e. grad loss = -1/G sum_i (A_i / |y_i|) grad sum_t log pi(y_i,t)
    # -- REINFORCE with the leave-one-out baseline, each sequence's token sum divided by its length;
    # independent of tau. A = [1, -1, 1.5, -1.5], L = [2, 1, 3, 2], G = 4.
    lp, batch = _batch(diff=torch.zeros(4, 3, dtype=F64))
    out = pmd_loss(batch, PMDConfig(tau=tau))
    # loss = sum_i A_i^2 / (2 tau L_i) / G = (1/2 + 1/1 + 2.25/3 + 2.25/2) / (2 tau * 4) = 3.375 / (8 tau)
    assert out.loss.item() == pytest.approx(3.375 / (8 * tau))
    out.loss.backward()
    expected = torch.tensor([1.0 / 2, -1.0 / 1, 1.5 / 3, -1.5 / 2], dtype=F64)[:, None] * -MASK / 4
    torch.testing.assert_close(lp.grad, expected)


def test_fixed_point_is_the_mirror_descent_target_and_large_tau_pins_it_to_pi_old():
    # The loss is 0 with zero gradient exactly when Delta_i = A_i / tau (pi/pi_old = exp(A_i / tau)).
    tau = 2.0
    adv = torch.tensor([1.0, -1.0, 1.5, -1.5], dtype=F64)
    lengths = MASK.sum(-1).to(F64)
    diff = (adv / tau / lengths)[:, None] * MASK  # spread Delta_i = A_i / tau evenly over the tokens
    lp, batch = _batch(diff=torch.where(MASK.bool(), diff, NAN))
    out = pmd_loss(batch, PMDConfig(tau=tau))
    assert out.loss.item() == pytest.approx(0.0, abs=1e-20)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.zeros(4, 3, dtype=F64))
    # tau -> inf: that target Delta* = A / tau -> 0, and any fixed Delta != 0 costs ~ tau Delta^2 / (2L):
    # loss / tau -> sum_i Delta_i^2 / (2 L_i) / G = (.25/4 + .16/2 + .09/6 + 0) / 4 = 0.039375
    _, batch = _batch()
    assert pmd_loss(batch, PMDConfig(tau=1e6)).loss.item() / 1e6 == pytest.approx(0.039375, rel=1e-5)


def test_is_weights_scale_sequences_and_must_be_per_sequence():
    w = torch.tensor([2.0, 1.0, 0.0, 1.0], dtype=F64)[:, None].expand(4, 3).clone()
    w[1, 1:] = NAN  # padding
    _, batch = _batch(is_weights=w)
    # 2 * .28125 + .64 + 0 * .6075 + 1.125 = 2.3275 / 4
    assert pmd_loss(batch, PMDConfig(tau=0.5)).loss.item() == pytest.approx(2.3275 / 4)
    w[0, 1] = 3.0
    _, batch = _batch(is_weights=w)
    with pytest.raises(ValueError, match=r"pmd_loss: is_weights must be one value per sequence .* rows \[0\]"):
        pmd_loss(batch, PMDConfig(tau=0.5))


def test_loss_errors():
    _, batch = _batch()
    with pytest.raises(ValueError, match="pmd_loss: cfg.kl_coef=0.04 but PMD has no KL term"):
        pmd_loss(batch, SimpleNamespace(tau=0.1, kl_coef=0.04))
    with pytest.raises(ValueError, match="pmd_loss: tau must be a finite number > 0, got -0.1"):
        pmd_loss(batch, SimpleNamespace(tau=-0.1))
    batch.advantages = batch.advantages.clone()
    batch.advantages[2, 1] = 0.0  # per-token advantages (e.g. GAE's) handed to a sequence-level loss
    with pytest.raises(ValueError, match=r"pmd_loss: advantages must be one value per sequence .* rows \[2\]"):
        pmd_loss(batch, PMDConfig(tau=0.1))
    with pytest.raises(ValueError, match="PMDConfig: tau must be a finite number > 0"):
        PMDConfig(tau=math.inf)
    with pytest.raises(ValueError, match="PMDConfig.kl_coef must be 0"):
        PMDConfig(kl_coef=0.1)


def test_kl_ref_metric_only_and_empty_sequences():
    mask = torch.tensor([[1, 1], [0, 0]])
    lp = torch.zeros(2, 2, dtype=F64, requires_grad=True)
    ref = torch.tensor([[LN2, -LN2], [NAN, NAN]], dtype=F64)
    adv = torch.tensor([[2.0, 2.0], [0.0, 0.0]], dtype=F64)
    out = pmd_loss(LossInputs(lp, torch.zeros(2, 2, dtype=F64), adv, mask, LossNormalizer.from_mask(mask, 4),
                              ref_logprobs=ref), PMDConfig(tau=1.0))
    # only row 0 counts (G = 1): 2^2 / (2 * 1 * 2) = 1; k3 mean (0.306853 + 0.193147) / 2 = 0.25
    assert out.loss.item() == pytest.approx(1.0)
    assert out.metrics["train/kl_ref"] == pytest.approx(0.25)


def test_micro_batch_sum_equals_full_batch():
    gen = torch.Generator().manual_seed(4)
    s, t = 6, 5
    lengths = torch.tensor([5, 2, 0, 3, 1, 4])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -torch.rand(s, t, generator=gen, dtype=F64) * 3
    lp_full = old + 0.3 * torch.randn(s, t, generator=gen, dtype=F64)
    adv = pmd_part_advantages(AdvantageInputs(torch.rand(s, generator=gen, dtype=F64), mask, 3), PMDConfig(tau=0.1))
    w = (torch.rand(s, 1, generator=gen, dtype=F64) + 0.5).expand(s, t)
    norm = LossNormalizer.from_mask(mask, max_len=8)

    def run(rows):
        lp = lp_full[rows].clone().requires_grad_(True)
        out = pmd_loss(LossInputs(lp, old[rows], adv[rows], mask[rows], norm, is_weights=w[rows]), PMDConfig(tau=0.1))
        out.loss.backward()
        return out, lp.grad

    full, full_grad = run(slice(0, s))
    parts = [run(rows) for rows in (slice(0, 1), slice(1, 4), slice(4, 6))]
    torch.testing.assert_close(sum(p.loss for p, _ in parts), full.loss)
    torch.testing.assert_close(torch.cat([g for _, g in parts]), full_grad)
    for key, value in full.metrics.items():
        assert sum(p.metrics[key] for p, _ in parts) == pytest.approx(value, abs=1e-12), key
