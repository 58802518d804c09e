"""Worker for tests/trainer/distributed/test_data_parallel.py (torchrun, 2 ranks): the loop's collectives under the
device rule of the process group a launch on GPUs gets, on CPU.

The backend is the one accelerate would pass to ``init_process_group`` for this rank on a CUDA host:
``trainer.distributed.deepspeed.accelerator_kwargs()`` read through accelerate's own ``_prepare_backend``, both with
``torch.cuda.is_available`` reporting True. The group is then made with gloo standing in for NCCL on the device
types NCCL serves -- "nccl" is ``cuda:nccl`` to torch's ``BackendConfig``, so it becomes ``cuda:gloo`` -- and torch
itself refuses a CPU tensor on it exactly as it would on NCCL ("No backend type associated with device type cpu").
Every collective of ``DataParallel`` (and the stops built on it) then runs with the loop's CPU tensors.

Each rank writes its outcome as JSON to argv[1]/rank_N.json.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from torch.distributed.distributed_c10d import BackendConfig

from trainer.distributed.data_parallel import DataParallel
from trainer.distributed.deepspeed import accelerator_kwargs
from trainer.distributed.process_group import check_serves_cpu


def backend_on_a_cuda_host() -> str:
    real = torch.cuda.is_available
    torch.cuda.is_available = lambda: True
    try:
        kwargs = accelerator_kwargs()
        asked = {k: v for h in kwargs.get("kwargs_handlers", []) for k, v in h.to_kwargs().items()}.get("backend")
        # accelerate's choice of backend (it does not read self); a given backend is kept when CUDA is there
        backend, kind = PartialState._prepare_backend(None, cpu=bool(kwargs.get("cpu")), backend=asked)
    finally:
        torch.cuda.is_available = real
    assert kind == DistributedType.MULTI_GPU, kind
    return backend


def stand_in(backend: str) -> str:
    """``backend`` with gloo in NCCL's place, device type by device type."""
    pairs = [p.split(":") for p in str(BackendConfig(backend)).split(",")]
    return ",".join(f"{dev}:{'gloo' if b == 'nccl' else b}" for dev, b in pairs)


def attempt(results: dict, name: str, fn) -> None:
    try:
        results[name] = fn()
    except Exception as e:  # noqa: BLE001 - the outcome is the result
        results[name] = f"{type(e).__name__}: {e}"


def collectives(dp: DataParallel) -> dict:
    from trainer.lifecycle.stops import RewardFailed, stop_together

    out: dict = {}
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]) if dp.rank == 0 else torch.tensor([[1, 1, 1], [0, 0, 0]])
    attempt(out, "global_normalizer", lambda: (lambda n: [n.num_tokens, n.num_seqs])(dp.global_normalizer(mask, 3)))
    attempt(out, "sum_metrics", lambda: dp.sum_metrics({"a": float(dp.rank + 1)}))
    attempt(out, "mean_metrics", lambda: dp.mean_metrics({"a": float(dp.rank + 1)}))
    attempt(out, "max_metrics", lambda: dp.max_metrics({"a": float(dp.rank + 1)}))
    attempt(out, "all_sum", lambda: dp.all_sum(torch.tensor([1.0, float(dp.rank)])).tolist())
    lp = torch.full((2, 3), -1.0)
    attempt(out, "pooled_parity", lambda: dp.pooled_parity(lp, lp - 0.1 * (dp.rank + 1), mask)["parity/mae"])
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.full((2,), float(dp.rank + 1))
    attempt(out, "all_reduce_grads", lambda: (dp.all_reduce_grads([param]), param.grad.tolist())[1])
    attempt(out, "raise_together", lambda: dp.raise_together(None) or "ok")
    attempt(out, "broadcast_object", lambda: dp.broadcast_object({"tag": "abc"} if dp.rank == 0 else None))
    attempt(out, "gather_objects", lambda: dp.gather_objects(dp.rank))
    attempt(out, "barrier", lambda: dp.barrier() or "ok")
    attempt(out, "stop_together", lambda: stop_together(dp, RewardFailed("rank 1's reward") if dp.rank else None))
    return out


def main() -> None:
    backend = backend_on_a_cuda_host()
    dist.init_process_group(stand_in(backend))
    result = {"backend": backend, "stand_in": stand_in(backend)}
    # A group without a CPU backend ("nccl" as somebody else made it), beside the launch's own.
    nccl_like = dist.new_group(backend=stand_in("nccl"))
    attempt(result, "cpu_tensor_on_nccl_like", lambda: (dist.all_reduce(torch.ones(1), group=nccl_like), "ok")[1])
    attempt(result, "check_nccl_like", lambda: check_serves_cpu(nccl_like) or "ok")
    attempt(result, "current", lambda: DataParallel.current().world)
    result["collectives"] = collectives(DataParallel(rank=dist.get_rank(), world=dist.get_world_size()))
    (Path(sys.argv[1]) / f"rank_{dist.get_rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from worker_exit import finish  # this script's folder is on sys.path

    main()
    finish()
