"""Where the corrected tokens sit: the share clipped and masked per bucket of position, engine probability, trainer
entropy and assistant turn -- the buckets of the parity breakdown (parity.metrics ``error_by_*``).

``bucket_counts`` gives additive per-bucket counts (sum them over data-parallel ranks), ``bucket_rows`` the table.
Buckets are [start, end), the last one closed; values outside the edges are not counted.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from parity.metrics import turn_index

PROB_EDGES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
ENTROPY_EDGES = (0.0, 0.01, 0.1, 0.5, 1.0, 2.0, 4.0, math.inf)


def position_edges(longest: int) -> list[float]:
    """[0, 1, 2, 4, ...] up to a completion of ``longest`` valid tokens (the parity breakdown's doubling buckets)."""
    return [0.0] + [float(2**i) for i in range(max(1, math.ceil(math.log2(max(longest, 1)))) + 1)]


def turn_edges(turns: int) -> list[float]:
    return [float(k) for k in range(1, max(turns, 1) + 2)]


def positions(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] float64: the number of valid tokens before each one in its row (0 = the completion's first)."""
    return (torch.cumsum(mask.long(), -1) - 1).double()


def turns(mask: torch.Tensor) -> torch.Tensor:
    return turn_index(mask).double()


def bucket_counts(values: torch.Tensor, mask: torch.Tensor, clipped: torch.Tensor, masked: torch.Tensor,
                  edges: Sequence[float]) -> torch.Tensor:
    """[buckets, 3] float64: (tokens, clipped, masked) of the valid tokens whose ``values`` fall in each bucket."""
    v = values.double()[mask]
    c, m = clipped[mask].double(), masked[mask].double()
    out = torch.zeros(len(edges) - 1, 3, dtype=torch.float64, device=values.device)
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        sel = (v >= lo) & ((v <= hi) if i == len(edges) - 2 else (v < hi))
        out[i] = torch.stack([sel.double().sum(), (c * sel).sum(), (m * sel).sum()])
    return out


def bucket_rows(counts: torch.Tensor, edges: Sequence[float], start_key: str, end_key: str) -> list[dict]:
    """Rows {start_key, end_key, num_tokens, frac_clipped, frac_masked} for the non-empty buckets of ``counts``."""
    rows = []
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        n, c, m = (float(x) for x in counts[i])
        if n > 0:
            rows.append({start_key: lo, end_key: hi, "num_tokens": int(n), "frac_clipped": c / n, "frac_masked": m / n})
    return rows
