import math

import pytest
import torch

from trainer.algorithms.kl import kl_k1, kl_k2, kl_k3

LN2 = math.log(2.0)
# logprobs = 0, ref - lp = logr in {ln 2, 0, -ln 2}
LP = torch.zeros(1, 3, dtype=torch.float64)
REF = torch.tensor([[LN2, 0.0, -LN2]], dtype=torch.float64)


def test_values_hand_computed():
    # k1 = -logr = [-ln2, 0, ln2]
    torch.testing.assert_close(kl_k1(LP, REF), torch.tensor([[-LN2, 0.0, LN2]], dtype=torch.float64))
    # k2 = logr^2 / 2 = [ln2^2/2, 0, ln2^2/2] = [0.240227, 0, 0.240227]
    torch.testing.assert_close(kl_k2(LP, REF), torch.tensor([[0.2402265, 0.0, 0.2402265]], dtype=torch.float64))
    # k3 = e^logr - logr - 1: 2 - ln2 - 1 = 0.306853; 1 - 0 - 1 = 0; 0.5 + ln2 - 1 = 0.193147
    torch.testing.assert_close(kl_k3(LP, REF), torch.tensor([[0.3068528, 0.0, 0.1931472]], dtype=torch.float64))


def test_k3_gradient_hand_computed_and_ref_gets_none():
    lp = LP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    kl_k3(lp, ref).sum().backward()
    # d k3 / d lp = 1 - e^(ref - lp) = [1 - 2, 1 - 1, 1 - 0.5] = [-1, 0, 0.5]
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.0, 0.5]], dtype=torch.float64))
    assert ref.grad is None  # the reference policy is a constant


def test_gradcheck():
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    lp = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    for fn in (kl_k1, kl_k2, kl_k3):
        assert torch.autograd.gradcheck(lambda x, fn=fn: fn(x, ref), (lp,))


def test_exact_expectation_k1_k3_unbiased_k3_nonnegative():
    # Tokens sampled from p; E_p[k] over the whole vocabulary, computed exactly (no sampling):
    # E_p[k1] = E_p[k3] = KL(p || q) since E_p[q/p] = 1.
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    kl = (p * (p / q).log()).sum()
    lp, ref = p.log()[None], q.log()[None]
    torch.testing.assert_close((p * kl_k1(lp, ref)[0]).sum(), kl)
    torch.testing.assert_close((p * kl_k3(lp, ref)[0]).sum(), kl)
    assert (kl_k3(lp, ref) >= 0).all() and (kl_k2(lp, ref) >= 0).all()


def test_k3_tiny_log_ratio_is_not_rounded_to_zero():
    # e^x - x - 1 ~ x^2/2 = 5e-17 at x = 1e-8; the naive formula cancels to 0 in float64
    lp = torch.zeros(1, 1, dtype=torch.float64)
    ref = torch.full((1, 1), 1e-8, dtype=torch.float64)
    assert kl_k3(lp, ref).item() == pytest.approx(5e-17, rel=1e-6, abs=0)  # naive: -6.1e-17


def test_bf16_is_computed_in_float32_and_shape_checked():
    out = kl_k3(torch.zeros(2, 2, dtype=torch.bfloat16), torch.full((2, 2), 0.5, dtype=torch.bfloat16))
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(2, 3\), expected \(2, 2\)"):
        kl_k3(torch.zeros(2, 2), torch.zeros(2, 3))
