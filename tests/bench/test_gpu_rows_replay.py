"""bench/gpu/gpu_check.py names the replay against TRL (issue 55 item 14: bench/gpu/gpu_rows_replay.py) in ``--list``
and, without CUDA, skips it saying what it needs (run in this process: neither builds nor starts anything)."""
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ROW = ("55.14", "parityrl's batches through TRL: same updates")


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu" / "gpu_check.py")
    gpu_check = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(gpu_check)  # puts bench/gpu/ on sys.path: its row modules import
    return gpu_check


def test_list_names_the_replay_row_with_its_item(capsys):
    gpu_check = _gpu_check()
    capsys.readouterr()
    assert gpu_check.main(["--list", "--only", "55.14"]) == 0
    listed = [tuple(line.split(None, 1)) for line in capsys.readouterr().out.splitlines()
              if re.match(r"^(\d+\.\d+|-) +\S", line)]
    assert listed == [ROW]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour (on a GPU the row trains for minutes)")
def test_the_row_says_it_needs_vllms_cuda_build_on_a_cpu():
    _gpu_check()
    import gpu_rows_common
    import gpu_rows_replay

    with pytest.raises(gpu_rows_common.Skip, match="CUDA"):
        gpu_rows_replay.replay_row()
