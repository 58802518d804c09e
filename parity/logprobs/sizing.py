"""Tile sizes of the torch path, from a memory budget (CPU: fixed; CUDA: from free memory)."""

from __future__ import annotations

from typing import Tuple

import torch

# Memory budget, in bytes of float32 tile. The forward holds one [chunk, V] float32 tile
# (chunk = budget / 4V: 512 rows at V = 32k, 128 at V = 128k) plus its input-dtype twin,
# ~1.5x the budget. The backward tile gets half the budget (see _backward_tile_shape) and
# a float32 weight-gradient accumulator, when one is needed, a quarter. Measured with
# bench/speed/bench_logprobs.py on the 2-core CPU: bf16 matmuls with >= 128 rows run at the
# full rate, and the peak extra memory stays near 1/10 of the naive version's at
# N = 4096, V = 32k (107-166 MiB vs 1033-1547 MiB).
DEFAULT_MEMORY_BUDGET_BYTES = 64 * 2**20

# The torch path's budget on CUDA: 640 MiB of float32 tile is ~1024 rows at V = 152k, the
# chunk at which that path's GEMMs ran at full rate on an H100 (issue 25: 54 ms values /
# 99 ms frozen with chunk_size=1024, against 105 / 196 ms with 96-row tiles from the CPU
# budget); an eighth of free memory caps it, leaving room for the tile's twins (~2.5x).
CUDA_MEMORY_BUDGET_BYTES = 640 * 2**20

# Out-of-memory retries halve the tile down to this many rows (or vocabulary entries)
# and then give up by re-raising: smaller tiles only waste time.
MIN_CHUNK_ROWS = 16


def _memory_budget(device: torch.device) -> int:
    """Bytes of float32 tile for the torch path on ``device`` (see the two budget constants)."""
    if device.type != "cuda":
        return DEFAULT_MEMORY_BUDGET_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return max(DEFAULT_MEMORY_BUDGET_BYTES, min(CUDA_MEMORY_BUDGET_BYTES, free // 8))


def _auto_chunk_rows(cols: int, budget_bytes: int) -> int:
    """Rows per tile so that one float32 [rows, cols] tile fits ``budget_bytes`` (multiple of 16)."""
    rows = budget_bytes // (4 * cols)
    return max(MIN_CHUNK_ROWS, rows - rows % MIN_CHUNK_ROWS)


def _auto_vocab_block(hidden_size: int, budget_bytes: int) -> int:
    """Vocabulary entries per backward tile: the float32 accumulator [block, H] gets budget / 4."""
    return max(1024, budget_bytes // 4 // (4 * hidden_size))


def _backward_tile_shape(
    n: int, vocab: int, hidden_size: int, chunk: int, vblock: int, budget: int = DEFAULT_MEMORY_BUDGET_BYTES
) -> Tuple[int, int]:
    """(rows, vocab_block) of the backward tiles; ``chunk``/``vblock`` of 0 mean automatic.

    Backward tiles are independent given lse, so the vocabulary is always blocked. The
    tile gets half the budget. When all N rows fit one tile with a vocabulary block of at
    least 1024, that is preferred: each weight-gradient block is then a single matmul
    written straight into the gradient, with no float32 accumulator and no cast.
    Otherwise the float32 accumulator [vocab_block, H] gets a quarter of the budget.
    """
    tile_budget = budget // 2
    if not chunk and not vblock:
        one_chunk_block = tile_budget // (4 * n)
        if one_chunk_block >= min(1024, vocab):
            return n, min(vocab, one_chunk_block)
    vblock = min(vocab, vblock or _auto_vocab_block(hidden_size, budget))
    rows = min(n, chunk or _auto_chunk_rows(vblock, tile_budget))
    return rows, vblock
