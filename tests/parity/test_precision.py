"""parity.precision: the FP8 (E4M3, 128x128 / 1x128 block-scaled) quantizer both phases share.

Bounds asserted (module docstring derives them):
- per element, |t/s| >= 2^-6 (E4M3 normal range): |fq(t) - t| <= 2^-4 |t| (+ one rounding of the output dtype);
- |t/s| < 2^-6 (subnormal range): |fq(t) - t| <= 2^-10 s;
- the value equal to a block's amax maps to +-448 exactly; zero blocks give exact zeros, never NaN;
- fq(fq(t)) == fq(t) bitwise for bf16 (the engine re-quantizes what the trainer pushes).
"""
import pytest
import torch

from parity.fp8_gemm import fp8_linear_scaled_mm
from parity.precision import (
    EPS,
    FP8_MAX,
    cast_to_e4m3,
    dequantize_act_groups,
    dequantize_weight_blocks,
    fake_quant_act,
    fake_quant_weight,
    fake_quant_weight_shards,
    fp8_linear,
    quantize_act_groups,
    quantize_weight_blocks,
    scale_from_amax,
)

# The reciprocal form of the scale, which vLLM's CUDA engine does not use (tests at the end).
INV448 = torch.tensor(1 / 448, dtype=torch.float32)


def codes(q):
    """FP8 tensors compared by bit pattern (torch.equal on float8 is not supported everywhere)."""
    return q.view(torch.uint8)


