"""Out of memory in a pass: halve the tile and redo the pass, down to ``MIN_CHUNK_ROWS``."""

from __future__ import annotations

import warnings

import torch

from parity.logprobs.sizing import MIN_CHUNK_ROWS


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, torch.OutOfMemoryError):
        return True
    msg = str(err).lower()
    # The CPU allocator says "can't allocate memory", CUDA/XPU say "out of memory".
    return isinstance(err, RuntimeError) and ("out of memory" in msg or "can't allocate memory" in msg)


def _retry_halving(run, rows: int, vblock: int, what: str, split_vocab: bool):
    """Call ``run(rows, vblock)``; on OOM halve the tile (rows first, then the vocab block) and retry.

    Each retry redoes the whole pass from fresh accumulators, so a failure part-way
    through can never leave a partially accumulated result behind.
    """
    while True:
        try:
            return run(rows, vblock)
        except RuntimeError as err:
            if not _is_oom(err):
                raise
            if rows // 2 >= MIN_CHUNK_ROWS:
                new_rows, new_vblock = rows // 2, vblock
            elif split_vocab and vblock // 2 >= MIN_CHUNK_ROWS:
                new_rows, new_vblock = rows, vblock // 2
            else:
                raise
            tile = lambda r, v: f"{r} x {v if split_vocab else 'V'}"
            warnings.warn(
                f"fused_logprobs {what}: out of memory with a {tile(rows, vblock)} tile; retrying with "
                f"{tile(new_rows, new_vblock)} ({err.__class__.__name__}: {str(err)[:120]})",
                RuntimeWarning,
                stacklevel=3,
            )
            rows, vblock = new_rows, new_vblock
