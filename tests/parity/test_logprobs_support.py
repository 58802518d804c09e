"""parity.fused_logprobs with a truncated sampler's kept sets: log-probs, entropy, kept mass and gradients over
exactly the sets, against a float64 masked log-softmax, across tiles, with the logit transform and padding."""
import math

import pytest
import torch

from parity.logprobs import IGNORE_INDEX, fused_logprobs


def _case(n=7, v=23, h=5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=dtype)
    weight = torch.randn(v, h, generator=g, dtype=dtype)
    bias = torch.randn(v, generator=g, dtype=dtype)
    sets, targets = [], []
    for _ in range(n):
        k = 1 + int(torch.randint(0, v - 1, (1,), generator=g))
        s = sorted(torch.randperm(v, generator=g)[:k].tolist())
        sets.append(s)
        targets.append(s[int(torch.randint(0, len(s), (1,), generator=g))])
    return hidden, weight, bias, torch.tensor(targets), sets


def _csr(sets):
    offsets = torch.tensor([0] + [len(s) for s in sets]).cumsum(0)
    return offsets, torch.tensor([t for s in sets for t in s], dtype=torch.int32)


def _reference(hidden, weight, bias, targets, sets, temperature=1.0, cap=None, scale=1.0):
    z = hidden @ weight.T + bias
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    z = z * scale / temperature
    keep = torch.zeros_like(z, dtype=torch.bool)
    for i, s in enumerate(sets):
        keep[i, s] = True
    zs = z.masked_fill(~keep, -math.inf)
    logp = torch.log_softmax(zs, dim=-1)
    lp = logp.gather(1, targets[:, None])[:, 0]
    p = logp.exp()
    ent = -(p * logp.masked_fill(~keep, 0.0)).sum(-1)
    kept = torch.logsumexp(zs, -1) - torch.logsumexp(z, -1)
    return lp, ent, kept


@pytest.mark.parametrize("cap,scale,temperature", [(None, 1.0, 1.0), (3.0, 1.0, 0.7), (None, 0.5, 1.3)])
def test_values_are_the_masked_softmax_s_across_tiles(cap, scale, temperature):
    hidden, weight, bias, targets, sets = _case()
    lp, ent, kept = fused_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, return_entropy=True,
                                   chunk_size=3, vocab_chunk_size=5, logit_softcap=cap, logit_scale=scale,
                                   support=_csr(sets), return_kept_logmass=True)
    want = _reference(hidden, weight, bias, targets, sets, temperature, cap, scale)
    for got, exp in zip((lp, ent, kept), want):
        assert torch.allclose(got, exp, atol=1e-12), (got - exp).abs().max()
    assert bool((kept <= 1e-12).all()) and bool((lp <= 1e-12).all())


def test_a_singleton_set_gives_log_prob_zero_and_the_whole_vocabulary_the_untruncated_values():
    hidden, weight, bias, targets, _ = _case(n=4)
    single = [[int(t)] for t in targets]
    lp, ent, kept = fused_logprobs(hidden, weight, targets, bias=bias, return_entropy=True, support=_csr(single),
                                   return_kept_logmass=True)
    assert torch.allclose(lp, torch.zeros(4, dtype=lp.dtype)) and torch.allclose(ent, torch.zeros(4, dtype=lp.dtype))
    full = [list(range(weight.shape[0]))] * 4
    lp_f, ent_f, kept_f = fused_logprobs(hidden, weight, targets, bias=bias, return_entropy=True, support=_csr(full),
                                         return_kept_logmass=True)
    lp0, ent0 = fused_logprobs(hidden, weight, targets, bias=bias, return_entropy=True)
    assert torch.allclose(lp_f, lp0, atol=1e-12) and torch.allclose(ent_f, ent0, atol=1e-12)
    assert torch.allclose(kept_f, torch.zeros(4, dtype=lp.dtype), atol=1e-12)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_gradients_are_float64_exact(entropy_grad):
    hidden, weight, bias, targets, sets = _case(n=5, v=11, h=4, seed=3)
    support = _csr(sets)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    bias.requires_grad_(True)

    def f(h, w, b):
        lp, ent = fused_logprobs(h, w, targets, bias=b, return_entropy=True, entropy_grad=entropy_grad,
                                 chunk_size=2, vocab_chunk_size=4, logit_softcap=2.5, support=support)
        return lp.sum() + (0.3 * ent.sum() if entropy_grad else 0.0)

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_the_frozen_lm_head_shortcut_has_the_reference_gradient():
    hidden, weight, bias, targets, sets = _case(n=6, v=13, h=4, seed=5)
    h1 = hidden.clone().requires_grad_(True)
    g = torch.randn(6, dtype=hidden.dtype)
    (fused_logprobs(h1, weight, targets, bias=bias, support=_csr(sets))[0] * g).sum().backward()
    h2 = hidden.clone().requires_grad_(True)
    lp, _, _ = _reference(h2, weight, bias, targets, sets)
    (lp * g).sum().backward()
    assert torch.allclose(h1.grad, h2.grad, atol=1e-12)


def test_ignored_positions_need_no_set_and_cost_nothing():
    hidden, weight, bias, targets, sets = _case(n=6)
    targets = targets.clone()
    targets[[1, 4]] = IGNORE_INDEX
    sets = [s if i not in (1, 4) else [] for i, s in enumerate(sets)]
    lp, _, kept = fused_logprobs(hidden.reshape(2, 3, -1), weight, targets.reshape(2, 3), bias=bias,
                                 support=_csr(sets), return_kept_logmass=True)
    assert lp.shape == (2, 3) and float(lp.reshape(-1)[1]) == 0.0 and float(kept.reshape(-1)[4]) == 0.0
    keep = [i for i in range(6) if i not in (1, 4)]
    want = _reference(hidden[keep], weight, bias, targets[keep], [sets[i] for i in keep])
    assert torch.allclose(lp.reshape(-1)[keep], want[0], atol=1e-12)


def test_a_target_outside_its_set_and_malformed_sets_are_refused():
    hidden, weight, bias, targets, sets = _case(n=3)
    bad = [s if i else [t for t in range(weight.shape[0]) if t != int(targets[0])] for i, s in enumerate(sets)]
    with pytest.raises(ValueError, match="outside their kept set"):
        fused_logprobs(hidden, weight, targets, support=_csr(bad))
    offsets, ids = _csr(sets)
    with pytest.raises(ValueError, match=r"\[N \+ 1\]"):
        fused_logprobs(hidden, weight, targets, support=(offsets[:-1], ids))
    with pytest.raises(ValueError, match="outside"):
        fused_logprobs(hidden, weight, targets, support=(offsets, ids + 1000))
