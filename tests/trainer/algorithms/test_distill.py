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
    distill_returns,
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


def test_opd_group_baseline_is_the_leave_one_out_mean_hand_computed():
    # group of 2, valid rewards: row 0 [-0.5, 1.5, 0.0], row 1 [-0.3]. Each row's baseline is the mean over the
    # OTHER row's valid tokens: row 0 -> -0.3, row 1 -> (-0.5 + 1.5 + 0.0) / 3 = 1/3; padding stays 0
    r = distill_rewards(STUDENT, TEACHER, MASK)
    adv = opd_advantages(AdvantageInputs(rewards=torch.zeros(2), mask=MASK, group_size=2, token_rewards=r),
                         OPDConfig(group_baseline=True))
    expected = torch.tensor([[-0.2, 1.8, 0.3], [-0.3 - 1 / 3, 0.0, 0.0]], dtype=F64)
    assert torch.allclose(adv, expected, atol=1e-12)
    # a group of 3 whose third sample is empty (no valid token): it neither counts in the others' baselines nor
    # gets one (0 on padding); rows 0 and 1 as above
    mask3 = torch.cat([MASK, torch.zeros(1, 3, dtype=MASK.dtype)])
    r3 = torch.cat([r, torch.full((1, 3), 5.0, dtype=F64)])
    adv3 = opd_advantages(AdvantageInputs(rewards=torch.zeros(3), mask=mask3, group_size=3, token_rewards=r3),
                          OPDConfig(group_baseline=True))
    assert torch.allclose(adv3, torch.cat([expected, torch.zeros(1, 3, dtype=F64)]), atol=1e-12)
    with pytest.raises(ValueError, match="group_baseline needs group_size >= 2"):
        opd_advantages(AdvantageInputs(rewards=torch.zeros(2), mask=MASK, group_size=1, token_rewards=r),
                       OPDConfig(group_baseline=True))


def test_distill_returns_hand_computed_skip_environment_tokens():
    # rewards [1, 2, (env 100), 4] with gamma 0.5: G = [1 + 0.5 * (2 + 0.5 * 4), 2 + 0.5 * 4, 0, 4] = [3, 4, 0, 4]
    r = torch.tensor([[1.0, 2.0, 100.0, 4.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1]])
    assert torch.equal(distill_returns(r, mask, 0.5), torch.tensor([[3.0, 4.0, 0.0, 4.0]], dtype=F64))
    assert torch.equal(distill_returns(r, mask, 1.0), torch.tensor([[7.0, 6.0, 0.0, 4.0]], dtype=F64))
    assert torch.equal(distill_returns(r, mask, 0.0), torch.tensor([[1.0, 2.0, 0.0, 4.0]], dtype=F64))
    adv = opd_advantages(AdvantageInputs(rewards=torch.zeros(1), mask=mask, group_size=1, token_rewards=r),
                         OPDConfig(gamma=0.5))
    assert torch.equal(adv, torch.tensor([[3.0, 4.0, 0.0, 4.0]], dtype=F64))


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


# ---- the expected policy gradient, by exact enumeration of a tiny autoregressive student and teacher (float64)
#
# Every prefix (all sequences shorter than T over a vocabulary of V ids) has its own logits: a fully general
# autoregressive model. With ``eos``, id 0 ends a sequence (later positions are padding, mask 0), so the
# enumerated sequences have lengths 1..T.

V = 3


def prefixes(t_max, eos):
    out, frontier = [()], [()]
    for _ in range(t_max - 1):
        frontier = [p + (v,) for p in frontier for v in range(V) if not (eos and 0 in p)]
        out += frontier
    return [p for p in out if not (eos and 0 in p)]


def sequences(t_max, eos):
    done, frontier = [], [()]
    for _ in range(t_max):
        nxt = []
        for p in frontier:
            for v in range(V):
                (done if (eos and v == 0) else nxt).append(p + (v,))
        frontier = nxt
    return done + frontier


