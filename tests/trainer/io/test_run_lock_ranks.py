"""Under a launch of 2 processes, a run lock refused on rank 0 ends every rank with the same error (instead of the
other ranks waiting for a collective that never comes). Two real processes (torchrun, gloo), no model."""
import os
import subprocess
import sys
from pathlib import Path

from trainer.io.run_lock import claim

REPO = Path(__file__).resolve().parents[3]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def test_a_refusal_on_rank_0_ends_every_rank_with_its_message(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    held = claim(run_dir)  # the other writer
    try:
        proc = subprocess.run([*TORCHRUN, str(Path(__file__).parent / "lock_refusal_worker.py"), str(run_dir),
                               str(out)], cwd=REPO, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        held.release()
    assert proc.returncode != 0, proc.stderr[-3000:]
    outcomes = [(out / f"rank_{r}.txt").read_text() for r in (0, 1)]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"RunDirInUse: {run_dir} is in use by pid {os.getpid()}")
