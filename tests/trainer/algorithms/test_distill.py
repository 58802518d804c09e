"""On-policy distillation (trainer/algorithms/distill.py): the per-token reverse KL, its advantage, the combined
loss and its gradient, against hand-computed values and float64 gradient checks."""
import math

import pytest
import torch

from trainer.algorithms import (
    ALGORITHMS,
    AdvantageInputs,
    GRPOConfig,
    LossInputs,
    LossNormalizer,
    OPDConfig,
    OptionError,
    add_distillation,
    distill_rewards,
    grpo_loss,
    opd_advantages,
    reverse_kl,
)

F64 = torch.float64
NAN, INF = float("nan"), float("inf")

# two sequences of one group; the second has one sampled token, then padding holding garbage
STUDENT = torch.tensor([[-1.0, -2.0, -0.25], [-0.7, NAN, NAN]], dtype=F64)
TEACHER = torch.tensor([[-1.5, -0.5, -0.25], [-1.0, INF, -3.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_reverse_kl_hand_computed_and_zero_on_padding():
    # log pi_s - log pi_t per sampled token: -1 - (-1.5) = 0.5, -2 - (-0.5) = -1.5, 0; -0.7 - (-1.0) = 0.3
    rkl = reverse_kl(STUDENT, TEACHER, MASK)
    assert torch.allclose(rkl, torch.tensor([[0.5, -1.5, 0.0], [0.3, 0.0, 0.0]], dtype=F64))
    assert torch.isfinite(rkl).all()
    r = distill_rewards(STUDENT.clone().requires_grad_(), TEACHER, MASK)
    assert torch.equal(r, -rkl.detach()) and not r.requires_grad


def test_reverse_kl_only_counts_sampled_positions_of_an_episode():
    # an episode: sampled, environment reply (context), sampled again; the reply's ids score nothing
    student = torch.tensor([[-1.0, -9.0, -2.0]], dtype=F64)
    teacher = torch.tensor([[-2.0, -0.1, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 1]])
    assert torch.equal(reverse_kl(student, teacher, mask), torch.tensor([[1.0, 0.0, -1.0]], dtype=F64))


def test_opd_advantages_without_baseline_are_the_token_rewards():
    r = distill_rewards(STUDENT, TEACHER, MASK)
    adv = opd_advantages(AdvantageInputs(rewards=torch.zeros(2), mask=MASK, group_size=2, token_rewards=r),
                         OPDConfig())
    assert torch.allclose(adv, torch.tensor([[-0.5, 1.5, 0.0], [-0.3, 0.0, 0.0]], dtype=F64))


def test_opd_group_baseline_hand_computed():
    # group of 2: valid rewards -0.5, 1.5, 0.0, -0.3 -> mean 0.7 / 4 = 0.175, subtracted on valid tokens only
    r = distill_rewards(STUDENT, TEACHER, MASK)
    adv = opd_advantages(AdvantageInputs(rewards=torch.zeros(2), mask=MASK, group_size=2, token_rewards=r),
                         OPDConfig(group_baseline=True))
    expected = torch.tensor([[-0.675, 1.325, -0.175], [-0.475, 0.0, 0.0]], dtype=F64)
    assert torch.allclose(adv, expected)
    # two groups of one: each its own mean
    adv1 = opd_advantages(AdvantageInputs(rewards=torch.zeros(2), mask=MASK, group_size=1, token_rewards=r),
                          OPDConfig(group_baseline=True))
    assert torch.allclose(adv1, torch.tensor([[-0.8333333333, 1.1666666667, -0.3333333333], [0.0, 0.0, 0.0]],
                                             dtype=F64))


def test_opd_advantages_refuse_a_missing_or_non_finite_signal():
    with pytest.raises(ValueError, match="token_rewards is None"):
        opd_advantages(AdvantageInputs(rewards=torch.zeros(2), mask=MASK, group_size=2), OPDConfig())
    bad = torch.tensor([[0.0, NAN, 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        opd_advantages(AdvantageInputs(rewards=torch.zeros(2), mask=MASK, group_size=2, token_rewards=bad), OPDConfig())


def test_add_distillation_hand_computed():
    task = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 0.0, 0.0]])
    r = distill_rewards(STUDENT, TEACHER, MASK)
    out = add_distillation(task, r, MASK, 0.5)
    # 1 + 0.5 * (-0.5) = 0.75, 1 + 0.5 * 1.5 = 1.75, 1 + 0 = 1; -1 + 0.5 * (-0.3) = -1.15; padding 0
    assert out.dtype == torch.float32
    assert torch.allclose(out.double(), torch.tensor([[0.75, 1.75, 1.0], [-1.15, 0.0, 0.0]], dtype=F64), atol=1e-6)


def _loss(lp, old, adv, mask, cfg):
    norm = LossNormalizer.from_mask(mask, max_len=mask.shape[1])
    return grpo_loss(LossInputs(logprobs=lp, old_logprobs=old, advantages=adv, mask=mask, normalizer=norm), cfg).loss


def test_combined_loss_and_gradient_hand_computed():
    # one on-policy update: pi_old = pi_theta, ratio 1. token_mean over N = 4 tokens:
    #   loss = -sum_t A_t / N = -(-0.5 + 1.5 + 0 - 0.3) / 4 = -0.175
    #   d loss / d log pi_s(y_t) = -A_t / N = (log pi_s - log pi_t) / N: [0.125, -0.375, 0], [0.075, 0, 0]
    lp = torch.where(MASK != 0, STUDENT, 0.0).clone().requires_grad_()
    adv = opd_advantages(AdvantageInputs(rewards=torch.zeros(2), mask=MASK, group_size=2,
                                         token_rewards=distill_rewards(lp, TEACHER, MASK)), OPDConfig())
    loss = _loss(lp, lp.detach(), adv, MASK, OPDConfig())
    assert loss.item() == pytest.approx(-0.175)
    loss.backward()
    assert torch.allclose(lp.grad, torch.tensor([[0.125, -0.375, 0.0], [0.075, 0.0, 0.0]], dtype=F64))


def test_loss_gradcheck_float64_inside_the_clip():
    # pi_old differs from pi_theta by less than the clip range: the surrogate is -rho * A, smooth in log pi
    adv = opd_advantages(AdvantageInputs(rewards=torch.zeros(2), mask=MASK, group_size=2,
                                         token_rewards=distill_rewards(STUDENT, TEACHER, MASK)), OPDConfig())
    old = torch.tensor([[-1.05, -1.95, -0.2], [-0.72, 0.0, 0.0]], dtype=F64)
    lp = torch.tensor([[-1.0, -2.0, -0.25], [-0.7, 0.0, 0.0]], dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: _loss(x, old, adv, MASK, OPDConfig()), (lp,))


def test_expected_gradient_is_minus_the_reverse_kl_gradient_float64():
    # One position, a 5-token vocabulary: the expectation over the student's samples y of
    #   A(y) * grad log pi_s(y),  A(y) = -(log pi_s(y) - log pi_t(y)),
    # enumerated exactly, is -grad KL(pi_s || pi_t) (the score-function identity; GKD's reverse KL).
    torch.manual_seed(0)
    z = torch.randn(5, dtype=F64, requires_grad=True)
    log_t = torch.log_softmax(torch.randn(5, dtype=F64), dim=-1)
    log_s = torch.log_softmax(z, dim=-1)
    kl = (log_s.exp() * (log_s - log_t)).sum()
    (grad_kl,) = torch.autograd.grad(kl, z, retain_graph=True)
    p = log_s.exp().detach()
    pg = torch.zeros(5, dtype=F64)
    for y in range(5):
        a = distill_rewards(log_s[y].reshape(1, 1), log_t[y].reshape(1, 1), torch.ones(1, 1))[0, 0]
        (g,) = torch.autograd.grad(log_s[y], z, retain_graph=True)
        pg += p[y] * a * g
    assert torch.allclose(pg, -grad_kl, atol=1e-12)


def test_opd_record_and_options():
    rec = ALGORITHMS.get("opd")
    assert rec.teacher and rec.min_group_size == 1 and not rec.dynamic_sampling and rec.loss is grpo_loss
    assert not ALGORITHMS.get("grpo").teacher
    assert OPDConfig().loss_agg == GRPOConfig().loss_agg == "token_mean"
    with pytest.raises(OptionError, match="group_baseline must be a bool"):
        OPDConfig(group_baseline=1)
    with pytest.raises(OptionError, match="clip_eps_low"):
        OPDConfig(clip_eps_low=1.0)
    assert math.isfinite(OPDConfig().clip_eps_high)
