"""bench_logprobs' float64 reference: what the GPU accuracy columns are measured against."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "speed"))

import bench_logprobs as bl  # noqa: E402

from parity.logprobs import naive_logprobs  # noqa: E402


def test_reference_float64_matches_autograd_on_every_row_and_sampled_vocabulary_rows():
    g = torch.Generator().manual_seed(0)
    n, h, v = 70, 24, 90
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.4
    targets = torch.randint(0, v, (n,), generator=g)
    a = torch.randn(n, generator=g, dtype=torch.float64)
    sampled = torch.randperm(v, generator=g)[:17]
    hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, _ = naive_logprobs(hh, ww, targets)
    (a * lp).sum().backward()
    # Chunks of 16 rows: the chunked sums must add up to the whole.
    ref_lp, ref_gh, ref_gw = bl.reference_float64(hidden, weight, targets, a, sampled, chunk=16)
    assert torch.allclose(ref_lp, lp.detach(), atol=1e-12)
    assert torch.allclose(ref_gh, hh.grad, atol=1e-12)
    assert torch.allclose(ref_gw, ww.grad[sampled], atol=1e-12)
