"""bench/gpu_check.py on a machine without CUDA: runs what the CPU can, says what needs a GPU, exits 0."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour (on a GPU the check trains for minutes)")
def test_gpu_check_on_cpu_prints_one_table_and_skips_the_gpu_rows():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py")], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("check ") for line in lines) == 1  # one table
    rows = {line.split("  ")[0].strip(): line for line in lines if "  " in line}
    assert "pass" in rows["device"] and "no CUDA device" in rows["device"]
    assert "pass" in rows["version torch"] and torch.__version__ in rows["version torch"]
    assert " pass " in rows["log-prob kernel accuracy"]
    for gpu_row in ("log-prob kernel speed", "FP8 GEMM verify", "FP8 GEMM speed", "GRPO steps, HF engine",
                    "gradient checkpointing memory", "colocated vLLM, precision bf16"):
        assert " skipped " in rows[gpu_row] and "needs a CUDA GPU" in rows[gpu_row], rows[gpu_row]
    assert "0 fail" in proc.stdout and "GiB" not in proc.stdout  # no GPU figure on a CPU