def random_weights(seed, n=6, shape=(200, 300), dtype=torch.float32):
    """Tensors spanning magnitudes 1e-4..1e2, with heavy-tailed entries, so blocks differ in scale."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = torch.randn(shape, generator=g) * 10.0 ** (i - 4)
        t[torch.rand(shape, generator=g) < 0.01] *= 30  # outliers set some blocks' amax
        out.append(t.to(dtype))
    return out


# ---- the element cast -----------------------------------------------------------------------------
def test_cast_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([17.0, 19.0, 100.0, 101.0, 449.0, 1e4, -1e4, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 0.0, -3.0])
    # E4M3 spacing is 2 on [16, 32) and 8 on [64, 128): 17 and 100 are ties -> even mantissa (16, 96).
    # 2^-9 is the smallest subnormal; 2^-10 is a tie between 0 and 2^-9 -> 0.
    expected = [16.0, 20.0, 96.0, 104.0, 448.0, 448.0, -448.0, 2.0**-9, 0.0, 2.0**-9, 0.0, -3.0]
    assert cast_to_e4m3(x).float().tolist() == expected
    assert cast_to_e4m3(x).dtype == torch.float8_e4m3fn


# ---- hand-checkable blocks ------------------------------------------------------------------------
def test_weight_blocks_by_hand():
    w = torch.zeros(256, 256)
    w[:128, :128] = 3.0  # constant block: every element is the amax -> q = 448 -> back to 3.0
    w[:128, 128:] = 1.0
    w[0, 128] = 7.0  # amax 7 -> s = 7/448 = 1/64; 1.0 -> q = 64 exactly
    # block [128:, :128] stays zero
    w[128:, 128:] = 1.06  # amax 448 -> s = 1; 1.06 -> 1.0 (E4M3 spacing 0.125 at 1), 1.07 -> 1.125
    w[128, 128], w[129, 129], w[130, 130] = 448.0, 1.07, -448.0
    q, s = quantize_weight_blocks(w)
    assert s.shape == (2, 2) and s.dtype == torch.float32
    assert torch.equal(s, torch.tensor([[3.0, 7.0], [EPS, 448.0]]) / 448.0)
    qf = q.float()
    assert (qf[:128, :128] == 448).all()
    assert qf[0, 128] == 448 and (qf[1:128, 128:] == 64).all()
    assert (qf[128:, :128] == 0).all()
    assert qf[128, 128] == 448 and qf[130, 130] == -448 and qf[129, 129] == 1.125 and qf[131, 131] == 1.0
    fq = fake_quant_weight(w.bfloat16()).float()
    assert (fq[:128, :128] == 3.0).all() and (fq[1:128, 128:] == 1.0).all() and fq[0, 128] == 7.0
    assert (fq[128:, :128] == 0).all()
    assert fq[128, 128] == 448.0 and fq[129, 129] == 1.125 and fq[131, 131] == 1.0


def test_activation_groups_by_hand():
    x = torch.tensor([[1.0] * 127 + [8.0] + [0.0] * 128, [-2.0] * 256])
    q, s = quantize_act_groups(x)
    assert torch.equal(s, torch.tensor([[8.0, EPS], [2.0, 2.0]]) / 448.0)  # one scale per token and group
    assert q.float()[0, :127].eq(56).all() and q.float()[0, 127] == 448  # 1 / (8/448) = 56, exact in E4M3
    assert q.float()[1].eq(-448).all() and q.float()[0, 128:].eq(0).all()
    assert torch.equal(dequantize_act_groups(q, s, torch.float32), x)


# ---- error bounds ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,out_rounding", [(torch.float32, 2.0**-23), (torch.bfloat16, 2.0**-8)])
def test_round_trip_error_bounds(dtype, out_rounding):
    worst_normal = 0.0
    for w in random_weights(0, dtype=dtype):
        q, s = quantize_weight_blocks(w)
        s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        wf, err = w.float(), (fake_quant_weight(w).float() - w.float()).abs()
        normal = wf.abs() >= s_full * 2.0**-6
        rel = err[normal] / wf.abs()[normal]
        assert rel.max() <= 2.0**-4 + out_rounding, f"relative error {rel.max():.4g} over 2^-4"
        worst_normal = max(worst_normal, rel.max().item())
        sub = ~normal
        if sub.any():
            assert (err[sub] <= s_full[sub] * (2.0**-10 + 2.0**-20) + out_rounding * wf.abs()[sub]).all()
    # The bound is nearly attained (values near the middle of two E4M3 points exist), so it is a real check.
    assert worst_normal > 0.9 * 2.0**-4


def test_activation_round_trip_error_bound():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 384, generator=g) * torch.logspace(-3, 2, 64)[:, None]).bfloat16()
    q, s = quantize_act_groups(x)
    s_full = s.repeat_interleave(128, -1)
    xf, err = x.float(), (fake_quant_act(x).float() - x.float()).abs()
    normal = xf.abs() >= s_full * 2.0**-6
    assert (err[normal] <= (2.0**-4 + 2.0**-8) * xf.abs()[normal]).all()
    assert (err[~normal] <= s_full[~normal] * 2.0**-10 * 1.01).all()


# ---- shapes, zeros, saturation --------------------------------------------------------------------
def test_dims_not_divisible_by_128_pad_for_amax_only():
    w = random_weights(2, n=1)[0]  # [200, 300] -> 2 x 3 blocks, the last row/column of blocks partial
    q, s = quantize_weight_blocks(w)
    assert q.shape == w.shape and s.shape == (2, 3)
    # Each partial block is quantized exactly as if it were a tensor of its own (the zero padding is inert).
    for (r0, r1), (c0, c1), (bi, bj) in [((128, 200), (256, 300), (1, 2)), ((0, 128), (256, 300), (0, 2)),
                                         ((128, 200), (0, 128), (1, 0))]:
        qb, sb = quantize_weight_blocks(w[r0:r1, c0:c1].contiguous())
        assert sb.shape == (1, 1) and sb.item() == s[bi, bj].item()
        assert torch.equal(codes(qb), codes(q[r0:r1, c0:c1]))
    assert torch.equal(dequantize_weight_blocks(q, s, torch.float32), fake_quant_weight(w))
    x = w[:5]  # activations with K = 300: groups of 128, 128, 44
    qa, sa = quantize_act_groups(x)
    assert sa.shape == (5, 3)
    assert torch.equal(sa[:, 2], scale_from_amax(x[:, 256:].abs().amax(-1)))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_weight_blocks(q, s[:, :2])


def test_zero_blocks_give_exact_zeros_without_nan():
    w = torch.randn(256, 256).bfloat16()
    w[128:, :128] = 0
    fq = fake_quant_weight(w)
    assert torch.isfinite(fq).all() and (fq[128:, :128] == 0).all()
    assert torch.equal(fake_quant_weight(torch.zeros(3, 5)), torch.zeros(3, 5))
    q, s = quantize_weight_blocks(torch.zeros(130, 1))
    assert (s > 0).all() and (q.float() == 0).all()
    x = torch.zeros(4, 200, dtype=torch.bfloat16)
    assert torch.equal(fake_quant_act(x), x)
    out = fp8_linear(x, w[:, :200])
    assert torch.equal(out, torch.zeros_like(out))


def test_amax_maps_to_448_exactly():
    for w in random_weights(3, n=3):
        q, s = quantize_weight_blocks(w)
        qf = q.float()
        for bi in range(s.shape[0]):
            for bj in range(s.shape[1]):
                rows, cols = slice(bi * 128, (bi + 1) * 128), slice(bj * 128, (bj + 1) * 128)
                blk, qb = w[rows, cols], qf[rows, cols]
                at = blk.abs() == blk.abs().max()
                assert torch.equal(qb[at], torch.sign(blk[at]) * FP8_MAX)
                assert qb.abs().max() == FP8_MAX  # nothing beyond the clamp
    x = torch.tensor([[-5.0, 2.0, 1.0]])
    assert quantize_act_groups(x)[0].float()[0, 0] == -448


# ---- idempotence and determinism ------------------------------------------------------------------
def test_fake_quant_is_idempotent_bitwise_in_bf16():
    for w in random_weights(4, n=6, dtype=torch.bfloat16):
        once = fake_quant_weight(w)
        assert torch.equal(fake_quant_weight(once), once)
        a = fake_quant_act(w)
        assert torch.equal(fake_quant_act(a), a)
    # float32: the FP8 codes are identical (values may move by a float32 ulp of the scale).
    for w in random_weights(5, n=3):
        assert torch.equal(codes(quantize_weight_blocks(fake_quant_weight(w))[0]), codes(quantize_weight_blocks(w)[0]))


def test_activation_quantization_does_not_depend_on_the_batch():
    """Engine (continuous batching) and trainer (padded batches) group tokens differently: must not matter."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(2, 7, 384, generator=g).bfloat16()
    whole = fake_quant_act(x)
    for i in range(2):
        for t in range(7):
            assert torch.equal(fake_quant_act(x[i, t:t + 1]), whole[i, t:t + 1])
    assert torch.equal(fake_quant_act(x), whole)  # deterministic
    w = torch.randn(256, 384, generator=g).bfloat16()
    assert torch.equal(fp8_linear(x, w), fp8_linear(x, w))


