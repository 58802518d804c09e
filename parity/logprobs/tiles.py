"""One tile of the torch path: the scaled logits of a row chunk against a vocabulary block, its forward
statistics and minus its gradient to the logits (module-level so tests can inject failures).

Every pass allocates its tile buffers once and reuses them: on a CPU a
fresh 64 MiB tensor costs more in page faults than the arithmetic done on it (measured on a 2-core CPU:
bf16 matmul into a new [256, 65536] tensor 113 ms, into a reused one 49 ms; exp 80 ms
vs 8 ms), which is also why the naive version pays more than its FLOPs suggest.
"""

from __future__ import annotations

import math

import torch


class _Buffers:
    """Reusable tile buffers of one pass; ``None`` fields are not needed by the pass.

    Tiles are stored flat so that a ragged last tile [r, v] is still a contiguous view.
    """

    def __init__(self, rows, cols, hidden_size, in_dtype, compute_dtype, device, *, exp, grad_h, grad_w, dcap):
        self.z = torch.empty(rows * cols, dtype=compute_dtype, device=device)
        # Input-dtype tile: the matmul's output, then the input-dtype copy of d/dlogits.
        same = in_dtype == compute_dtype
        self.zin = self.z if same else torch.empty(rows * cols, dtype=in_dtype, device=device)
        self.e = torch.empty(rows * cols, dtype=compute_dtype, device=device) if exp else None
        # d softcap(u) / du of the current tile, for passes that need a gradient under a softcap.
        self.dcap = torch.empty(rows * cols, dtype=compute_dtype, device=device) if dcap else None
        self.gh = torch.empty(rows, hidden_size, dtype=in_dtype, device=device) if grad_h else None
        self.gw = torch.empty(cols, hidden_size, dtype=in_dtype, device=device) if grad_w else None
        # Float staging for _accumulate: 1M elements (4 MiB) is past the point of diminishing returns.
        self.stage = torch.empty(min(2**20, max(rows, cols) * hidden_size), dtype=compute_dtype, device=device)

    @staticmethod
    def tile(flat: torch.Tensor, r: int, v: int) -> torch.Tensor:
        return flat[: r * v].view(r, v)


def _scaled_logits(h, w, bias_c, xf, buf):
    """(float [r, v] tile z = mult * softcap(h w^T + b), d softcap/du tile or None); the matmul stays in h's dtype.

    The derivative tile is only filled when ``buf`` has room for it (passes that need gradients).
    """
    r, v = h.shape[0], w.shape[0]
    z, zin = buf.tile(buf.z, r, v), buf.tile(buf.zin, r, v)
    torch.mm(h, w.T, out=zin)
    if buf.zin is not buf.z:
        z.copy_(zin)
    if bias_c is not None:
        z += bias_c
    dcap = None
    if xf.cap is not None:
        z.mul_(1.0 / xf.cap).tanh_()
        if buf.dcap is not None:
            dcap = buf.tile(buf.dcap, r, v)
            torch.mul(z, z, out=dcap).neg_().add_(1.0)  # 1 - tanh^2
        z.mul_(xf.cap)
    if xf.mult != 1.0:
        z *= xf.mult
    return z, dcap


def _to_input_dtype(x, buf):
    """Input-dtype version of the float tile ``x`` (a copy into the reused buffer if dtypes differ)."""
    if buf.zin is buf.z:  # float32/float64 inputs: x already is the input-dtype tile
        return x
    return buf.tile(buf.zin, *x.shape).copy_(x)


