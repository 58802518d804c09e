"""``train.cpu_threads``: how many OpenMP threads this process computes with on a CPU.

torch and vLLM's CPU kernels share one OpenMP pool per process (the colocated engine runs in the trainer's
process and thread), sized to the machine's cores by default. A decode step of a small model is hundreds of
tiny parallel regions, each ending in a barrier where libgomp's threads spin, then sleep; when another
process holds one of the cores, every barrier waits for the descheduled thread's next time slice. On 2 cores
beside a busy neighbour the demo's rollout ran 15x slower with the default pool and 1.2x slower with one
thread, which was as fast as two when idle (bench/speed/bench_shared_cpu.py, bench/RESULTS.md). A model whose
layers keep several cores busy wants the default (null).

It must be set before the engine starts: vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op
once it has started (vllm/v1/worker/cpu_worker.py, ``init_device``), to protect the cores it binds its threads
to. The engine in the trainer's process binds none (``VLLM_CPU_OMP_THREADS_BIND`` acts only in vLLM's
multiprocess executor), so ``train.update_cpu_threads`` may still resize the pool between the rollout and the
update through torch's own binding, and gives the rollout's size back before the next generate: the update's
parallel regions are matrix products large enough to use a second core, the decode's are not (the demo's update
took 1.2 s a step with one thread, 0.7 s with two, its rollout 0.8 s with either; 2 idle cores).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, Optional

import torch

__all__ = ["apply_cpu_threads", "update_threads"]

# torch's own binding: torch.set_num_threads is what vLLM's CPU worker replaces once the engine has started
_set_pool_size = torch._C.set_num_threads


def _threads(n: int) -> str:
    return f"{n} CPU thread{'s' if n != 1 else ''}"


def apply_cpu_threads(threads: Optional[int], update: Optional[int] = None) -> Optional[str]:
    """Size this process's CPU thread pool (None: leave torch's default); what was set, for the launch line, with
    ``update`` (``train.update_cpu_threads``, applied by ``update_threads``) when given.

    On a CUDA machine the pool runs only the host's side (data, rewards, the CPU copies), so it applies there too.
    """
    said = []
    if threads is not None:
        torch.set_num_threads(threads)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        said.append(f"{_threads(threads)} of {cores} cores (train.cpu_threads)")
    if update is not None:
        said.append(f"{_threads(update)} during the update (train.update_cpu_threads)")
    return ", ".join(said) or None


@contextmanager
def update_threads(threads: Optional[int]) -> Iterator[None]:
    """The pool at ``threads`` (``train.update_cpu_threads``) while the block runs, the rollout's size after it;
    None: the pool as it is."""
    if threads is None:
        yield
        return
    rollout = torch.get_num_threads()
    _set_pool_size(threads)
    try:
        yield
    finally:
        _set_pool_size(rollout)
