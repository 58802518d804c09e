"""The chunked torch implementation: forward and backward passes over the tiles, and their autograd Function.

It runs on every device (and is the reference the Triton kernels are tested against); on CUDA the Triton kernels
take over where ``dispatch._backend_for`` says so.
"""

from __future__ import annotations

import torch

from parity.logprobs.inputs import _compute_dtype
from parity.logprobs.oom_retry import _retry_halving
from parity.logprobs.sizing import _auto_chunk_rows, _backward_tile_shape, _memory_budget
from parity.logprobs.tiles import _accumulate, _backward_tile, _Buffers, _forward_tile, _to_input_dtype


def _forward_pass(hidden, weight, bias, targets, xf, want_entropy, precompute, rows, kept_sets=None):
    cd = _compute_dtype(hidden.dtype)
    n, (vocab, hsize) = hidden.shape[0], weight.shape
    rows = min(rows, n)
    buf = _Buffers(rows, vocab, hsize, hidden.dtype, cd, hidden.device,
                   exp=want_entropy, grad_h=precompute, grad_w=False, dcap=precompute and xf.cap is not None)
    bias_c = bias.to(cd) if bias is not None else None
    lp = torch.empty(n, dtype=cd, device=hidden.device)
    lse = torch.empty_like(lp)
    ent = torch.empty_like(lp) if want_entropy else None
    gh = torch.empty(n, hsize, dtype=cd, device=hidden.device) if precompute else None
    kept = torch.zeros_like(lp) if kept_sets is not None else None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        keep = kept_sets.tile(r0, r1, 0, vocab) if kept_sets is not None else None
        out = _forward_tile(hidden[r0:r1], weight, bias_c, targets[r0:r1], xf, want_entropy, precompute, buf, keep)
        lp[r0:r1], lse[r0:r1] = out[0], out[1]
        if want_entropy:
            ent[r0:r1] = out[2]
        if precompute:
            gh[r0:r1] = out[3]
        if keep is not None:
            kept[r0:r1] = out[1] - out[4]  # log of the full softmax's mass inside the set (<= 0)
    return lp, lse, ent, gh, kept


def _backward_pass(hidden, weight, bias, targets, lse, ent, g_lp, g_ent, xf, need, rows, vblock, kept_sets=None):
    need_h, need_w, need_b = need
    cd = lse.dtype
    n, (vocab, hsize) = hidden.shape[0], weight.shape
    rows, vb = min(rows, n), min(vblock, vocab)
    buf = _Buffers(rows, vb, hsize, hidden.dtype, cd, hidden.device,
                   exp=g_ent is not None, grad_h=need_h, grad_w=need_w and rows < n, dcap=xf.cap is not None)
    bias_c = bias.to(cd) if bias is not None else None
    # _backward_tile returns minus d/dlogits: gh and gb accumulate minus their gradient and
    # are negated once at the end; the weight gradient uses -hidden ([N, H], cheap) instead.
    gh = torch.empty(n, hsize, dtype=cd, device=hidden.device) if need_h else None
    neg_hidden = -hidden if need_w else None
    gw = torch.empty_like(weight) if need_w else None
    one_chunk = rows >= n  # then each weight-gradient block is one matmul: no float accumulator
    gw_acc = torch.empty(vb, hsize, dtype=cd, device=hidden.device) if need_w and not one_chunk else None
    gb = torch.zeros(vocab, dtype=cd, device=hidden.device) if need_b else None
    for v0 in range(0, vocab, vb):
        v1 = min(vocab, v0 + vb)
        w_blk = weight[v0:v1]
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            neg_grad = _backward_tile(
                hidden[r0:r1], w_blk, bias_c[v0:v1] if bias_c is not None else None, targets[r0:r1], v0,
                lse[r0:r1], ent[r0:r1] if ent is not None else None,
                g_lp[r0:r1] if g_lp is not None else None, g_ent[r0:r1] if g_ent is not None else None,
                xf, buf, kept_sets.tile(r0, r1, v0, v1) if kept_sets is not None else None,
            )
            if need_b:
                gb[v0:v1] += neg_grad.sum(0)
            grad_in = _to_input_dtype(neg_grad, buf)
            if need_h:
                part = torch.mm(grad_in, w_blk, out=buf.gh[: r1 - r0])
                _accumulate(gh[r0:r1], part, buf.stage, first=v0 == 0)
            if need_w and one_chunk:
                torch.mm(grad_in.T, neg_hidden, out=gw[v0:v1])
            elif need_w:
                part = torch.mm(grad_in.T, neg_hidden[r0:r1], out=buf.gw[: v1 - v0])
                _accumulate(gw_acc[: v1 - v0], part, buf.stage, first=r0 == 0)
        if need_w and not one_chunk:
            gw[v0:v1] = gw_acc[: v1 - v0]
    if need_h:
        gh.neg_()
    if need_b:
        gb.neg_()
    return gh, gw, gb



