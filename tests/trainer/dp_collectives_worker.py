"""Worker for tests/trainer/test_data_parallel.py (torchrun, 2 ranks): broadcast_object and raise_together.

Each rank writes its outcome to its own file (argv[1]/rank_N.txt): two ranks printing to one pipe can
interleave their lines (seen in CI: "RANK 1 ...RANK 0 ..." on one line).
"""
import sys
from pathlib import Path

import torch

from trainer.data_parallel import DataParallel


def main() -> None:
    torch.distributed.init_process_group("gloo")
    dp = DataParallel.current()
    assert dp.world == 2, dp
    tag = dp.broadcast_object("abc" if dp.rank == 0 else None)
    dp.raise_together(None)  # nobody failed: no exception anywhere
    error = ValueError("bad reward on rank 1") if dp.rank == 1 else None
    try:
        dp.raise_together(error)
        outcome = "no exception"
    except ValueError as e:
        outcome = f"own=ValueError: {e}"
    except RuntimeError as e:
        outcome = f"others=RuntimeError: {str(e).split(' (')[0]}"
    (Path(sys.argv[1]) / f"rank_{dp.rank}.txt").write_text(f"RANK {dp.rank} tag={tag} {outcome}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