# ---- the linear layer -----------------------------------------------------------------------------
def test_fp8_linear_is_the_fake_quant_matmul():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 5, 256, generator=g).bfloat16()
    w = (torch.randn(200, 256, generator=g) * 0.05).bfloat16()
    b = torch.randn(200, generator=g).bfloat16()
    ref = torch.nn.functional.linear(fake_quant_act(x), fake_quant_weight(w), b)
    assert torch.equal(fp8_linear(x, w, b), ref)
    assert torch.equal(fp8_linear(x, fake_quant_weight(w), b, weight_is_quantized=True), ref)
    assert fp8_linear(x, w, b).dtype == torch.bfloat16
    plain = torch.nn.functional.linear(x, w, b)
    assert not torch.equal(ref, plain)  # quantization is visible
    with pytest.raises(ValueError, match="do not match"):
        fp8_linear(x, w.t())
    with pytest.raises(RuntimeError, match="CUDA"):  # the FP8-GEMM backend, same contract, CUDA only
        fp8_linear_scaled_mm(x, w)


def test_straight_through_gradients():
    g = torch.Generator().manual_seed(8)
    x = torch.randn(4, 6, 256, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(200, 256, generator=g) * 0.05).bfloat16().requires_grad_()
    b = torch.randn(200, generator=g).bfloat16().requires_grad_()
    up = torch.randn(4, 6, 200, generator=g).bfloat16()
    (fp8_linear(x, w, b) * up).sum().backward()
    # Reference: the same GEMM on the fake-quantized operands as leaves; STE = identity through quantizers.
    xq = fake_quant_act(x.detach()).requires_grad_()
    wq = fake_quant_weight(w.detach()).requires_grad_()
    bq = b.detach().clone().requires_grad_()
    (torch.nn.functional.linear(xq, wq, bq) * up).sum().backward()
    assert torch.equal(x.grad, xq.grad) and torch.equal(w.grad, wq.grad) and torch.equal(b.grad, bq.grad)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    # The backward really uses the quantized operands, not the raw ones.
    assert not torch.equal(x.grad, up.flatten(0, 1).matmul(w.detach()).view_as(x))


def test_fused_shards_keep_each_module_s_blocks():
    g = torch.Generator().manual_seed(9)
    q, k, v = torch.randn(128, 128, generator=g), torch.randn(64, 128, generator=g) * 0.01, torch.randn(64, 128, generator=g)
    fused = torch.cat([q, k, v]).bfloat16()
    per_module = torch.cat([fake_quant_weight(t.bfloat16()) for t in (q, k, v)])
    assert torch.equal(fake_quant_weight_shards(fused, [128, 64, 64]), per_module)
    # Quantizing the fused matrix as one would put k and v in one block: k (100x smaller) loses precision.
    assert not torch.equal(fake_quant_weight(fused), per_module)
    with pytest.raises(ValueError, match="shard_rows"):
        fake_quant_weight_shards(fused, [128, 64])


