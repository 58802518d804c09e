"""bench/gpu/gpu_check.py names the off-policy row (issue 58: bench/gpu/gpu_rows_staleness.py) in ``--list`` and,
without CUDA, skips it saying what it needs (run in this process: neither builds nor starts anything)."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ROW = ("58.1", "k = 3 off-policy with M2PO, stale-KV alarm live")


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu" / "gpu_check.py")
    gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(gpu_check)  # puts bench/gpu/ on sys.path: its row modules import
    return gpu_check


def test_list_names_the_staleness_row_with_its_item(capsys):
    gpu_check = _gpu_check()
    capsys.readouterr()
    assert gpu_check.main(["--list", "--only", "58.1"]) == 0
    listed = [tuple(line.split(None, 1)) for line in capsys.readouterr().out.splitlines()
              if re.match(r"^(\d+\.\d+|-) +\S", line)]
    assert listed == [ROW]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour (on a GPU the row trains for minutes)")
def test_the_row_says_it_needs_vllms_cuda_build_on_a_cpu():
    _gpu_check()
    import gpu_rows_common
    import gpu_rows_staleness

    with pytest.raises(gpu_rows_common.Skip, match="CUDA"):
        gpu_rows_staleness.staleness_row(lambda: "unused")
