"""The Triton kernels' check against the torch path, run once per device and dtype before they are used."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from parity.logprobs.inputs import _transform
from parity.logprobs.oom_retry import _is_oom
from parity.logprobs.optional_triton import logprobs_triton
from parity.logprobs.reference import naive_logprobs
from parity.logprobs.torch_path import _ChunkedLogProbs


class _CheckOutOfMemory(Exception):
    """The self-check could not run for lack of memory (a transient state, not a property of the kernels)."""



def self_check_shape(device, dtype: torch.dtype) -> Tuple[int, int, int, int]:
    """(tokens, hidden, vocabulary, rows per backward chunk) of ``_triton_self_check``'s problem on ``device``: three
    row blocks, several K steps and backward chunks, at least two vocabulary tiles per program of the values kernel
    under the device's own launch plan, each dimension ragged against its tile."""
    tiles = logprobs_triton.tiles_for(torch.device(device), dtype)
    n, h = 2 * tiles.block_m + 37, 3 * tiles.block_k + 5
    sms = l2 = None
    if torch.device(device).type == "cuda":
        props = torch.cuda.get_device_properties(device)
        sms, l2 = props.multi_processor_count, getattr(props, "L2_cache_size", 50 * 2**20)
    wide = logprobs_triton.launch_plan(n, 2**30, h, torch.tensor([], dtype=dtype).element_size(), tiles,
                                       sms=sms, l2_bytes=l2 or 0)
    return n, h, wide.splits * 2 * tiles.block_v + 37, tiles.block_m


def _triton_self_check(device, dtype: torch.dtype, shape: Optional[Tuple[int, int, int, int]] = None) -> Optional[str]:
    """None if ``parity.logprobs_triton`` agrees with the torch path on ``device``, else why not; raises
    ``_CheckOutOfMemory`` when the device had no room to run it.

    Two runs on ``self_check_shape``'s problem: (1) temperature and a frozen bias, each backward path (frozen
    lm_head, and the full one); (2) every option on: softcap, logit scale, a differentiable entropy in the loss, a
    trained bias. Compared: log-probs, entropy, the gradients to hidden, lm_head weight and bias, and the top-k gather;
    the lm_head gradient also against float64 on sampled vocabulary rows. Tolerances are far above rounding (float32
    1e-4, half precisions 3e-2, relative) and far below what a wrong kernel gives (O(1)): this finds a kernel that
    fails or is wrong, it does not grade accuracy."""
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with torch.inference_mode(False):
        return _compare_backends(device, dtype, tol, shape or self_check_shape(device, dtype))


_CHECK_RUNS = (
    # (name, frozen lm_head, softcap, logit scale, temperature, differentiable entropy, trained bias)
    ("frozen lm_head", True, None, 1.0, 0.7, False, False),
    ("full", False, None, 1.0, 0.7, False, False),
    ("every option", False, 5.0, 1.3, 0.8, True, True),
)


def _compare_backends(device, dtype: torch.dtype, tol: float, shape: Tuple[int, int, int, int]) -> Optional[str]:
    """``_triton_self_check``'s comparison (inputs made on the CPU generator, so every device sees the same)."""
    g = torch.Generator().manual_seed(0)
    n, h, v, chunk = shape
    hidden = (torch.randn(n, h, generator=g) * 0.5).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) * 0.2).to(device=device, dtype=dtype)
    bias = (torch.randn(v, generator=g) * 0.1).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    up_lp, up_ent = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    sampled = torch.randperm(v, generator=g)[:64].to(device)

    def run(fn, frozen, cap, scale, temp, ent_grad, bias_grad):
        hh = hidden.clone().requires_grad_(True)
        ww = weight.clone().requires_grad_(not frozen)
        bb = bias.clone().requires_grad_(bias_grad)
        with torch.enable_grad():  # the first call may come under no_grad (a scoring pass)
            lp, ent = fn.apply(hh, ww, bb, targets, _transform(temp, cap, scale), True, ent_grad, chunk, 0, frozen)
            loss = (lp * up_lp).sum() + ((ent * up_ent).sum() if ent_grad else 0)
            loss.backward()
        grads = [None if x.grad is None else x.grad.float() for x in (hh, ww, bb)]
        return [lp.float(), ent.float()] + grads

    def reference_weight_rows(cap, scale, temp, ent_grad, bias_grad):
        """float64 lm_head gradient on the sampled vocabulary rows (naive full logits of this small problem)."""
        h64, w64 = hidden.double(), weight.double().requires_grad_(True)
        b64 = bias.double().requires_grad_(bias_grad)
        with torch.enable_grad():
            lp, ent = naive_logprobs(h64, w64, targets, bias=b64, temperature=temp, return_entropy=True,
                                     logit_softcap=cap, logit_scale=scale)
            ((lp * up_lp.double()).sum() + ((ent * up_ent.double()).sum() if ent_grad else 0)).backward()
        return w64.grad[sampled]

    def far(a, b) -> bool:
        return bool(((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)) > tol)

    names = ("log-probs", "entropy", "gradient to hidden", "lm_head gradient", "bias gradient")
    try:
        for label, *opts in _CHECK_RUNS:
            got, ref = run(logprobs_triton.TritonLogProbs, *opts), run(_ChunkedLogProbs, *opts)
            for name, a, b in zip(names, got, ref):
                if b is not None and (a is None or not torch.isfinite(a).all() or far(a, b)):
                    return f"{name} differs from the torch path ({label})"
            if not opts[0] and far(got[3][sampled], reference_weight_rows(*opts[1:])):
                return f"lm_head gradient differs from float64 on sampled vocabulary rows ({label})"
        top = logprobs_triton.gather_logprobs_triton(hidden, weight, targets[:, None], bias=bias, temperature=0.7)
        frozen_ref = run(_ChunkedLogProbs, *_CHECK_RUNS[0][1:])[0]
        if far(top[:, 0].float(), frozen_ref):
            return "the top-k gather differs from the torch path"
    except Exception as e:  # noqa: BLE001 - a kernel that does not compile or launch here: say why, use torch
        if _is_oom(e):
            raise _CheckOutOfMemory(" ".join(str(e).split())[:200]) from e
        return f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
    return None


def triton_check_outcome(device: str, dtype: str) -> dict:
    """``_triton_self_check`` as the child process of ``self_check_process`` runs it: ``{"verdict": None | str}``,
    or ``{"oom": why}`` when the device had no room to run it."""
    try:
        return {"verdict": _triton_self_check(torch.device(device), getattr(torch, dtype))}
    except _CheckOutOfMemory as e:
        return {"oom": str(e)}
