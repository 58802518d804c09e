"""parity.logprobs_triton's kernels under Triton's interpreter, against float64 and the torch path.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` kernel is defined, i.e. when
``parity.logprobs_triton`` is first imported (triton 3.9: ``triton.knobs.runtime.interpret``
is consulted by ``triton.jit``'s decorator). In a normal test session ``parity`` has long
been imported by then, so this module skips itself there; ``test_logprobs_triton.py`` runs
it in a fresh ``pytest`` subprocess with ``TRITON_INTERPRET=1`` (or run it by hand:
``TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/parity/test_logprobs_triton_interpret.py``).

The interpreter mishandles bfloat16 pointers, so float32 and float16 are tested here;
shapes are small and ragged against the interpreter's 16 x 16 x 16 tiles
(``INTERPRETER_TILES``): N = 37, H = 40, V = 70 leave partial tiles in every direction.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import parity.logprobs.fused as fused  # noqa: E402  (where fused_logprobs looks its backend up)
import parity.logprobs.self_check as self_check  # noqa: E402
import parity.logprobs_triton as lt  # noqa: E402
from parity.logprobs import IGNORE_INDEX, fused_gather_logprobs, fused_logprobs, naive_logprobs  # noqa: E402

pytestmark = pytest.mark.skipif(
    not isinstance(lt._forward_kernel, InterpretedFunction),
    reason="kernels were defined without TRITON_INTERPRET=1; test_logprobs_triton.py runs this module in a subprocess",
)

N, H, V = 37, 40, 70


def _inputs(dtype=torch.float32, seed=0, bias=True, n=N):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.3
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.3 if bias else None
    targets = torch.randint(0, V, (n,), generator=g)
    # Round once to the tested dtype so that the float64 reference sees the same numbers.
    hidden, weight = hidden.to(dtype).double(), weight.to(dtype).double()
    b = b.to(dtype).double() if b is not None else None
    return hidden, weight, b, targets


def _leaves(dtype, *xs):
    return [x.detach().to(dtype).clone().requires_grad_() if x is not None else None for x in xs]


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


TRANSFORMS = [
    dict(temperature=1.0),
    dict(temperature=0.7, logit_scale=1.3),
    dict(temperature=1.0, logit_softcap=2.5),
    dict(temperature=1.3, logit_softcap=2.5, logit_scale=0.8),
]


@pytest.mark.parametrize("xf, with_bias", zip(TRANSFORMS, [True, False, True, False]))
def test_values_entropy_and_full_backward_match_float64(xf, with_bias):
    hidden, weight, bias, targets = _inputs(bias=with_bias)
    g_lp, g_ent = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    h64, w64, b64 = _leaves(torch.float64, hidden, weight, bias)
    lp64, ent64 = naive_logprobs(h64, w64, targets, bias=b64, return_entropy=True, **xf)
    ((g_lp * lp64).sum() + (g_ent * ent64).sum()).backward()

    h, w, b = _leaves(torch.float32, hidden, weight, bias)
    # chunk_size=16: three backward chunks, so grad_weight is accumulated across chunks.
    lp, ent = lt.fused_logprobs_triton(h, w, targets, bias=b, return_entropy=True, chunk_size=16, **xf)
    assert lp.dtype == ent.dtype == torch.float32
    assert torch.allclose(lp.double(), lp64, atol=2e-5, rtol=0)
    assert torch.allclose(ent.double(), ent64, atol=2e-5, rtol=0)
    ((g_lp.float() * lp).sum() + (g_ent.float() * ent).sum()).backward()
    assert _rel(h.grad, h64.grad) < 1e-5
    assert _rel(w.grad, w64.grad) < 1e-5
    if with_bias:
        assert _rel(b.grad, b64.grad) < 1e-5


@pytest.mark.parametrize("xf", [TRANSFORMS[1], TRANSFORMS[2]])
def test_frozen_lm_head_backward_gives_hidden_only(xf):
    hidden, weight, bias, targets = _inputs(seed=1)
    g_lp = torch.randn(N, dtype=torch.float64)
    h64 = hidden.clone().requires_grad_()
    lp64, _ = naive_logprobs(h64, weight, targets, bias=bias, **xf)
    (g_lp * lp64).sum().backward()

    h = hidden.float().requires_grad_()
    w, b = weight.float(), bias.float()
    lp, ent = lt.fused_logprobs_triton(h, w, targets, bias=b, **xf)
    assert ent is None
    (g_lp.float() * lp).sum().backward()
    assert _rel(h.grad, h64.grad) < 1e-5
    assert w.grad is None


def test_detached_entropy_keeps_the_log_prob_backward(monkeypatch):
    # Logged entropy (entropy_grad=False) keeps the frozen path: G from the forward, no
    # recompute in the backward; the differentiable entropy takes the recompute path.
    hidden, weight, bias, targets = _inputs(seed=2)
    g_lp = torch.randn(N)
    _, ent64 = naive_logprobs(hidden, weight, targets, bias=bias, temperature=0.9, return_entropy=True)
    recomputes = []
    real = lt._backward_grads
    monkeypatch.setattr(lt, "_backward_grads", lambda *a: recomputes.append(1) or real(*a))
    runs = {}
    for name, kw in {"plain": dict(), "detached": dict(return_entropy=True, entropy_grad=False),
                     "grad": dict(return_entropy=True)}.items():
        h = hidden.float().requires_grad_()
        lp, ent = lt.fused_logprobs_triton(h, weight.float(), targets, bias=bias.float(), temperature=0.9,
                                           chunk_size=16, **kw)
        (g_lp * lp).sum().backward()
        runs[name] = (lp.detach(), ent, h.grad)
    assert len(recomputes) == 1  # only the differentiable-entropy run
    assert not runs["detached"][1].requires_grad
    assert runs["grad"][1].requires_grad
    assert torch.allclose(runs["detached"][1].double(), ent64, atol=2e-5)
    assert torch.allclose(runs["detached"][1], runs["grad"][1].detach(), atol=1e-5)
    assert torch.equal(runs["plain"][0], runs["detached"][0])
    assert torch.equal(runs["plain"][2], runs["detached"][2])
    assert torch.allclose(runs["plain"][2], runs["grad"][2], atol=1e-5)


def test_float16_matches_torch_path_and_float64():
    hidden, weight, bias, targets = _inputs(dtype=torch.float16, seed=3)
    g_lp = torch.randn(N, dtype=torch.float64)
    h64, w64 = _leaves(torch.float64, hidden, weight)
    lp64, ent64 = naive_logprobs(h64, w64, targets, bias=bias, temperature=0.8, return_entropy=True)
    (g_lp * lp64).sum().backward()

    h, w = _leaves(torch.float16, hidden, weight)
    lp, ent = lt.fused_logprobs_triton(h, w, targets, bias=bias.half(), temperature=0.8, return_entropy=True)
    assert lp.dtype == torch.float32
    # Logits are rounded to float16 (|z| < 8: half an ulp <= 2^-8), as the torch path does.
    ref_lp, ref_ent = fused_logprobs(hidden.half(), weight.half(), targets, bias=bias.half(), temperature=0.8,
                                     return_entropy=True)
    assert torch.allclose(lp, ref_lp, atol=1e-5)
    assert torch.allclose(ent, ref_ent, atol=1e-5)
    assert torch.allclose(lp.double(), lp64, atol=1e-2)
    (g_lp.float() * lp).sum().backward()
    assert h.grad.dtype == w.grad.dtype == torch.float16
    assert _rel(h.grad, h64.grad) < 3e-3
    assert _rel(w.grad, w64.grad) < 3e-3


@pytest.mark.parametrize("splits, group_m", [(1, 1), (5, 1), (3, 2), (2, 3)])
def test_vocabulary_splits_and_row_groups_give_the_same_statistics(monkeypatch, splits, group_m):
    # N = 37 is 3 row blocks: group_m = 2 leaves a short last group, 3 covers all at once.
    hidden, weight, bias, targets = _inputs(seed=4)
    args = (hidden.float(), weight.float(), targets)
    kw = dict(bias=bias.float(), return_entropy=True, temperature=0.6)
    ref_lp, ref_ent = lt.fused_logprobs_triton(*args, **kw)  # default: 2 slices, groups of 2
    real = lt._device_plan

    def plan(n, vocab, hidden, tiles):
        span = triton.cdiv(triton.cdiv(vocab, tiles.block_v), splits) * tiles.block_v
        real_splits = triton.cdiv(vocab, span)
        return lt.LaunchPlan(real_splits, span, group_m, triton.cdiv(n, tiles.block_m) * real_splits)

    monkeypatch.setattr(lt, "_device_plan", plan)
    lp, ent = lt.fused_logprobs_triton(*args, **kw)
    assert torch.allclose(lp, ref_lp, atol=1e-6)
    assert torch.allclose(ent, ref_ent, atol=1e-6)
    monkeypatch.setattr(lt, "_device_plan", real)


def test_gather_matches_torch_path_and_target_values():
    hidden, weight, bias, targets = _inputs(seed=5)
    ids = torch.randint(0, V, (N, 5), generator=torch.Generator().manual_seed(6))
    ids[:, 0] = targets
    h, w, b = hidden.float(), weight.float(), bias.float()
    xf = dict(temperature=0.9, logit_softcap=3.0)
    got = lt.gather_logprobs_triton(h, w, ids, bias=b, **xf)
    ref = fused_gather_logprobs(hidden, weight, ids, bias=bias, **xf)  # float64 torch path
    assert got.dtype == torch.float32 and got.shape == ids.shape
    assert torch.allclose(got.double(), ref, atol=2e-5)
    lp, _ = lt.fused_logprobs_triton(h, w, targets, bias=b, **xf)
    # Another product makes the ids' logits (no per-id unroll): equal to the GEMM's summation order.
    assert torch.allclose(got[:, 0], lp, atol=1e-5, rtol=0)


def test_gather_compiles_one_kernel_whatever_k(monkeypatch):
    # A kernel specialised on k takes minutes to compile for sm_90 at k = 512 and does not finish at k = V
    # (the architecture probe gathers every vocabulary id): every k must launch the same specialisation.
    hidden, weight, bias, targets = _inputs(seed=9)
    real = lt._forward_kernel
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append(tuple(sorted((k, v) for k, v in kw.items())))
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(lt, "_forward_kernel", Recorder())
    h, w, b = hidden.float(), weight.float(), bias.float()
    ref = torch.log_softmax(hidden @ weight.T + bias, -1)
    for k in (1, 5, V // 2, V):
        ids = torch.randint(0, V, (N, k), generator=torch.Generator().manual_seed(k)) if k < V else \
            torch.arange(V).expand(N, V)
        got = lt.gather_logprobs_triton(h, w, ids, bias=b)
        assert torch.allclose(got.double(), ref.gather(1, ids), atol=2e-5)
    assert len(launches) == 4 and len(set(launches)) == 1
    assert not any(name not in ("HAS_BIAS", "HAS_CAP", "WANT_T", "HAS_TARGET", "BLOCK_M", "BLOCK_V", "BLOCK_K",
                                "PRECISION", "num_warps", "num_stages") for name, _ in launches[0])


def test_public_api_on_the_triton_backend_ignore_index_and_3d(monkeypatch):
    # fused_logprobs routes CPU tensors to torch; forcing the Triton backend checks the
    # wrapper's contract (ignored rows dropped and scattered back, [B, T] shapes) around it.
    monkeypatch.setattr(fused, "_backend_for", lambda h: lt.TritonLogProbs)
    hidden, weight, bias, targets = _inputs(seed=7, n=36)
    targets[[0, 5, 6, 35]] = IGNORE_INDEX
    h64, w64 = _leaves(torch.float64, hidden.reshape(4, 9, H), weight)
    lp64, ent64 = naive_logprobs(h64, w64, targets.reshape(4, 9), bias=bias, return_entropy=True)
    g = torch.randn(4, 9, dtype=torch.float64)
    (g * (lp64 + ent64)).sum().backward()

    h, w = _leaves(torch.float32, hidden.reshape(4, 9, H), weight)
    lp, ent = fused_logprobs(h, w, targets.reshape(4, 9), bias=bias.float(), return_entropy=True)
    assert lp.shape == ent.shape == (4, 9)
    ignored = targets.reshape(4, 9) == IGNORE_INDEX
    assert (lp[ignored] == 0).all() and (ent[ignored] == 0).all()
    assert torch.allclose(lp.double(), lp64, atol=2e-5) and torch.allclose(ent.double(), ent64, atol=2e-5)
    (g.float() * (lp + ent)).sum().backward()
    assert _rel(h.grad, h64.grad) < 1e-5 and _rel(w.grad, w64.grad) < 1e-5
    assert (h.grad[ignored] == 0).all()

    none, _ = fused_logprobs(h, w, torch.full((4, 9), IGNORE_INDEX))
    assert (none == 0).all()

    ids = torch.randint(0, V, (4, 9, 3), generator=torch.Generator().manual_seed(8))
    top = fused_gather_logprobs(hidden.float().reshape(4, 9, H), weight.float(), ids, bias=bias.float())
    ref = torch.log_softmax(hidden @ weight.T + bias, -1).gather(-1, ids.reshape(-1, 3)).reshape(4, 9, 3)
    assert top.dtype == torch.float32 and torch.allclose(top.double(), ref, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_self_check_passes_the_kernels(dtype):
    """``_triton_self_check`` (what lets the Triton path run on a GPU), at this module's ragged shape."""
    assert self_check._triton_self_check(torch.device("cpu"), dtype) is None


