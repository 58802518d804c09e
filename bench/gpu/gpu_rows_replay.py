"""The row of bench/gpu/gpu_check.py that replays a parityrl run through TRL's GRPOTrainer on CUDA (issue 55 item 14).

- ``replay_row``: ``bench/learning/bench_replay_vs_trl.py --seed 0 --steps 10 --trl-device cuda`` in a subprocess:
  parityrl trains ``recipes/grpo_tiny.yaml`` in float32 for 10 steps with its colocated vLLM engine on the GPU,
  recording every step's batch and LoRA weights, then TRL 1.16's ``GRPOTrainer.train`` is fed those batches on the
  GPU from the same starting weights (twice: once from them, once from them nudged by one float32 rounding).
  Expected (pass): the script's verdict "the same updates" — at every step the LoRA weights of the two trainers
  differ by at most 10x what one float32 rounding of the starting weights grows to (or 1e-5 of parityrl's
  movement), and each step's loss, gradient norm and learning rate are printed for both. On the CPU the same
  replay over 40 steps gave that verdict (bench/RESULTS.md, "A parityrl run replayed through TRL"); on CUDA it is
  the check that the trainer's CUDA kernels (fused AdamW on both sides, cuBLAS float32 matmuls) keep the two
  updates together, which is read from the sources, not run, until this row runs. Fail: the verdict names the
  step where the two part (the script's last line is the figure).
"""
from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

from gpu_rows_common import REPO, Skip, need_vllm_cuda, run_process, tail

REPLAY_ROW = ("parityrl's batches through TRL: same updates",)
STEPS = 10


def replay_row() -> str:
    need_vllm_cuda()
    if importlib.util.find_spec("trl") is None:
        raise Skip("needs TRL 1.16 (the dev extra, or pip install --no-deps 'trl==1.16.*')")
    with tempfile.TemporaryDirectory(prefix="gpu_check_replay_") as tmp:
        proc = run_process([sys.executable, str(REPO / "bench" / "learning" / "bench_replay_vs_trl.py"), "--seed",
                            "0", "--steps", str(STEPS), "--trl-device", "cuda", "--work", str(Path(tmp))],
                           cap_s=480, what="the replay against TRL")
    lines = [x for x in proc.stdout.splitlines() if x.startswith(("largest weight difference", "verdict:"))]
    if proc.returncode != 0 or len(lines) != 2:
        raise AssertionError(f"exit {proc.returncode}: {tail(proc)}")
    figure = f"{STEPS} steps: {lines[0]}"
    if not lines[1].startswith("verdict: the same updates"):
        raise AssertionError(f"{figure}; {lines[1]}")
    return figure
