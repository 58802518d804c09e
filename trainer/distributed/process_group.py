"""The default process group of a launch on GPUs: NCCL for CUDA tensors, gloo for CPU tensors.

A group made with ``backend="nccl"`` (accelerate's default on CUDA, ``accelerate/state.py`` ``_prepare_backend``;
DeepSpeed's ``init_distributed`` with the accelerator's ``communication_backend_name``) maps only the ``cuda``
device type to a backend (torch ``distributed_c10d.py``: ``BackendConfig`` takes a bare "nccl" as
``Backend.backend_capability["nccl"] == ["cuda"]``), so a collective on a CPU tensor fails with "No backend type
associated with device type cpu". The loop reduces CPU tensors every step (token counts for the loss
normaliser, metrics, stop flags: ``trainer.distributed.data_parallel``), and its object collectives
(``gather_objects``, ``broadcast_object``) and barriers pick their device by the same map.

Two ways out, and why this one: **a ``cuda:nccl,cpu:gloo`` default group** rather than moving each CPU tensor to
the rank's GPU before the collective.

- Every CPU collective works wherever it is written (the loop's, accelerate's ``wait_for_everyone``, DeepSpeed's
  checkpoint barriers), not only the ones routed through one helper; moving tensors would leave each new call
  site to remember it.
- Object collectives then run on CPU: with several device:backend pairs torch uses "cpu" when it is among them
  (``distributed_c10d._get_object_coll_device``), and so does ``barrier`` unless the group was bound to a device
  at init (DeepSpeed binds ``cuda:LOCAL_RANK``, the rank's own); neither depends on which CUDA device is current,
  the thing a colocated vLLM engine changes (``rollout.device_placement``).
- Gradients stay on NCCL (CUDA tensors); the CPU reductions are a few numbers per step, where a host-device copy
  and stream sync each would cost more than gloo's round trip.
- gloo adds no new requirement on the network: vLLM already makes a gloo group beside each of its NCCL groups
  (``vllm/distributed/parallel_state.py``, ``GroupCoordinator``: ``new_group(ranks, backend="gloo")``), so a
  colocated run needs a working gloo path between the ranks anyway (several machines: ``GLOO_SOCKET_IFNAME``).

How the launchers take it: accelerate 1.15 passes ``InitProcessGroupKwargs(backend=...)`` on to
``init_process_group`` (``AcceleratorState``/``PartialState``: ``_prepare_backend`` keeps a given backend when CUDA
is available, and accelerate itself uses this very string for FSDP with CPU offload), and under DeepSpeed hands
it to ``deepspeed.comm.init_distributed(dist_backend=...)``, whose ``TorchBackend.init_process_group`` (deepspeed
0.19.8, ``comm/torch.py``) calls ``torch.distributed.init_process_group(backend, device_id=...)`` with it as is.
A group somebody else made without a CPU backend is refused by name (``check_serves_cpu``). One side effect:
accelerate's default collective timeout is 30 minutes for any backend but a bare "nccl", which gets 10
(``InitProcessGroupKwargs.__post_init__``); a hung rank is reported after 30.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

# The default group of a multi-process launch on CUDA.
CUDA_BACKEND = "cuda:nccl,cpu:gloo"


def launch_backend() -> Optional[str]:
    """The backend to ask accelerate for: ``CUDA_BACKEND`` for a launched rank (LOCAL_RANK set) on a CUDA host,
    else None (accelerate's own choice).

    Only under a launcher: with a backend given and no LOCAL_RANK, accelerate makes no process group but still reads
    its world size (``PartialState.__init__``: ``torch.distributed.get_world_size()`` whenever a backend is set),
    which fails in one process."""
    if torch.cuda.is_available() and int(os.environ.get("LOCAL_RANK", -1)) != -1:
        return CUDA_BACKEND
    return None


def served_device_types(group=None) -> set[str]:
    """The device types ``group`` (default: the default group) maps to a backend: {'cpu', 'cuda'} for gloo,
    {'cuda'} for nccl (``torch.distributed.get_backend_config``: "cpu:gloo,cuda:gloo", "cuda:nccl", ...)."""
    config = torch.distributed.get_backend_config(group)
    return {pair.split(":", 1)[0] for pair in config.split(",") if ":" in pair}


def check_serves_cpu(group=None) -> None:
    """Refuse a multi-process group (default: the default group) that has no backend for CPU tensors (see the
    module docstring)."""
    d = torch.distributed
    if not (d.is_available() and d.is_initialized() and d.get_world_size(group) > 1):
        return
    devices = served_device_types(group)
    if "cpu" not in devices:
        raise RuntimeError(
            f"the process group's backend is {str(d.get_backend(group))!r} (device types {sorted(devices)}): it "
            "has no backend for CPU tensors, and parityrl's data-parallel reductions (token counts, metrics, stop "
            "flags), object collectives and barriers run on CPU; expected a group made with backend "
            f"{CUDA_BACKEND!r} (what the trainer asks accelerate for: trainer.distributed.deepspeed."
            "accelerator_kwargs). Let the trainer create the process group, or create it with that backend")
