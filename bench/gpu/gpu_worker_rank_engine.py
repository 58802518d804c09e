"""torchrun worker of bench/gpu/gpu_rows_distributed.py (issue 44 item 2): each rank's colocated engine on its own GPU.

Every rank makes the training process group (``Accelerator(**accelerator_kwargs())``, which makes GPU LOCAL_RANK
current), then with ``--engine``: a ``VLLMEngine`` on a small model at a 0.2 share, one generate, and where vLLM's
worker put it (``collective_rpc`` of ``rollout.device_placement``'s own reader), and the current device after it
(vLLM's ``GPUWorker.init_device`` sets its own). Both sides: the ranks' object gather and barrier, and the memory
torch's allocator holds on every GPU (a rank must hold none on another rank's GPU).

argv: OUT_DIR MODEL_DIR [--engine]. Each rank writes OUT_DIR/rank_<r>.json.
"""
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "trainer" / "distributed")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from worker_exit import finish  # noqa: E402

from rollout.device_placement import _worker_device  # noqa: E402
from rollout.types import SamplingSpec  # noqa: E402
from trainer.distributed.data_parallel import DataParallel  # noqa: E402
from trainer.distributed.deepspeed import accelerator_kwargs  # noqa: E402


def main(out_dir: Path, model_dir: str, engine: bool) -> None:
    Accelerator(**accelerator_kwargs())
    rank, local = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    result: dict = {"rank": rank, "local_rank": local, "current_before": torch.cuda.current_device()}
    dp = DataParallel.current()
    if engine:
        # late: vLLM's CUDA build is optional (the parent checked it is here)
        from rollout.vllm_engine import VLLMEngine

        eng = VLLMEngine(model_dir, dtype="bfloat16", max_model_len=128, gpu_memory_utilization=0.2,
                         kv_cache_memory_bytes=256 * 1024**2, enforce_eager=True)
        out = eng.generate([[5, 6, 7, 8]], SamplingSpec(n=2, max_new_tokens=8, seed=rank))
        result["generated"] = [len(c) for c in out.completion_ids]
        result["engine_device"] = eng.llm.collective_rpc(_worker_device)[0]
        result["current_after"] = torch.cuda.current_device()
    result["gathered"] = dp.gather_objects(rank)
    dp.barrier()
    result["reserved"] = [torch.cuda.memory_reserved(j) for j in range(torch.cuda.device_count())]
    (out_dir / f"rank_{rank}.json").write_text(json.dumps(result))
    if engine:
        eng.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], "--engine" in sys.argv[3:])
    finish()
