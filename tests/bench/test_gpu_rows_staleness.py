"""bench/gpu/gpu_check.py names the off-policy row (issue 58: bench/gpu/gpu_rows_staleness.py) in ``--list`` and,
without CUDA, skips it saying what it needs (run in this process: neither builds nor starts anything)."""
import pytest
import torch
from gpu_check_loader import listed, load_gpu_check

ROW = ("58.1", "k = 3 off-policy with M2PO, stale-KV alarm live")


def test_list_names_the_staleness_row_with_its_item(capsys):
    assert listed(capsys, "--only", "58.1") == [ROW]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour (on a GPU the row trains for minutes)")
def test_the_row_says_it_needs_vllms_cuda_build_on_a_cpu():
    load_gpu_check()
    import gpu_rows_common
    import gpu_rows_staleness

    with pytest.raises(gpu_rows_common.Skip, match="CUDA"):
        gpu_rows_staleness.staleness_row(lambda: "unused")