def _accumulate(acc, x, stage, first: bool):
    """acc (float) = x if first else acc + x, for a lower-precision x, without temporaries.

    A mixed-dtype ``acc += x`` makes torch allocate a float copy of x on every call (page
    faults on each; ~5x slower than the add itself), so x is cast into the reused flat
    float buffer ``stage`` one block at a time.
    """
    if first or acc.dtype == x.dtype:
        return acc.copy_(x) if first else acc.add_(x)
    step = max(1, stage.numel() // acc.shape[1])
    for s in range(0, acc.shape[0], step):
        e = min(acc.shape[0], s + step)
        acc[s:e] += stage[: (e - s) * acc.shape[1]].view(e - s, acc.shape[1]).copy_(x[s:e])
    return acc


def _forward_tile(h, weight, bias_c, t, xf, want_entropy, want_grad_h, buf, keep=None):
    """One row chunk against the full vocabulary.

    Returns (logprob [r], lse [r], entropy [r] or None, G [r, H] or None, lse over the whole vocabulary [r] or
    None) where G = ((onehot(t) - p) * dz/du) @ weight = d logprob / d hidden. ``keep`` [r, V]: the rows' kept
    sets; every normaliser (lse, p, entropy) is then over them, and the last output is the full one.
    """
    z, dcap = _scaled_logits(h, weight, bias_c, xf, buf)
    z_t = z.gather(1, t.unsqueeze(1)).squeeze(1)
    lse_full = None
    if keep is not None:
        lse_full = torch.logsumexp(z, dim=1)
        z.masked_fill_(~keep, -math.inf)
    m = z.amax(dim=1, keepdim=True)
    z -= m  # z' = z - max, so exp never overflows
    if want_entropy:
        e = torch.exp(z, out=buf.tile(buf.e, *z.shape))
        s = e.sum(dim=1)
        if keep is not None:
            z.masked_fill_(~keep, 0.0)  # e is 0 there; 0 * -inf would be NaN
        # entropy = lse - sum p z = log s - sum(e z') / s  (the max cancels)
        ent = torch.log(s) - torch.bmm(e.unsqueeze(1), z.unsqueeze(2)).reshape(-1) / s
    else:
        e = z.exp_()
        s = e.sum(dim=1)
        ent = None
    lse = m.squeeze(1) + torch.log(s)
    logprob = z_t - lse
    grad_h = None
    if want_grad_h:
        g = e.div_(s.unsqueeze(1)).neg_()  # -p
        g.scatter_add_(1, t.unsqueeze(1), torch.ones_like(z_t).unsqueeze(1))
        if dcap is not None:
            g *= dcap
        if xf.mult != 1.0:
            g *= xf.mult
        grad_h = torch.mm(_to_input_dtype(g, buf), weight, out=buf.gh[: h.shape[0]]).to(lse.dtype)
    return logprob, lse, ent, grad_h, lse_full


def _backward_tile(h, w_blk, b_blk_c, t, v0, lse, ent, g_lp, g_ent, xf, buf, keep=None):
    """Minus the gradient of sum(g_lp * logprob + g_ent * entropy) w.r.t. the tile's raw logits.

    Rows ``h`` [r, H] against vocabulary block ``w_blk`` [v, H] starting at ``v0``.
    Returns float [r, v] (a view of ``buf.z``):
        (p * (g_lp + g_ent * (log p + entropy)) - g_lp * onehot) * dz/du
    The sign is flipped because it saves a full pass over the tile; the caller negates
    the much smaller accumulated gradients once at the end. ``keep`` [r, v]: the rows' kept sets in this block
    (``lse`` and ``ent`` are then the truncated distribution's); p is 0 outside them.
    """
    logp, dcap = _scaled_logits(h, w_blk, b_blk_c, xf, buf)
    logp.sub_(lse.unsqueeze(1))
    if g_ent is not None:
        p = torch.exp(logp, out=buf.tile(buf.e, *logp.shape))
        coef = logp.add_(ent.unsqueeze(1)).mul_(g_ent.unsqueeze(1))
        if g_lp is not None:
            coef += g_lp.unsqueeze(1)
        neg_grad = coef.mul_(p)
    else:
        neg_grad = logp.exp_().mul_(g_lp.unsqueeze(1))
    if keep is not None:
        neg_grad.masked_fill_(~keep, 0.0)  # also what an overflow outside the set made inf or NaN
    if g_lp is not None:
        local = t - v0
        rows = ((local >= 0) & (local < w_blk.shape[0])).nonzero().squeeze(1)
        neg_grad.index_put_((rows, local[rows]), -g_lp[rows], accumulate=True)
    if dcap is not None:
        neg_grad *= dcap
    if xf.mult != 1.0:
        neg_grad *= xf.mult
    return neg_grad