class TinyModels:
    def __init__(self, t_max, eos, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.t_max, self.eos = t_max, eos
        self.rows = {p: i for i, p in enumerate(prefixes(t_max, eos))}
        self.z = torch.randn(len(self.rows), V, dtype=F64, generator=g, requires_grad=True)  # the student
        self.teacher = torch.log_softmax(2 * torch.randn(len(self.rows), V, dtype=F64, generator=g), dim=-1)
        self.seqs = sequences(t_max, eos)

    def student(self):
        return torch.log_softmax(self.z, dim=-1)

    def batch(self):
        """[S, T] student and teacher log-probs of every enumerated sequence's tokens, the mask, log p(y) [S]."""
        log_s = self.student()
        s_rows, t_rows, mask = [], [], []
        for y in self.seqs:
            idx = [self.rows[y[:t]] for t in range(len(y))]
            pad = self.t_max - len(y)
            s_rows.append(torch.cat([log_s[idx, list(y)], torch.zeros(pad, dtype=F64)]))
            t_rows.append(torch.cat([self.teacher[idx, list(y)], torch.zeros(pad, dtype=F64)]))
            mask.append([1] * len(y) + [0] * pad)
        lp_s, lp_t = torch.stack(s_rows), torch.stack(t_rows)
        return lp_s, lp_t, torch.tensor(mask), lp_s.sum(dim=-1)

    def grad(self, scalar):
        (g,) = torch.autograd.grad(scalar, self.z, retain_graph=True)
        return g

    def expected_policy_gradient(self, cfg):
        """E_y[sum_t A_t(y) grad log pi_s(y_t | y_<t)] with the advantages ``opd_advantages`` gives, enumerated."""
        lp_s, lp_t, mask, log_p = self.batch()
        adv = opd_advantages(AdvantageInputs(rewards=torch.zeros(len(self.seqs)), mask=mask, group_size=1,
                                             token_rewards=distill_rewards(lp_s, lp_t, mask)), cfg)
        assert adv.dtype == F64
        return self.grad((log_p.exp().detach()[:, None] * adv * lp_s * mask).sum())

    def sequence_kl(self):
        """KL(pi_s(y) || pi_t(y)) over whole sequences, differentiable in the student."""
        lp_s, lp_t, mask, log_p = self.batch()
        return (log_p.exp() * ((lp_s - lp_t) * mask).sum(dim=-1)).sum()

    def per_token_surrogate(self):
        """sum over prefixes h of sg(pi_s(h)) KL(pi_s(. | h) || pi_t(. | h)): each position's next-token reverse
        KL, the prefix distribution held fixed (not differentiated)."""
        log_s = self.student()
        total = torch.zeros((), dtype=F64)
        for h, i in self.rows.items():
            p_h = torch.ones((), dtype=F64)
            for t in range(len(h)):
                p_h = p_h * log_s[self.rows[h[:t]], h[t]].exp()
            total = total + p_h.detach() * (log_s[i].exp() * (log_s[i] - self.teacher[i])).sum()
        return total


@pytest.mark.parametrize("t_max, eos", [(2, False), (3, False), (3, True)])
def test_gamma_1_expected_gradient_is_minus_the_sequence_reverse_kl_gradient(t_max, eos):
    m = TinyModels(t_max, eos)
    assert m.grad(m.sequence_kl()).abs().max() > 1e-2  # far from the teacher: a gradient worth comparing
    pg = m.expected_policy_gradient(OPDConfig(gamma=1.0))
    assert torch.allclose(pg, -m.grad(m.sequence_kl()), atol=1e-12, rtol=0)


@pytest.mark.parametrize("t_max, eos", [(2, False), (3, False), (3, True)])
def test_gamma_0_expected_gradient_is_the_per_token_surrogate_not_the_sequence_kl(t_max, eos):
    m = TinyModels(t_max, eos)
    pg = m.expected_policy_gradient(OPDConfig())  # the default: discount 0
    assert torch.allclose(pg, -m.grad(m.per_token_surrogate()), atol=1e-12, rtol=0)
    # ... which is not the sequence KL's gradient once sequences have two tokens or more
    assert (pg + m.grad(m.sequence_kl())).abs().max() > 1e-2


def test_one_position_both_discounts_are_the_reverse_kl_gradient():
    m = TinyModels(1, False)
    want = -m.grad(m.sequence_kl())
    for gamma in (0.0, 1.0):
        assert torch.allclose(m.expected_policy_gradient(OPDConfig(gamma=gamma)), want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("gamma", [0.0, 1.0])
def test_the_leave_one_out_baseline_leaves_the_expected_gradient_unchanged(gamma):
    # groups of two independent samples (y1, y2), every pair enumerated: the expected gradient through sample 1's
    # tokens is the same with the baseline as without. A mean that includes y1's own tokens would shift it.
    m = TinyModels(3, True)
    lp_s, lp_t, mask, log_p = m.batch()
    r = distill_rewards(lp_s, lp_t, mask)
    n = len(m.seqs)
    i1, i2 = torch.arange(n).repeat_interleave(n), torch.arange(n).repeat(n)
    pairs = torch.stack([i1, i2], dim=1).flatten()  # group-contiguous: (y1, y2) of every pair
    weight = (log_p[i1] + log_p[i2]).exp().detach()

    def expected(cfg, baseline=None):
        adv = opd_advantages(AdvantageInputs(rewards=torch.zeros(2 * n * n), mask=mask[pairs], group_size=2,
                                             token_rewards=r[pairs]), cfg)
        if baseline is not None:
            adv = adv - baseline * mask[pairs]
        first = adv.reshape(n * n, 2, -1)[:, 0]  # sample 1's advantages
        return m.grad((weight[:, None] * first * lp_s[i1] * mask[i1]).sum())

    plain = expected(OPDConfig(gamma=gamma))
    assert torch.allclose(plain, m.expected_policy_gradient(OPDConfig(gamma=gamma)), atol=1e-12, rtol=0)
    assert torch.allclose(expected(OPDConfig(gamma=gamma, group_baseline=True)), plain, atol=1e-12, rtol=0)
    # the self-inclusive mean (the group's mean over all its valid tokens, the sample's own among them) is biased
    g = distill_returns(r[pairs], mask[pairs], gamma).reshape(n * n, 2, -1)
    m2 = mask[pairs].reshape(n * n, 2, -1)
    inclusive = (g.sum(dim=(1, 2)) / m2.sum(dim=(1, 2))).repeat_interleave(2)[:, None]
    assert (expected(OPDConfig(gamma=gamma), baseline=inclusive) - plain).abs().max() > 1e-3


def test_opd_record_and_options():
    rec = ALGORITHMS.get("opd")
    assert rec.teacher and rec.min_group_size == 1 and not rec.dynamic_sampling and rec.loss is grpo_loss
    assert not ALGORITHMS.get("grpo").teacher
    assert OPDConfig().loss_agg == GRPOConfig().loss_agg == "token_mean"
    assert OPDConfig().gamma == 0.0 and OPDConfig(gamma=1).gamma == 1
    with pytest.raises(OptionError, match="group_baseline must be a bool"):
        OPDConfig(group_baseline=1)
    for bad in (-0.1, 1.5, True, "1"):
        with pytest.raises(OptionError, match=r"OPDConfig.gamma must be a number in \[0, 1\]"):
            OPDConfig(gamma=bad)
    with pytest.raises(OptionError, match="clip_eps_low"):
        OPDConfig(clip_eps_low=1.0)
    assert math.isfinite(OPDConfig().clip_eps_high)
