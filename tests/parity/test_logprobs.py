"""parity.logprobs: the chunked kernel against the plain full-logits reference."""

import math
import warnings

import pytest
import torch

import parity.logprobs.sizing as sizing
import parity.logprobs.torch_path as torch_path  # the passes look the tiles up here
from parity.logprobs import fused_gather_logprobs, fused_logprobs, naive_logprobs


def _inputs(n=19, h=4, v=23, dtype=torch.float64, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    b = (torch.randn(v, generator=g, dtype=torch.float64) * 0.3).to(dtype) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, b, targets


# ---------------------------------------------------------------- hand values


def test_uniform_distribution_hand_value():
    # weight = 0 -> every logit is 0 -> p = 1/V for V = 8:
    #   logprob = -log 8 = -2.0794415, entropy = log 8 = 2.0794415 (any temperature).
    hidden = torch.randn(5, 3)
    weight = torch.zeros(8, 3)
    targets = torch.tensor([0, 7, 3, 3, 1])
    lp, ent = fused_logprobs(hidden, weight, targets, temperature=0.5, return_entropy=True, chunk_size=2)
    assert torch.allclose(lp, torch.full((5,), -math.log(8)), atol=1e-6)
    assert torch.allclose(ent, torch.full((5,), math.log(8)), atol=1e-6)


def test_two_token_hand_value_with_bias_and_temperature():
    # V = 2, logits = h*w + b = [1*2 + 0, 1*0 + 1] = [2, 1]; T = 2 -> z = [1, 0.5]
    # lse = log(e^1 + e^0.5) = log(2.7182818 + 1.6487213) = log(4.3670031) = 1.4740770
    # logprob(target 1) = 0.5 - 1.4740770 = -0.9740770
    # p = [0.6224593, 0.3775407]; entropy = -(0.6224593 ln 0.6224593 + 0.3775407 ln 0.3775407)
    #   = -(0.6224593 * -0.4740770 + 0.3775407 * -0.9740770) = 0.2950937 + 0.3677538 = 0.6628475
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[2.0], [0.0]])
    bias = torch.tensor([0.0, 1.0])
    lp, ent = fused_logprobs(hidden, weight, torch.tensor([1]), bias=bias, temperature=2.0, return_entropy=True)
    assert lp.item() == pytest.approx(-0.9740770, abs=1e-6)
    assert ent.item() == pytest.approx(0.6628475, abs=1e-6)


# ---------------------------------------------------------------- gradients


@pytest.mark.parametrize("temperature, chunk", [(1.0, 8), (0.7, 8), (0.7, None)])
def test_gradcheck_logprobs_and_entropy_all_inputs(temperature, chunk):
    # N = 19, V = 23 are not multiples of the 8-row chunk nor the 10-entry vocab block,
    # so ragged last tiles in both directions are exercised (rows 8+8+3, vocab 10+10+3).
    # chunk=None sizes from the budget: one row chunk, the weight gradient written directly.
    hidden, weight, bias, targets = _inputs()
    args = (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_())

    def f(h, w, b):
        lp, ent = fused_logprobs(
            h, w, targets, bias=b, temperature=temperature, return_entropy=True, chunk_size=chunk, vocab_chunk_size=10
        )
        return lp, ent

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_combined_loss_of_logprobs_and_entropy():
    # A scalar loss mixing both outputs with per-token weights (entropy bonus + weighted PG loss).
    hidden, weight, bias, targets = _inputs(seed=1)
    coef_lp = torch.randn(19, dtype=torch.float64)
    coef_ent = torch.randn(19, dtype=torch.float64)

    def f(h, w, b):
        lp, ent = fused_logprobs(
            h, w, targets, bias=b, temperature=1.3, return_entropy=True, chunk_size=5, vocab_chunk_size=7
        )
        return (coef_lp * lp).sum() - 0.01 * (coef_ent * ent).sum()

    assert torch.autograd.gradcheck(
        f, (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()), eps=1e-6, atol=1e-7
    )


