"""bench/gpu/gpu_check.py names the off-policy rows (issue 58: bench/gpu/gpu_rows_staleness.py) in ``--list`` and,
without CUDA, skips them saying what they need (run in this process: neither builds nor starts anything)."""
import pytest
import torch
from gpu_check_loader import listed, load_gpu_check

ROW = ("58.1", "k = 3 off-policy with M2PO, stale-KV alarm live")
IN_FLIGHT_ROW = ("58.2", "k = 2 in flight (keep): NCCL push while paused")


def test_list_names_the_staleness_rows_with_their_items(capsys):
    assert listed(capsys, "--only", "58.1") == [ROW]
    assert listed(capsys, "--only", "58.2") == [IN_FLIGHT_ROW]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour (on a GPU the row trains for minutes)")
def test_the_row_says_it_needs_vllms_cuda_build_on_a_cpu():
    load_gpu_check()
    import gpu_rows_common
    import gpu_rows_staleness

    with pytest.raises(gpu_rows_common.Skip, match="CUDA"):
        gpu_rows_staleness.staleness_row(lambda: "unused")


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="the behaviour short of two GPUs")
def test_the_in_flight_row_says_it_needs_two_gpus_before_it_builds_a_model():
    load_gpu_check()
    import gpu_rows_common
    import gpu_rows_staleness

    def no_model():
        raise AssertionError("the row built a model before checking for its GPUs")

    with pytest.raises(gpu_rows_common.Skip, match="needs 2 CUDA GPUs"):
        gpu_rows_staleness.in_flight_row(no_model)


def test_lag_shares_reads_each_lag_present_in_the_batch():
    load_gpu_check()
    import gpu_rows_staleness

    row = {"staleness/lag_2/share": 0.75, "staleness/lag_1/share": 0.25, "staleness/lag_3/share": 0.0,
           "staleness/lag_2/mae": 0.01, "staleness/lag_mean": 1.75, "parity/mae": 1e-3}
    assert gpu_rows_staleness._lag_shares(row) == {1: 0.25, 2: 0.75}
