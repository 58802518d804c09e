"""Which GPU a colocated vLLM engine runs on: this rank's, not cuda:0.

vLLM's in-process executor (``UniProcExecutor``, its choice for one engine without tensor or pipeline parallelism)
takes the worker's local rank from ``device_config.device`` (``v1/executor/uniproc_executor.py``,
``_distributed_args``), whose index vLLM drops (``config/device.py``: ``torch.device(self.device_type)``). So it is
0, and ``GPUWorker.init_device`` (``v1/worker/gpu_worker.py``) puts the engine on ``cuda:0`` and makes that the
process's current device (``torch.accelerator.set_device_index``) in every rank: N ranks' engines on one GPU, and
each trainer's later ``"cuda"`` tensors and NCCL calls moved there with them.

``distributed_executor_backend="external_launcher"`` (``ExecutorWithExternalLauncher``, same file) takes the local
rank from ``LOCAL_RANK`` instead. What it needs, from vLLM 0.32.0's source:

- ``RANK`` and ``LOCAL_RANK`` in the environment, read as ``int(os.environ[...])`` (a KeyError without them);
  torchrun and ``accelerate launch`` set both. ``MASTER_ADDR``/``MASTER_PORT`` only if no process group exists.
- ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the executor asserts it; ``rollout.vllm_engine`` sets it before vLLM loads,
  and ``ParallelConfig.__post_init__`` sets it too for this backend).
- The process group: when torch.distributed is initialized vLLM creates none (``init_distributed_environment``
  calls ``init_process_group`` only when there is none) and takes all the trainer's ranks as its world; with tensor
  and pipeline parallelism 1 each rank is an "external data parallel" replica of its own (``initialize_model_parallel``:
  the layout is ExternalDP x DP x PP x PCP x TP), so the ranks generate independently, as the loop needs. The
  parallel config's own world size stays 1 (``tp x pp x pcp``; times ``data_parallel_size`` only when that is set).
- ``LOCAL_RANK`` below the number of GPUs the process sees (``GPUWorker.init_device`` asserts it): a launcher that
  hides all but one GPU per rank (``CUDA_VISIBLE_DEVICES``) with LOCAL_RANK > 0 fails there (accelerate's own
  ``set_device`` would already have failed); refused here by name instead.
- Every rank builds its engine at the same time: the executor takes the ranks' minimum of free KV-cache memory with
  an all_reduce over vLLM's world CPU group (``determine_available_memory``), as vLLM's group creation
  (``new_group``, collective over the default group) already required of the in-process executor.

verl, TRL (``vllm_mode="colocate"``) and torchforge colocate vLLM with their trainers the same way. Only on CUDA
and with several processes: on CPU the device is the host, and one process has nothing to choose.
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch

EXTERNAL_LAUNCHER = {"distributed_executor_backend": "external_launcher"}


class PlacementError(RuntimeError):
    """This process's GPU cannot be told, or is not where its engine went."""


def rank_gpu_index() -> int:
    """The GPU this process trains and generates on: ``LOCAL_RANK`` under a launcher (before any device is set:
    capacity checks run first), else the current device. Refused when that GPU is not visible."""
    count = torch.cuda.device_count()
    local = os.environ.get("LOCAL_RANK")
    index = int(local) if local not in (None, "") else torch.cuda.current_device()
    if not 0 <= index < count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        who = f"LOCAL_RANK = {local}" if local not in (None, "") else f"the current device, cuda:{index}"
        raise PlacementError(
            f"{who}: this process sees {count} GPU(s)"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            + f", so it has no GPU {index} of its own; each rank trains and runs its colocated engine on GPU "
            "LOCAL_RANK: expected at most one process per visible GPU on each machine (--nproc_per_node / "
            "--num_processes), every rank seeing all of its machine's GPUs")
    return index


def placement_options(cuda: bool) -> dict:
    """``vllm.LLM`` options that put this rank's engine on its own GPU: ``EXTERNAL_LAUNCHER`` when this process is
    one of several ranks of an initialized process group on CUDA, else none (see the module docstring)."""
    d = torch.distributed
    if not (cuda and d.is_available() and d.is_initialized() and d.get_world_size() > 1):
        return {}
    missing = [v for v in ("RANK", "LOCAL_RANK") if os.environ.get(v, "") == ""]
    if missing:
        raise PlacementError(
            f"{' and '.join(missing)} not set: rank {d.get_rank()} of {d.get_world_size()} runs a colocated vLLM "
            "engine, which vLLM's external launcher places on GPU LOCAL_RANK (it reads RANK and LOCAL_RANK from the "
            "environment); expected a launch by torchrun or accelerate launch, which set both")
    rank_gpu_index()
    return dict(EXTERNAL_LAUNCHER)


@contextlib.contextmanager
def keep_current_device(cuda: bool) -> Iterator[Optional[int]]:
    """Yield the current CUDA device's index (None on CPU) and make it current again afterwards: vLLM's worker
    sets the process's current device to its own (``GPUWorker.init_device``)."""
    if not cuda:
        yield None
        return
    index = torch.cuda.current_device()
    try:
        yield index
    finally:
        torch.cuda.set_device(index)


def _worker_device(worker) -> str:
    return str(worker.device)


def check_engine_device(llm, expected: int) -> None:
    """Refuse an engine whose worker is on another GPU than ``cuda:<expected>`` (this process's)."""
    where = llm.collective_rpc(_worker_device)[0]
    if torch.device(where) != torch.device("cuda", expected):
        raise PlacementError(
            f"the colocated vLLM engine started on {where}, this process trains on cuda:{expected}: each rank's "
            "engine must share its GPU (rollout.gpu_memory_utilization is a share of that GPU). vLLM's in-process "
            "engine takes GPU 0 of those visible unless launched as one of several ranks (LOCAL_RANK); choose a "
            "single process's GPU with CUDA_VISIBLE_DEVICES instead of torch.cuda.set_device")