def test_gradcheck_entropy_only():
    # logprob unused -> its upstream gradient is None inside backward.
    hidden, weight, bias, targets = _inputs(seed=2)
    f = lambda h, w: fused_logprobs(h, w, targets, bias=bias, return_entropy=True, chunk_size=6)[1]
    assert torch.autograd.gradcheck(f, (hidden.requires_grad_(), weight.requires_grad_()), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("entropy", [False, True])
def test_gradcheck_frozen_lm_head(entropy):
    # Only hidden needs a gradient (LoRA): without entropy this is the precomputed-G path.
    hidden, weight, bias, targets = _inputs(seed=3)

    def f(h):
        lp, ent = fused_logprobs(h, weight, targets, bias=bias, temperature=0.9, return_entropy=entropy, chunk_size=7)
        return (lp, ent) if entropy else lp

    assert torch.autograd.gradcheck(f, (hidden.requires_grad_(),), eps=1e-6, atol=1e-7)


def test_frozen_lm_head_backward_does_no_tile_work(monkeypatch):
    # The precomputed path must not recompute logits in backward (that is its point).
    hidden, weight, bias, targets = _inputs(seed=4, dtype=torch.float32)
    hidden.requires_grad_()
    lp, _ = fused_logprobs(hidden, weight, targets, bias=bias, chunk_size=8)

    def boom(*a, **k):
        raise AssertionError("backward tile called on the frozen-lm_head path")

    monkeypatch.setattr(torch_path, "_backward_tile", boom)
    lp.sum().backward()
    ref_h = hidden.detach().clone().requires_grad_()
    naive_logprobs(ref_h, weight, targets, bias=bias)[0].sum().backward()
    assert torch.allclose(hidden.grad, ref_h.grad, atol=1e-5)


def test_detached_entropy_keeps_the_frozen_shortcut(monkeypatch):
    # entropy_grad=False: the entropy of the same forward, no gradient, and the backward is
    # the precomputed-G one (no tile recomputed), as when the loop only logs the entropy.
    hidden, weight, bias, targets = _inputs(seed=4)
    g = torch.randn(19, dtype=torch.float64)
    h_ref = hidden.clone().requires_grad_()
    lp_ref, ent_ref = fused_logprobs(h_ref, weight, targets, bias=bias, temperature=0.8, return_entropy=True,
                                     chunk_size=8)
    (g * lp_ref).sum().backward()

    monkeypatch.setattr(torch_path, "_backward_tile", lambda *a, **k: pytest.fail("backward tile on the frozen path"))
    h = hidden.clone().requires_grad_()
    lp, ent = fused_logprobs(h, weight, targets, bias=bias, temperature=0.8, return_entropy=True,
                             entropy_grad=False, chunk_size=8)
    assert ent_ref.requires_grad and not ent.requires_grad
    assert torch.equal(ent, ent_ref.detach()) and torch.equal(lp.detach(), lp_ref.detach())
    (g * lp).sum().backward()
    assert torch.allclose(h.grad, h_ref.grad, atol=1e-12)
    _, ent64 = naive_logprobs(hidden, weight, targets, bias=bias, temperature=0.8, return_entropy=True)
    assert torch.allclose(ent, ent64, atol=1e-12)


def test_detached_entropy_full_path_gradcheck():
    # With the lm_head trained the backward recomputes tiles, but without the entropy term.
    hidden, weight, bias, targets = _inputs(seed=5)

    def f(h, w):
        lp, ent = fused_logprobs(h, w, targets, bias=bias, return_entropy=True, entropy_grad=False, chunk_size=7,
                                 vocab_chunk_size=10)
        assert not ent.requires_grad
        return lp

    assert torch.autograd.gradcheck(f, (hidden.requires_grad_(), weight.requires_grad_()), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("entropy", [False, True])
def test_non_scalar_upstream_gradient_matches_naive(entropy):
    # Per-token weighted loss (Liger-Kernel issue #1298 shipped wrong gradients here).
    # Two calls with different upstream gradients must give different, correct gradients.
    hidden, weight, bias, targets = _inputs(n=50, h=8, v=41, dtype=torch.float32, seed=5)
    for seed in (0, 1):
        g = torch.randn(50, generator=torch.Generator().manual_seed(seed))
        grads = []
        for fn in (fused_logprobs, naive_logprobs):
            h = hidden.clone().requires_grad_()
            w = weight.clone().requires_grad_()
            b = bias.clone().requires_grad_()
            lp, ent = fn(h, w, targets, bias=b, return_entropy=entropy, chunk_size=16, vocab_chunk_size=16)
            (lp * g).sum().backward() if not entropy else ((lp * g).sum() + (ent * g.flip(0)).sum()).backward()
            grads.append((h.grad, w.grad, b.grad))
        for a, r in zip(*grads):
            assert torch.allclose(a, r, atol=2e-5, rtol=1e-4)


def test_non_scalar_upstream_gradient_frozen_lm_head():
    hidden, weight, bias, targets = _inputs(n=50, h=8, v=41, dtype=torch.float32, seed=6)
    g = torch.randn(50)
    h1 = hidden.clone().requires_grad_()
    fused_logprobs(h1, weight, targets, bias=bias, chunk_size=16)[0].backward(g)
    h2 = hidden.clone().requires_grad_()
    naive_logprobs(h2, weight, targets, bias=bias)[0].backward(g)
    assert torch.allclose(h1.grad, h2.grad, atol=2e-5, rtol=1e-4)


# ---------------------------------------------------------------- against naive, float32 / bfloat16


def _run(fn, hidden, weight, bias, targets, g_lp, g_ent, **kw):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    b = bias.clone().requires_grad_()
    lp, ent = fn(h, w, targets, bias=b, return_entropy=True, temperature=0.8, **kw)
    ((lp.double() * g_lp).sum() + (ent.double() * g_ent).sum()).backward()
    return [x.detach().double() for x in (lp, ent, h.grad, w.grad, b.grad)]


def test_float32_matches_naive():
    # Same float32 arithmetic, different reduction order (tiled log-sum-exp, gradients summed
    # tile by tile): agreement to a few float32 ulps of the magnitudes involved (|logit| <~ 10).
    hidden, weight, bias, targets = _inputs(n=300, h=32, v=500, dtype=torch.float32, seed=7)
    g_lp, g_ent = torch.randn(300, dtype=torch.float64), torch.randn(300, dtype=torch.float64)
    fused = _run(fused_logprobs, hidden, weight, bias, targets, g_lp, g_ent, chunk_size=64, vocab_chunk_size=128)
    naive = _run(naive_logprobs, hidden, weight, bias, targets, g_lp, g_ent)
    for name, a, r in zip(("logprob", "entropy", "d_hidden", "d_weight", "d_bias"), fused, naive):
        assert torch.allclose(a, r, atol=2e-5, rtol=1e-5), (name, (a - r).abs().max())


@pytest.mark.parametrize("chunk", [48, None])
def test_bfloat16_matches_naive_and_is_as_accurate(chunk):
    # bf16 inputs: both versions run the same bf16 matmul and float32 softmax, so the
    # log-probs/entropies agree to float32 rounding (atol 1e-4). Gradients pass through a
    # bf16 cast of d/dlogits before the backward matmuls and are returned in bf16, so
    # fused and naive differ by bf16 rounding (8 mantissa bits: ~2^-8 relative to the
    # largest gradient entry); the fair bar is that the fused error against a float64
    # reference is no worse than the naive one's (x1.25 slack for a different rounding order).
    hidden, weight, bias, targets = _inputs(n=256, h=64, v=777, dtype=torch.float32, seed=8)
    hidden, weight, bias = (x * 2 for x in (hidden, weight, bias))  # logits of a few units, like an LM
    hb, wb, bb = (x.to(torch.bfloat16) for x in (hidden, weight, bias))
    g_lp, g_ent = torch.randn(256, dtype=torch.float64), torch.randn(256, dtype=torch.float64)
    fused = _run(fused_logprobs, hb, wb, bb, targets, g_lp, g_ent, chunk_size=chunk, vocab_chunk_size=200)
    naive = _run(naive_logprobs, hb, wb, bb, targets, g_lp, g_ent)
    ref = _run(naive_logprobs, hb.double(), wb.double(), bb.double(), targets, g_lp, g_ent)
    for name, a, n, r in zip(("logprob", "entropy", "d_hidden", "d_weight", "d_bias"), fused, naive, ref):
        scale = r.abs().max()
        if name in ("logprob", "entropy"):
            assert (a - n).abs().max() <= 1e-4, name
        else:
            assert (a - n).abs().max() <= 2 ** -6 * scale, (name, (a - n).abs().max(), scale)
        assert (a - r).abs().max() <= 1.25 * (n - r).abs().max() + 2 ** -10 * scale, name


# ---------------------------------------------------------------- shapes, masking, no-grad


def test_3d_input_equals_flattened():
    hidden, weight, bias, targets = _inputs(n=24, dtype=torch.float32, seed=9)
    lp3, ent3 = fused_logprobs(hidden.view(4, 6, -1), weight, targets.view(4, 6), bias=bias, return_entropy=True, chunk_size=5)
    lp2, ent2 = fused_logprobs(hidden, weight, targets, bias=bias, return_entropy=True, chunk_size=5)
    assert lp3.shape == (4, 6) and ent3.shape == (4, 6)
    assert torch.equal(lp3.reshape(-1), lp2) and torch.equal(ent3.reshape(-1), ent2)


def test_ignored_targets_zero_value_and_no_gradient():
    hidden, weight, bias, targets = _inputs(n=20, dtype=torch.float32, seed=10)
    targets = targets.view(4, 5).clone()
    targets[0, :2] = -100  # prompt
    targets[3, 3:] = -100  # padding
    hidden = hidden.view(4, 5, -1)
    h = hidden.clone().requires_grad_()
    lp, ent = fused_logprobs(h, weight, targets, bias=bias, return_entropy=True, chunk_size=3)
    ignored = targets == -100
    assert torch.all(lp[ignored] == 0) and torch.all(ent[ignored] == 0)
    (lp.sum() + ent.sum()).backward()
    assert torch.all(h.grad[ignored] == 0)
    assert torch.all(h.grad[~ignored].abs().sum(-1) > 0)
    ref_lp, ref_ent = naive_logprobs(hidden, weight, targets, bias=bias, return_entropy=True)
    assert torch.allclose(lp, ref_lp, atol=1e-5) and torch.allclose(ent, ref_ent, atol=1e-5)


def test_all_targets_ignored():
    hidden, weight, _, _ = _inputs(n=6, dtype=torch.float32)
    h = hidden.clone().requires_grad_()
    lp, ent = fused_logprobs(h, weight, torch.full((6,), -100), return_entropy=True)
    assert torch.all(lp == 0) and torch.all(ent == 0)
    lp.sum().backward()  # must not raise: the output still depends on hidden
    assert torch.all(h.grad == 0)


def test_requires_grad_false_and_no_grad():
    hidden, weight, bias, targets = _inputs(n=10, dtype=torch.float32)
    lp, ent = fused_logprobs(hidden, weight, targets, bias=bias, return_entropy=True)
    assert not lp.requires_grad and lp.dtype == torch.float32
    with torch.no_grad():
        lp2, _ = fused_logprobs(hidden.requires_grad_(), weight, targets, bias=bias)
    assert not lp2.requires_grad
    assert torch.equal(lp, lp2)


def test_output_dtype_is_float32_for_bf16():
    hidden, weight, _, targets = _inputs(n=4, dtype=torch.bfloat16)
    lp, ent = fused_logprobs(hidden, weight, targets, return_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32


# ---------------------------------------------------------------- out-of-memory halving


def _inject_oom(monkeypatch, name, max_rows, exc):
    real = getattr(torch_path, name)
    seen = []

    def flaky(h, *args, **kwargs):
        seen.append(h.shape[0])
        if h.shape[0] > max_rows:
            raise exc
        return real(h, *args, **kwargs)

    monkeypatch.setattr(torch_path, name, flaky)
    return seen


@pytest.mark.parametrize(
    "exc", [torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("DefaultCPUAllocator: can't allocate memory")]
)
def test_forward_oom_halves_chunk(monkeypatch, exc):
    hidden, weight, bias, targets = _inputs(n=100, dtype=torch.float32, seed=11)
    seen = _inject_oom(monkeypatch, "_forward_tile", 16, exc)
    with pytest.warns(RuntimeWarning, match="out of memory"):
        lp, _ = fused_logprobs(hidden, weight, targets, bias=bias, chunk_size=64)
    assert seen[0] == 64 and 32 in seen and max(seen[-3:]) == 16  # 64 -> 32 -> 16 rows
    assert torch.allclose(lp, naive_logprobs(hidden, weight, targets, bias=bias)[0], atol=1e-5)


def test_backward_oom_halves_chunk(monkeypatch):
    hidden, weight, bias, targets = _inputs(n=100, dtype=torch.float32, seed=12)
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    lp, _ = fused_logprobs(h, w, targets, bias=bias, chunk_size=64)
    _inject_oom(monkeypatch, "_backward_tile", 32, torch.OutOfMemoryError("out of memory"))
    with pytest.warns(RuntimeWarning, match="backward: out of memory"):
        lp.sum().backward()
    h2 = hidden.clone().requires_grad_()
    w2 = weight.clone().requires_grad_()
    naive_logprobs(h2, w2, targets, bias=bias)[0].sum().backward()
    assert torch.allclose(h.grad, h2.grad, atol=1e-5) and torch.allclose(w.grad, w2.grad, atol=1e-5)


def test_oom_below_floor_is_reraised(monkeypatch):
    hidden, weight, _, targets = _inputs(n=40, v=20, dtype=torch.float32)
    _inject_oom(monkeypatch, "_forward_tile", 0, torch.OutOfMemoryError("out of memory"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(torch.OutOfMemoryError):
            fused_logprobs(hidden, weight, targets, chunk_size=32)


def test_other_runtime_errors_are_not_swallowed(monkeypatch):
    hidden, weight, _, targets = _inputs(n=40, dtype=torch.float32)
    _inject_oom(monkeypatch, "_forward_tile", 0, RuntimeError("shape mismatch"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no halving warning either
        with pytest.raises(RuntimeError, match="shape mismatch"):
            fused_logprobs(hidden, weight, targets, chunk_size=32)


# ---------------------------------------------------------------- sizing and validation


def test_auto_chunk_from_budget():
    # 64 MiB / (4 bytes * 32768) = 512 rows; / (4 * 131072) = 128 rows; tiny budgets floor at 16.
    assert sizing._auto_chunk_rows(32768, 64 * 2**20) == 512
    assert sizing._auto_chunk_rows(131072, 64 * 2**20) == 128
    assert sizing._auto_chunk_rows(10**9, 64 * 2**20) == sizing.MIN_CHUNK_ROWS
    # weight-gradient accumulator: 64 MiB / 4 / (4 bytes * 1024) = 4096 vocab rows; floor 1024.
    assert sizing._auto_vocab_block(1024, 64 * 2**20) == 4096
    assert sizing._auto_vocab_block(8192, 64 * 2**20) == 1024


def test_backward_tile_shape():
    # Tile budget 32 MiB = 2**23 floats. N = 4096 -> all rows in one tile, 2**23 / 4096 = 2048 vocab.
    assert sizing._backward_tile_shape(4096, 32768, 1024, 0, 0) == (4096, 2048)
    assert sizing._backward_tile_shape(2048, 131072, 1024, 0, 0) == (2048, 4096)
    assert sizing._backward_tile_shape(100, 500, 64, 0, 0) == (100, 500)  # small: one tile
    # N = 16384 would leave 512 vocab rows: use the accumulator instead,
    # block 2**24 / 4 / 4096 = 4096 vocab (H = 1024), 2**23 / 4096 = 2048 rows.
    assert sizing._backward_tile_shape(16384, 32768, 1024, 0, 0) == (2048, 4096)
    # Explicit sizes are honoured (vocab block capped at V, rows at N).
    assert sizing._backward_tile_shape(100, 500, 64, 16, 0) == (16, 500)
    assert sizing._backward_tile_shape(100, 500, 64, 0, 50) == (100, 50)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(targets=torch.tensor([0, 29, 1])), "targets: 1 ids outside"),
        (dict(targets=torch.tensor([0.0, 1.0, 2.0])), "targets: expected an integer"),
        (dict(targets=torch.tensor([0, 1])), "targets: expected shape"),
        (dict(weight=torch.zeros(29, 6, dtype=torch.float64)), "weight: dtype"),
        (dict(weight=torch.zeros(29, 5)), "weight: hidden size 5"),
        (dict(temperature=0.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(bias=torch.zeros(3)), "bias: expected shape"),
    ],
)
def test_bad_input_errors_name_the_argument(kwargs, match):
    args = dict(hidden=torch.zeros(3, 6), weight=torch.zeros(29, 6), targets=torch.tensor([0, 1, 2]))  # V = 29
    args.update(kwargs)
    hidden, weight, targets = args.pop("hidden"), args.pop("weight"), args.pop("targets")
    with pytest.raises(ValueError, match=match):
        fused_logprobs(hidden, weight, targets, **args)


# ---------------------------------------------------------------- memory: never the full logits


class _LargestTensor:
    """Records the largest tensor any aten op returns while active (a TorchDispatchMode)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        outer.largest = max(outer.largest, t.numel())
                return out

        self.largest = 0
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)


@pytest.mark.parametrize("frozen", [False, True])
def test_no_op_materialises_more_than_one_tile(frozen):
    # N = 64, V = 1000, H = 8, chunk 16: a forward tile is 16 x 1000 = 16000 elements, the
    # full logits 64000. Gradients are V x H = 8000 and N x H = 512, so nothing may exceed 16000.
    hidden, weight, bias, targets = _inputs(n=64, h=8, v=1000, dtype=torch.float32, seed=13)
    h = hidden.requires_grad_()
    w = weight.requires_grad_(not frozen)
    g = torch.randn(64)
    with _LargestTensor() as fused:
        lp, ent = fused_logprobs(h, w, targets, bias=bias, return_entropy=not frozen, chunk_size=16, vocab_chunk_size=250)
        ((lp * g).sum() + (ent.sum() if ent is not None else 0)).backward()
    assert fused.largest <= 16 * 1000
    with _LargestTensor() as naive:  # the detector does see full logits
        naive_logprobs(h, w, targets, bias=bias)[0].sum().backward()
    assert naive.largest >= 64 * 1000


# ---- fused_gather_logprobs (the trainer side of the top-k KL) --------------------------------------
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
def test_gather_logprobs_equal_the_full_log_softmax(dtype, atol):
    g = torch.Generator().manual_seed(0)
    n, h, v, k = 37, 16, 101, 6
    hidden = torch.randn(2, n, h, generator=g).to(dtype)
    weight = torch.randn(v, h, generator=g).to(dtype)
    bias = torch.randn(v, generator=g)
    ids = torch.randint(0, v, (2, n, k), generator=g)
    got = fused_gather_logprobs(hidden, weight, ids, bias=bias, temperature=0.7, chunk_size=8)
    # Reference: the matmul in the input dtype (like the kernel), the rest in float32.
    full = torch.log_softmax(((hidden @ weight.T).float() + bias) / 0.7, -1)
    assert got.shape == ids.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, full.gather(-1, ids), atol=atol, rtol=0)


def test_gather_logprobs_agree_with_fused_logprobs_bitwise():
    # Same tile code: a target's value is identical in both functions (bf16 included),
    # so the top-k KL and the sampled-token metrics see one trainer distribution.
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(50, 32, generator=g).bfloat16()
    weight = torch.randn(300, 32, generator=g).bfloat16()
    targets = torch.randint(0, 300, (50,), generator=g)
    lp, _ = fused_logprobs(hidden, weight, targets, temperature=0.9, chunk_size=16)
    got = fused_gather_logprobs(hidden, weight, targets[:, None], temperature=0.9, chunk_size=16)
    assert torch.equal(got[:, 0], lp)


def test_gather_logprobs_refuses_bad_ids():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="outside"):
        fused_gather_logprobs(hidden, weight, torch.full((4, 2), 10))
    with pytest.raises(ValueError, match="ids: expected shape"):
        fused_gather_logprobs(hidden, weight, torch.zeros(3, 2, dtype=torch.long))


# ---------------------------------------------------------------- logit transform (softcap, scale)


def test_softcap_and_scale_hand_value():
    # V = 2, raw logits u = [2, 1], cap = 2, scale = 0.5, T = 0.5:
    #   softcap(u) = 2 tanh(u / 2) = [2 tanh 1, 2 tanh 0.5] = [1.5231883, 0.9242343]
    #   z = softcap(u) * 0.5 / 0.5 = [1.5231883, 0.9242343]
    #   logprob(target 0) = -log(1 + e^(0.9242343 - 1.5231883)) = -log(1 + 0.5493860) = -0.4378587
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[2.0], [1.0]])
    lp, _ = fused_logprobs(hidden, weight, torch.tensor([0]), temperature=0.5, logit_softcap=2.0, logit_scale=0.5)
    assert lp.item() == pytest.approx(-0.4378587, abs=1e-6)
    # Without the transform the same inputs give -log(1 + e^-2) = -0.1269280: the transform is not a no-op.
    plain, _ = fused_logprobs(hidden, weight, torch.tensor([0]), temperature=0.5)
    assert plain.item() == pytest.approx(-0.1269280, abs=1e-6)


@pytest.mark.parametrize("chunk", [8, None])
def test_gradcheck_softcap_all_inputs(chunk):
    # Weights scaled up so |u| reaches the cap: tanh is in its curved range, where a missing
    # (1 - tanh^2) factor in the backward would be caught.
    hidden, weight, bias, targets = _inputs()
    weight = weight * 4
    args = (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_())

    def f(h, w, b):
        return fused_logprobs(h, w, targets, bias=b, temperature=0.7, return_entropy=True, chunk_size=chunk,
                              vocab_chunk_size=10, logit_softcap=1.5, logit_scale=0.8)

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_softcap_frozen_lm_head():
    # The precomputed d logprob / d hidden path (frozen lm_head, no entropy).
    hidden, weight, bias, targets = _inputs()
    weight = weight * 4
    f = lambda h: fused_logprobs(h, weight, targets, bias=bias, temperature=0.7, chunk_size=8,
                                 logit_softcap=1.5, logit_scale=0.8)[0]
    assert torch.autograd.gradcheck(f, (hidden.requires_grad_(),), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("kwargs", [dict(logit_softcap=1.5), dict(logit_scale=0.25),
                                    dict(logit_softcap=3.0, logit_scale=2.0)])
def test_transform_matches_naive_and_gather(kwargs):
    hidden, weight, bias, targets = _inputs(dtype=torch.float32)
    weight = weight * 4
    lp, ent = fused_logprobs(hidden, weight, targets, bias=bias, temperature=0.9, return_entropy=True, chunk_size=8,
                             **kwargs)
    ref, ref_ent = naive_logprobs(hidden, weight, targets, bias=bias, temperature=0.9, return_entropy=True, **kwargs)
    assert torch.allclose(lp, ref, atol=1e-6) and torch.allclose(ent, ref_ent, atol=1e-6)
    plain, _ = naive_logprobs(hidden, weight, targets, bias=bias, temperature=0.9)
    assert (plain - ref).abs().max() > 0.05
    top = fused_gather_logprobs(hidden, weight, targets.unsqueeze(1), bias=bias, temperature=0.9, chunk_size=8,
                                **kwargs)
    assert torch.equal(top.squeeze(1), lp)


@pytest.mark.parametrize("kwargs, match", [(dict(logit_softcap=0.0), "logit_softcap"),
                                           (dict(logit_softcap=float("inf")), "logit_softcap"),
                                           (dict(logit_scale=-1.0), "logit_scale")])
def test_bad_transform_is_refused(kwargs, match):
    hidden, weight, bias, targets = _inputs(dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        fused_logprobs(hidden, weight, targets, **kwargs)