class _ChunkedLogProbs(torch.autograd.Function):
    """Inputs are flat: hidden [N, H], targets [N] all valid (the wrapper drops ignored rows).

    ``chunk``/``vblock`` of 0 mean "from the memory budget".
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, xf, want_entropy, entropy_grad, chunk, vblock, precompute,
                kept_sets=None):
        vocab, hsize = weight.shape
        rows = chunk or _auto_chunk_rows(vocab, _memory_budget(hidden.device))
        run = lambda r, _v: _forward_pass(hidden, weight, bias, targets, xf, want_entropy, precompute, r, kept_sets)
        lp, lse, ent, gh, kept = _retry_halving(run, min(rows, hidden.shape[0]), vocab, "forward", split_vocab=False)
        keep_ent = ent if entropy_grad else None  # a detached entropy plays no part in the backward
        ctx.save_for_backward(hidden, weight, bias, targets, lse, keep_ent, gh)
        ctx.xf, ctx.chunk, ctx.vblock, ctx.precompute = xf, chunk, vblock, precompute
        ctx.kept_sets = kept_sets
        ctx.set_materialize_grads(False)
        if ent is None:
            ent = torch.zeros(0, dtype=lp.dtype, device=lp.device)
        if keep_ent is None:
            ctx.mark_non_differentiable(ent)
        if kept_sets is None:
            return lp, ent
        ctx.mark_non_differentiable(kept)
        return lp, ent, kept

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_lp, g_ent, *_g_kept):
        hidden, weight, bias, targets, lse, ent, gh = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        none = (None,) * (8 if ctx.kept_sets is not None else 7)
        if ent is None or (g_ent is not None and g_ent.numel() == 0):
            g_ent = None
        g_lp = g_lp.to(lse.dtype) if g_lp is not None else None
        g_ent = g_ent.to(lse.dtype) if g_ent is not None else None
        if g_lp is None and g_ent is None:
            return (None, None, None) + none
        if ctx.precompute:
            # Only hidden needs a gradient and there is no entropy term: G * g_lp.
            grad_h = (gh * g_lp.unsqueeze(1)).to(hidden.dtype) if g_lp is not None else None
            return (grad_h, None, None) + none

        vocab, hsize = weight.shape
        rows, vblock = _backward_tile_shape(
            hidden.shape[0], vocab, hsize, ctx.chunk, ctx.vblock, _memory_budget(hidden.device)
        )
        run = lambda r, v: _backward_pass(
            hidden, weight, bias, targets, lse, ent, g_lp, g_ent, ctx.xf, need, r, v, ctx.kept_sets
        )
        gh, gw, gb = _retry_halving(run, rows, vblock, "backward", split_vocab=True)
        grad_h = gh.to(hidden.dtype) if gh is not None else None
        grad_b = gb.to(bias.dtype) if gb is not None else None
        return (grad_h, gw, grad_b) + none