def test_input_validation():
    with pytest.raises(ValueError, match="2-D"):
        quantize_weight_blocks(torch.zeros(2, 3, 4))
    with pytest.raises(TypeError, match="floating-point"):
        quantize_weight_blocks(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="block"):
        quantize_weight_blocks(torch.zeros(2, 3), block=0)
    with pytest.raises(ValueError, match="K >= 1"):
        quantize_act_groups(torch.zeros(3, 0))


# ---- the CUDA engine's activation quantizer is this one ------------------------------------------
# On CUDA the engine's FP8 layers run vLLM's CUTLASS block kernel (rollout.engine_options pins it), which
# quantizes activations with QuantFP8(use_ue8m0=False) -> per_token_group_quant_fp8 -> the CUDA op
# per_token_group_fp8_quant (vLLM's csrc/quantization/w8a8/fp8/per_token_group_quant.cu, ComputeGroupScale
# and QuantizeGroup):
#     float local_absmax = eps;  local_absmax = fmaxf(local_absmax, fabsf(x));  y_s = local_absmax / max_8bit;
#     q = DST_DTYPE(fminf(fmaxf(x / y_s, min_8bit), max_8bit))
# -- max(amax, 1e-10) / 448 by IEEE division, not amax * fp32(1/448) (one ulp apart for 55% of bf16 amax
# values). That op has no CPU build; vLLM's pure-torch version of it, QuantFP8.forward_native
# (model_executor/layers/quantization/input_quant_fp8.py, _quantize_group_native: ``absmax / _FP8_MAX``,
# then ``x_grouped / scales``), runs here and computes the same for amax >= 2^-9; below that it floors the
# scale at 1/(448*512) where the CUDA op floors amax at 1e-10 (the next test).
def _vllm_group_quantizer():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    with set_current_vllm_config(VllmConfig()):  # a CustomOp reads the compilation config when built
        # As CutlassFp8BlockScaledMMKernel builds it (kernels/linear/scaled_mm/cutlass.py), less the scales' layout.
        return QuantFP8(static=False, group_shape=GroupShape(1, 128), use_ue8m0=False, compile_native=False)


def _groups_with_every_bf16_amax(lo: float) -> torch.Tensor:
    """bf16 [n, 256]: row i's first 1x128 group has the i-th positive finite bf16 value >= lo as its amax
    (the other elements below it, one of them negative), its second group random."""
    v = torch.arange(0x0001, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    v = v[v.float() >= lo]
    g = torch.Generator().manual_seed(11)
    first = (v.float()[:, None] * (torch.rand(len(v), 128, generator=g) * 2 - 1)).bfloat16()
    first[:, 5] = v
    first[:, 9] = -v
    second = (torch.randn(len(v), 128, generator=g) * 10.0 ** torch.randint(-2, 4, (len(v), 1), generator=g)).bfloat16()
    second[:, 0] = 2.0**-8  # amax >= 2^-9 in every group (the range where the two references agree)
    return torch.cat([first, second], dim=1)


def test_activation_quantizer_is_vllms_on_every_bf16_amax():
    x = _groups_with_every_bf16_amax(2.0**-9)
    assert len(x) > 15000
    ref_q, ref_s = _vllm_group_quantizer().forward_native(x)
    q, s = quantize_act_groups(x)
    assert torch.equal(s, ref_s)
    assert torch.equal(codes(q), codes(ref_q))
    # The multiply-by-reciprocal form differs on most of these amax values: the comparison above can fail.
    amax = x[:, :128].abs().amax(-1).float()
    assert (amax * INV448 != s[:, 0]).float().mean() > 0.5


def test_zero_and_tiny_groups_follow_vllms_cuda_op():
    # The amax floor of the CUDA op (local_absmax starts at eps = 1e-10, per_token_group_quant_fp8's default).
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    x[1, :3] = torch.tensor([1e-12, -3e-11, 2e-12])
    x[2, 128:] = 2.0**-12
    x[3, 7] = -2.0**-10
    q, s = quantize_act_groups(x)
    amax = x.float().unflatten(-1, (2, 128)).abs().amax(-1)
    expected = torch.maximum(amax, torch.tensor(1e-10)) / torch.full_like(amax, 448.0)
    assert torch.equal(s, expected)
    assert torch.equal(codes(q), codes(cast_to_e4m3(x.float() / expected.repeat_interleave(128, dim=-1))))
    assert q.float()[0].eq(0).all() and q.float()[3, 7] == -448
