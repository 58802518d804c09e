"""bench/gpu/gpu_check.py names the replay against TRL (issue 55 item 14: bench/gpu/gpu_rows_replay.py) in ``--list``
and, without CUDA, skips it saying what it needs (run in this process: neither builds nor starts anything)."""
import pytest
import torch
from gpu_check_loader import listed, load_gpu_check

ROW = ("55.14", "parityrl's batches through TRL: same updates")


def test_list_names_the_replay_row_with_its_item(capsys):
    assert listed(capsys, "--only", "55.14") == [ROW]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour (on a GPU the row trains for minutes)")
def test_the_row_says_it_needs_vllms_cuda_build_on_a_cpu():
    load_gpu_check()
    import gpu_rows_common
    import gpu_rows_replay

    with pytest.raises(gpu_rows_common.Skip, match="CUDA"):
        gpu_rows_replay.replay_row()
