"""The backward's half-precision CPU products in float32 (trainer/precision/float32_backward_gemms.py)."""
import pytest
import torch

from trainer.precision import float32_backward_gemms as F32B
from trainer.precision.float32_backward_gemms import (
    Float32BackwardGemms,
    needs_float32_backward_gemms,
    with_float32_backward_gemms,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_each_product_is_the_float32_product_rounded_once(dtype):
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(7, 33, generator=g).to(dtype), torch.randn(33, 5, generator=g).to(dtype))
    bias = torch.randn(5, generator=g).to(dtype)
    x3, y3 = torch.randn(2, 7, 33, generator=g).to(dtype), torch.randn(2, 33, 5, generator=g).to(dtype)
    with Float32BackwardGemms():
        mm, addmm, bmm = a @ b, torch.addmm(bias, a, b, beta=0.5, alpha=2.0), torch.bmm(x3, y3)
        baddbmm = torch.baddbmm(x3[:, :, :5], x3, y3)
    assert mm.dtype == addmm.dtype == bmm.dtype == baddbmm.dtype == dtype
    assert torch.equal(mm, (a.float() @ b.float()).to(dtype))
    assert torch.equal(addmm, torch.addmm(bias.float(), a.float(), b.float(), beta=0.5, alpha=2.0).to(dtype))
    assert torch.equal(bmm, torch.bmm(x3.float(), y3.float()).to(dtype))
    assert torch.equal(baddbmm, torch.baddbmm(x3[:, :, :5].float(), x3.float(), y3.float()).to(dtype))
    # and against float64: within one rounding of the dtype
    exact = a.double() @ b.double()
    assert ((mm.double() - exact).abs() <= exact.abs() * torch.finfo(dtype).eps + 1e-6).all()


def test_float32_and_float64_products_pass_through_unchanged():
    a, b = torch.randn(4, 6), torch.randn(6, 3)
    with Float32BackwardGemms():
        assert torch.equal(a @ b, torch.mm(a, b))
        assert (a.double() @ b.double()).dtype == torch.float64


def _two_layer(dtype):
    g = torch.Generator().manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.Tanh(), torch.nn.Linear(96, 40))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return net.to(dtype), torch.randn(64, 48, generator=g).to(dtype)


def test_the_gradient_is_the_float64_gradient_of_the_same_bf16_forward_to_bf16_rounding():
    net, x = _two_layer(torch.bfloat16)
    ref = _two_layer(torch.bfloat16)[0].double()  # the same bf16 weights, held in float64
    loss = net(x).float().log_softmax(-1)[:, 3].sum()
    with Float32BackwardGemms():
        loss.backward()
    ref(x.double()).log_softmax(-1)[:, 3].sum().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        # the bf16 forward's own rounding plus the gradient's: a few bf16 steps of each tensor's scale
        err = (p.grad.double() - q.grad).abs().max() / q.grad.abs().max()
        assert err < 4 * torch.finfo(torch.bfloat16).eps, err


def test_only_the_backward_is_wrapped_and_the_forward_stays_bitwise():
    net, x = _two_layer(torch.bfloat16)
    calls = []
    wrapped = with_float32_backward_gemms(lambda loss: calls.append(torch.mm(x[:2], x[:2].t())) or loss.backward(),
                                          "bfloat16", "cpu")
    out_plain = net(x)
    out_again = net(x)
    assert torch.equal(out_plain, out_again)
    if needs_float32_backward_gemms("bfloat16", "cpu"):
        wrapped(out_plain.float().sum())
        assert torch.equal(calls[0], (x[:2].float() @ x[:2].float().t()).bfloat16())
    assert all(p.grad is None or p.grad.dtype == torch.bfloat16 for p in net.parameters())


def test_where_it_applies(monkeypatch):
    monkeypatch.setattr(F32B, "cpu_lacks_gemm", lambda dtype: True)
    assert needs_float32_backward_gemms("bfloat16", "cpu") and needs_float32_backward_gemms(torch.float16, "cpu")
    assert not needs_float32_backward_gemms("float32", "cpu")
    assert not needs_float32_backward_gemms("bfloat16", "cuda:0")
    backward = lambda loss: None
    assert with_float32_backward_gemms(backward, "bfloat16", "cpu") is not backward
    assert with_float32_backward_gemms(backward, "float32", "cpu") is backward
    monkeypatch.setattr(F32B, "cpu_lacks_gemm", lambda dtype: False)  # a CPU with oneDNN's BF16 GEMM
    assert with_float32_backward_gemms(backward, "bfloat16", "cpu") is backward


def test_the_cpu_check_reads_torchs_own_onednn_support():
    assert F32B.cpu_lacks_gemm(torch.bfloat16) == (not torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert F32B.cpu_lacks_gemm(torch.float32) is False
