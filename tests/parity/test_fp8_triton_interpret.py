"""parity.fp8_triton's fused activation quantizer under Triton's interpreter, bitwise against quantize_act_groups.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` kernel is defined (on the first import of
``parity.fp8_triton``); in a normal session that may already have happened, so this module skips
itself unless the kernel is interpreted. ``test_fp8_gemm.py::test_triton_interpreter_tier`` runs it
in a fresh process with ``TRITON_INTERPRET=1`` (or by hand:
``TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/parity/test_fp8_triton_interpret.py``).

float32 and float16 inputs (the interpreter mishandles bfloat16 pointers). The interpreter's own
float32 -> float8e4nv conversion does not round to nearest even (17.0 -> 18.0), so the kernel's
float8 stores are checked on a GPU (``verify_scaled_mm``); here the kernel stores the clamped
float32 values it would cast (``store_f32=True``), checked bitwise against the torch quantizer's,
and their RNE cast against its codes, with the scales bitwise.
"""
import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import parity.fp8_triton as ft  # noqa: E402
from parity.precision import EPS, FP8_MAX, cast_to_e4m3, quantize_act_groups, scale_from_amax  # noqa: E402

pytestmark = pytest.mark.skipif(
    not isinstance(ft._act_quant_kernel, InterpretedFunction),
    reason="kernel defined without TRITON_INTERPRET=1; test_fp8_gemm.py runs this module in a subprocess",
)


def _inputs(dtype, m=37, k=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-4, 3, m)[:, None]
    x[torch.rand(m, k, generator=g) < 0.01] *= 40  # outliers set some groups' amax
    if m > 6 and k >= 256:
        x[3, :128] = 0  # a zero group
        x[4, 128:256] = 0.25  # a constant group: every element is its amax -> 448
        x[6, 7] = -x[6, :128].abs().max() * 2  # a negative amax
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m, k", [(37, 300), (32, 256), (1, 128), (5, 17)])
def test_scales_and_values_bitwise(dtype, m, k):
    x = _inputs(dtype, m, k)
    f, s = ft.quantize_act_groups_triton(x, store_f32=True)
    q0, s0 = quantize_act_groups(x)
    m_pad, kb = f.shape[0], s.shape[0]
    assert f.shape == (-(-m // ft.BLOCK_M) * ft.BLOCK_M, kb * 128) and s.shape == (kb, m_pad)
    assert torch.equal(s.t()[:m], s0)  # scales: bitwise
    # The float32 values the kernel casts, bitwise the torch quantizer's clamp(fp32(x) / s).
    groups = torch.nn.functional.pad(x.float(), (0, kb * 128 - k)).unflatten(-1, (kb, 128))
    want = (groups / s0[..., None]).clamp(-FP8_MAX, FP8_MAX).flatten(-2)
    assert torch.equal(f[:m], want)
    assert torch.equal(cast_to_e4m3(f[:m, :k]).view(torch.uint8), q0.view(torch.uint8))  # codes
    assert (f[m:] == 0).all() and (f[:, k:] == 0).all()  # padding: zeros
    assert torch.equal(s.t()[m:], scale_from_amax(torch.zeros(m_pad - m, kb)))


def test_edge_groups():
    x = _inputs(torch.float32)
    f, s = ft.quantize_act_groups_triton(x, store_f32=True)
    assert s[0, 3] == torch.tensor(EPS, dtype=torch.float32) / torch.tensor(448.0)  # float32 division
    assert (f[3, :128] == 0).all()
    # The element equal to the amax lands within a float32 ulp of 448 and casts to exactly 448.
    assert (cast_to_e4m3(f[4, 128:256]).float() == FP8_MAX).all() and (f[4, 128:256] <= FP8_MAX).all()
    assert cast_to_e4m3(f[6, 7:8]).float() == -FP8_MAX


def test_explicit_padding_and_strided_input():
    x = _inputs(torch.float16, 40, 256)
    f, s = ft.quantize_act_groups_triton(x[:, :200], m_pad=64, k_pad=384, store_f32=True)  # row stride 256
    q0, s0 = quantize_act_groups(x[:, :200])
    assert f.shape == (64, 384) and s.shape == (3, 64)
    assert torch.equal(s.t()[:40, :2], s0) and (f[:, 200:] == 0).all()
    assert torch.equal(cast_to_e4m3(f[:40, :200]).view(torch.uint8), q0.view(torch.uint8))
    with pytest.raises(ValueError, match="k_pad"):
        ft.quantize_act_groups_triton(x, k_pad=200)
