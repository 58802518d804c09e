"""Worker for tests/trainer/io/test_run_lock_ranks.py (torchrun, 2 ranks): the run lock claimed as a launch claims it.

Rank 0 takes the lock (another process holds it: refused), rank 1 only checks; ``claim_together`` must raise
the refusal on both. Each rank writes its outcome to argv[2]/rank_N.txt, then goes on as the trainer would:
a refused rank ends (status 2), a rank that got through waits in the next collective (which would hang).
"""
import os
import sys
from pathlib import Path

import torch.distributed as dist

from trainer.distributed.data_parallel import DataParallel
from trainer.io.run_lock import claim
from trainer.lifecycle.stops import claim_together

dist.init_process_group("gloo")
dp = DataParallel.current()
out = Path(sys.argv[2]) / f"rank_{dp.rank}.txt"
try:
    claim_together(dp, lambda: claim(Path(sys.argv[1])))
except FileExistsError as e:
    out.write_text(f"{type(e).__name__}: {e}")
    sys.stdout.flush()
    os._exit(2)  # as `parityrl train` returns 2, without a word to the other rank
out.write_text("claimed")
dp.sum_metrics({"next collective": 1.0})
os._exit(0)
