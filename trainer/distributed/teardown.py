"""Leaving the process group at the end of a multi-process launch."""
from __future__ import annotations

import os

import torch


def leave_process_group() -> None:
    """Every rank waits for the others (rank 0's last save, the last collective), then leaves the process group.

    A rank that exits while gloo's threads still run aborts with SIGABRT ("terminate called without an active
    exception"): seen in CI on 2 CPU ranks after `parityrl sft` and after bench/checks/zero_cpu_check.py had written
    their results, so the launch failed although the work was done. Call it on success only: after a failure the
    other ranks may never reach the barrier. Only under a multi-process launch (WORLD_SIZE > 1): in one process the
    default group may be a colocated vLLM engine's (a test session's shared engine), which must outlive the stage.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
