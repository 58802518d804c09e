"""``train.cpu_threads``: how many OpenMP threads this process computes with on a CPU.

torch and vLLM's CPU kernels share one OpenMP pool per process (the colocated engine runs in the trainer's
process and thread), sized to the machine's cores by default. A decode step of a small model is hundreds of
tiny parallel regions, each ending in a barrier where libgomp's threads spin, then sleep; when another
process holds one of the cores, every barrier waits for the descheduled thread's next time slice. On 2 cores
beside a busy neighbour the demo's rollout ran 15x slower with the default pool and 1.2x slower with one
thread, which was as fast as two when idle (bench/bench_shared_cpu.py, bench/RESULTS.md). A model whose
layers keep several cores busy wants the default (null).

It must be set before the engine starts: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op
once it has started (vllm/v1/worker/cpu_worker.py, ``init_device``).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

__all__ = ["apply_cpu_threads"]


def apply_cpu_threads(threads: Optional[int]) -> Optional[str]:
    """Size this process's CPU thread pool (None: leave torch's default); what was set, for the launch line.

    On a CUDA machine the pool runs only the host's side (data, rewards, the CPU copies), so it applies there too.
    """
    if threads is None:
        return None
    torch.set_num_threads(threads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{threads} CPU thread{'s' if threads != 1 else ''} of {cores} cores (train.cpu_threads)"
