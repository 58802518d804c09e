"""torchrun worker of bench/gpu/gpu_rows_distributed.py (issue 44 item 1): the loop's collectives on the process group a
launch on GPUs really gets.

``Accelerator(**accelerator_kwargs())`` makes the group as training does (with ``ACCELERATE_USE_DEEPSPEED=true``
DeepSpeed's ``init_distributed`` makes it). Then, with 2 ranks or more: every collective of ``DataParallel`` with the
loop's CPU tensors -- ``collectives`` of the CPU test's worker (tests/trainer/distributed/dp_device_rule_worker.py,
the same calls and so the same expected values), a CUDA gradient through ``all_reduce_grads`` (NCCL), a bare NCCL
group refusing a CPU tensor and refused by ``check_serves_cpu``. With 1 rank (one GPU): ``DataParallel`` is the
identity there, so the group itself is exercised: all_reduce of a CPU and a CUDA tensor, all_gather_object, barrier.

argv: OUT_DIR. Each rank writes OUT_DIR/rank_<r>.json.
"""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "trainer" / "distributed")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from dp_device_rule_worker import attempt, collectives  # noqa: E402 - the CPU test's calls
from worker_exit import finish  # noqa: E402

from trainer.distributed.data_parallel import DataParallel  # noqa: E402
from trainer.distributed.deepspeed import accelerator_kwargs  # noqa: E402
from trainer.distributed.process_group import check_serves_cpu  # noqa: E402


def one_rank(out: dict, device: torch.device) -> None:
    def all_reduce(t: torch.Tensor) -> list:
        dist.all_reduce(t)
        return t.tolist()

    def all_gather_object() -> list:
        got = [None]
        dist.all_gather_object(got, {"rank": 0})
        return got

    attempt(out, "all_reduce_cpu", lambda: all_reduce(torch.ones(2)))
    attempt(out, "all_reduce_cuda", lambda: all_reduce(torch.ones(2, device=device)))
    attempt(out, "all_gather_object", all_gather_object)
    attempt(out, "barrier", lambda: dist.barrier() or "ok")


def main(out_dir: Path) -> None:
    acc = Accelerator(**accelerator_kwargs())
    result: dict = {"initialized": dist.is_initialized(), "device": str(acc.device),
                    "distributed_type": str(acc.state.distributed_type)}
    if not dist.is_initialized():
        (out_dir / "rank_0.json").write_text(json.dumps(result))
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    result.update(rank=rank, world=world, backend_config=str(dist.get_backend_config()))
    attempt(result, "current", lambda: DataParallel.current().world)
    dp = DataParallel(rank=rank, world=world)
    if world > 1:
        result["collectives"] = collectives(dp)
        param = torch.nn.Parameter(torch.zeros(2, device=acc.device))
        param.grad = torch.full((2,), float(rank + 1), device=acc.device)
        attempt(result, "cuda_grads", lambda: (dp.all_reduce_grads([param]), param.grad.tolist())[1])
        groups: dict = {}
        attempt(result, "nccl_group", lambda: groups.setdefault("bare", dist.new_group(backend="nccl")) and "ok")
        if "bare" in groups:
            bare = groups["bare"]
            attempt(result, "cpu_tensor_on_nccl", lambda: (dist.all_reduce(torch.ones(1), group=bare), "ok")[1])
            attempt(result, "check_nccl", lambda: check_serves_cpu(bare) or "ok")
    else:
        one_rank(result, acc.device)
    attempt(result, "wait_for_everyone", lambda: acc.wait_for_everyone() or "ok")
    (out_dir / f"rank_{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    finish()
