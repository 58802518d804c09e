"""The KL penalty's unbiased IS-corrected form (DeepSeek-V3.2 Sec. 3.1): k3 weighted by pi_theta / pi_behaviour.

Hand-computed on two tokens, then shown unbiased exactly: the expectation under the behaviour policy, by
enumeration of a 4-symbol distribution, equals KL(pi_theta || pi_ref) in value and gradient (float64), which the
plain k3 does not.
"""
import math

import pytest
import torch

from trainer.algorithms import GRPOConfig, LossInputs, LossNormalizer, RLOOConfig, grpo_loss, rloo_loss
from trainer.algorithms.kl import behaviour_ratio

F64 = torch.float64
LN2 = math.log(2.0)


def _inputs(lp, ref, behaviour, is_weights=None, mask=None):
    mask = torch.ones_like(lp) if mask is None else mask
    zeros = torch.zeros_like(lp)
    return LossInputs(logprobs=lp, old_logprobs=lp.detach(), advantages=zeros, mask=mask,
                      normalizer=LossNormalizer.from_mask(mask, max_len=4), ref_logprobs=ref, is_weights=is_weights,
                      behaviour_logprobs=behaviour)


def test_hand_computed_value_and_gradient():
    # lp = 0, ref = [ln 2, -ln 2], behaviour = [-ln 2, ln 2]:
    #   r = exp(lp - b) = [2, 0.5];  k3 = exp(ref - lp) - (ref - lp) - 1 = [1 - ln 2, ln 2 - 0.5] = [.306853, .193147]
    #   loss = mean(k3 * r) = (0.613706 + 0.096574) / 2 = 0.355140; the is_weights (3) do not touch the KL term
    #   d(k3 r)/dlp = r (1 - exp(ref - lp) + k3) = [2 (-1 + .306853), .5 (.5 + .193147)] = [-1.386294, .346574]
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    ref = torch.tensor([[LN2, -LN2]], dtype=F64)
    b = torch.tensor([[-LN2, LN2]], dtype=F64)
    out = grpo_loss(_inputs(lp, ref, b, is_weights=torch.full((1, 2), 3.0, dtype=F64)), GRPOConfig(kl_coef=1.0))
    assert out.loss.item() == pytest.approx((2 * (1 - LN2) + 0.5 * (LN2 - 0.5)) / 2)
    assert out.metrics["train/kl_ref"] == pytest.approx(0.25)  # logged unweighted, as before
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2 * LN2, LN2 / 2]], dtype=F64) / 2)


def test_rloo_sums_the_weighted_tokens_per_sequence():
    lp = torch.zeros(1, 2, dtype=F64, requires_grad=True)
    ref = torch.tensor([[LN2, -LN2]], dtype=F64)
    b = torch.tensor([[-LN2, LN2]], dtype=F64)
    out = rloo_loss(_inputs(lp, ref, b, is_weights=torch.full((1, 2), 3.0, dtype=F64)), RLOOConfig(kl_coef=1.0))
    assert out.loss.item() == pytest.approx(2 * (1 - LN2) + 0.5 * (LN2 - 0.5))  # one sequence: G = 1


def test_padding_is_not_read():
    lp = torch.tensor([[0.0, math.nan]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[LN2, math.inf]], dtype=F64)
    b = torch.tensor([[-LN2, math.nan]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0]], dtype=F64)
    for loss in (grpo_loss(_inputs(lp, ref, b, mask=mask), GRPOConfig(kl_coef=1.0)),
                 rloo_loss(_inputs(lp, ref, b, mask=mask), RLOOConfig(kl_coef=1.0))):
        assert loss.loss.item() == pytest.approx(2 * (1 - LN2))
        (g,) = torch.autograd.grad(loss.loss, lp)
        assert torch.isfinite(g).all() and g[0, 1] == 0


def _enumerated(theta, behaviour_probs, ref_logp, unbiased: bool):
    """grpo_loss over rows drawn in proportion to the behaviour policy: the exact expectation under it."""
    logp = torch.log_softmax(theta, -1)
    counts = (behaviour_probs * 8).round().long()  # [4, 2, 1, 1] of 8 rows
    rows = torch.repeat_interleave(torch.arange(4), counts)
    lp = logp[rows].view(-1, 1)
    b = torch.log(behaviour_probs)[rows].view(-1, 1)
    out = grpo_loss(_inputs(lp, ref_logp[rows].view(-1, 1), b if unbiased else None), GRPOConfig(kl_coef=1.0))
    return out.loss


def test_unbiased_in_value_and_gradient_where_plain_k3_is_not():
    theta = torch.tensor([0.3, -0.2, 1.1, 0.0], dtype=F64, requires_grad=True)
    behaviour = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=F64)
    ref_logp = torch.log_softmax(torch.tensor([0.0, 0.5, -0.5, 0.2], dtype=F64), -1)

    def true_kl():
        logp = torch.log_softmax(theta, -1)
        return (logp.exp() * (logp - ref_logp)).sum()

    (g_true,) = torch.autograd.grad(true_kl(), theta)
    est = _enumerated(theta, behaviour, ref_logp, unbiased=True)
    assert est.item() == pytest.approx(true_kl().item(), rel=1e-12)
    (g_est,) = torch.autograd.grad(est, theta)
    torch.testing.assert_close(g_est, g_true, rtol=1e-10, atol=1e-12)
    # k3 alone, on tokens the behaviour policy sampled, estimates neither
    plain = _enumerated(theta, behaviour, ref_logp, unbiased=False)
    (g_plain,) = torch.autograd.grad(plain, theta)
    assert abs(plain.item() - true_kl().item()) > 1e-3 and (g_plain - g_true).abs().max() > 1e-3


def test_ratio_is_clamped_and_shapes_checked():
    r = behaviour_ratio(torch.tensor([[50.0]]), torch.tensor([[0.0]]))
    assert r.item() == pytest.approx(math.exp(20.0))
    with pytest.raises(ValueError, match="behaviour_logprobs has shape"):
        behaviour_ratio(torch.zeros(1, 2), torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"LossInputs.behaviour_logprobs has shape \(1, 3\)"):
        _inputs(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 3))