def test_the_self_check_names_a_broken_kernel(monkeypatch):
    def check():
        return self_check._triton_self_check(torch.device("cpu"), torch.float32, shape=(N, H, V, 16))

    real = lt.gather_logprobs_triton
    monkeypatch.setattr(lt, "gather_logprobs_triton", lambda *a, **k: real(*a, **k) - 0.5)
    assert check() == "the top-k gather differs from the torch path"
    monkeypatch.setattr(lt, "gather_logprobs_triton", real)
    real_stats = lt._forward_stats

    def wrong_entropy(*a, **k):
        lse, ent, zt = real_stats(*a, **k)
        return lse, (ent * 1.5 if ent is not None else None), zt

    monkeypatch.setattr(lt, "_forward_stats", wrong_entropy)
    assert check() == "entropy differs from the torch path (full)"
    monkeypatch.setattr(lt, "_forward_stats", real_stats)

    def no_compile(*a, **k):
        raise RuntimeError("PassManager::run failed\nmore")

    monkeypatch.setattr(lt.TritonLogProbs, "apply", no_compile)
    assert check() == "RuntimeError: PassManager::run failed more"


def test_weight_gradient_is_summed_in_float32_across_chunks():
    # float16 inputs, 64 backward chunks of 4 rows: summing the chunks' products in float16 gave 1.2e-3 relative
    # error against float64 here (4.8e-3 / 9.3e-3 emulated for bf16 at 16 / 64 chunks); a float32 sum rounded once
    # keeps the single-chunk figure (3.5e-4).
    g = torch.Generator().manual_seed(3)
    n, h_size, v = 256, 32, 48
    hidden = torch.randn(n, h_size, generator=g, dtype=torch.float64).half().double()
    weight = (torch.randn(v, h_size, generator=g, dtype=torch.float64) * 0.3).half().double()
    targets = torch.randint(0, v, (n,), generator=g)
    up = torch.randn(n, generator=g, dtype=torch.float64)
    w64 = weight.clone().requires_grad_()
    lp64, _ = naive_logprobs(hidden, w64, targets)
    (up * lp64).sum().backward()
    errors = {}
    for chunk in (n, 4):
        h, w = _leaves(torch.float16, hidden, weight)
        lp, _ = lt.fused_logprobs_triton(h, w, targets, chunk_size=chunk)
        (up.float() * lp).sum().backward()
        assert w.grad.dtype == torch.float16
        errors[chunk] = _rel(w.grad, w64.grad)
    assert errors[4] < 6e-4 and errors[4] < 1.3 * errors[n], errors


def test_bias_gradient_is_the_same_every_run():
    # The bias gradient is a column sum in torch, not atomics across programs: the same bits on every run.
    hidden, weight, bias, targets = _inputs(seed=10)
    grads = []
    for _ in range(2):
        h, w, b = _leaves(torch.float32, hidden, weight, bias)
        lp, ent = lt.fused_logprobs_triton(h, w, targets, bias=b, return_entropy=True, chunk_size=16)
        (lp.sum() + ent.sum()).backward()
        grads.append(b.grad)
    assert torch.equal(grads[0], grads[1])
