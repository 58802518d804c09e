"""Rows of bench/gpu/gpu_check.py on several processes (issue 44 items 1 and 2).

- ``dp_row(ranks, deepspeed)``: ``torchrun`` of bench/gpu/gpu_worker_dp.py. Pass (2 ranks): the group's backend config
  is cuda:nccl + cpu:gloo, ``DataParallel.current()`` accepts it, every collective of the loop gives the CPU test's
  values (tests/trainer/distributed/test_data_parallel.py, device-rule test), a CUDA gradient sums to [3, 3], a bare
  NCCL group refuses a CPU tensor and ``check_serves_cpu`` refuses it by name, ``wait_for_everyone`` returns.
  Pass (1 rank, the fallback on one GPU): the same backend config, and all_reduce of a CPU and a CUDA tensor,
  all_gather_object and barrier complete. ``deepspeed``: the same under ``ACCELERATE_USE_DEEPSPEED=true`` with
  recipes/accelerate/zero2.json (DeepSpeed's ``init_distributed`` makes the group).
- ``rank_gpu_rows``: ``torchrun --nproc_per_node 2`` of bench/gpu/gpu_worker_rank_engine.py. Pass (torch side): each
  rank's current device is its LOCAL_RANK, the object gather gives [0, 1], and torch's allocator holds nothing on
  the other rank's GPU. Pass (engine, vLLM's CUDA build): vLLM's worker on ``cuda:<LOCAL_RANK>``, the current device
  still LOCAL_RANK after ``LLM()``, nothing reserved on the other GPU, samples generated.
- ``capacity_row``: ``trainer.lifecycle.capacity.gpu_total_bytes`` under ``LOCAL_RANK = k`` is GPU k's memory for
  every visible k; ``LOCAL_RANK`` = the GPU count is refused (``PlacementError``). One GPU is enough.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from gpu_rows_common import BENCH, REPO, Skip, gpu_count, need_cuda, need_gpus, need_vllm_cuda, run_process, tail

from rollout.device_placement import PlacementError
from trainer.distributed.process_group import CUDA_BACKEND
from trainer.lifecycle.capacity import gpu_total_bytes

ZERO2 = REPO / "recipes" / "accelerate" / "zero2.json"
# The CPU test's values for dp_device_rule_worker.collectives on 2 ranks (test_data_parallel.py).
TWO_RANK_VALUES = {"global_normalizer": [6.0, 3.0], "sum_metrics": {"a": 3.0}, "mean_metrics": {"a": 1.5},
                   "max_metrics": {"a": 2.0}, "all_sum": [2.0, 1.0], "all_reduce_grads": [3.0, 3.0],
                   "raise_together": "ok", "barrier": "ok", "broadcast_object": {"tag": "abc"},
                   "gather_objects": [0, 1], "stop_together": "RewardFailed: rank 1's reward"}
POOLED_MAE = (3 * 0.1 + 3 * 0.2) / 6  # mean |d| over both ranks' tokens


def _torchrun(worker: str, ranks: int, args: list[str], env: dict, cap_s: float) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="gpu_check_torchrun_") as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
               str(BENCH / worker), tmp, *args]
        proc = run_process(cmd, cap_s=cap_s, what=f"torchrun {worker}", env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                                                                             **env})
        results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank_*.json"))]
    if proc.returncode != 0 or len(results) != ranks:
        raise AssertionError(f"torchrun exit {proc.returncode}, {len(results)}/{ranks} ranks wrote results: "
                             f"{tail(proc)}")
    return results


def _backend_pairs(config: str) -> set[str]:
    return {p.strip() for p in config.split(",")}


def dp_problems(results: list[dict], ranks: int) -> list[str]:
    """What in the ranks' results (gpu_worker_dp.py) breaks the pass rule of ``dp_row``."""
    bad = []
    for r in results:
        who = f"rank {r.get('rank')}"
        if not r.get("initialized"):
            bad.append(f"{who}: accelerate made no process group ({r.get('distributed_type')})")
            continue
        if _backend_pairs(r["backend_config"]) != _backend_pairs(CUDA_BACKEND):
            bad.append(f"{who}: backend config {r['backend_config']!r}, expected {CUDA_BACKEND!r}")
        if r.get("current") != ranks:
            bad.append(f"{who}: DataParallel.current(): {r.get('current')}")
        if r.get("wait_for_everyone") != "ok":
            bad.append(f"{who}: wait_for_everyone: {r.get('wait_for_everyone')}")
        if ranks == 1:
            expected = {"all_reduce_cpu": [1.0, 1.0], "all_reduce_cuda": [1.0, 1.0],
                        "all_gather_object": [{"rank": 0}], "barrier": "ok"}
            bad += [f"{who}: {k} = {r.get(k)!r}, expected {v!r}" for k, v in expected.items() if r.get(k) != v]
            continue
        c = r["collectives"]
        bad += [f"{who}: {k} = {c.get(k)!r}, expected {v!r}" for k, v in TWO_RANK_VALUES.items() if c.get(k) != v]
        if not (isinstance(c.get("pooled_parity"), float) and abs(c["pooled_parity"] - POOLED_MAE) < 1e-6):
            bad.append(f"{who}: pooled_parity = {c.get('pooled_parity')!r}, expected {POOLED_MAE}")
        if r.get("cuda_grads") != [3.0, 3.0]:
            bad.append(f"{who}: CUDA gradient all-reduce: {r.get('cuda_grads')!r}, expected [3.0, 3.0]")
        if "No backend type associated with device type cpu" not in str(r.get("cpu_tensor_on_nccl")):
            bad.append(f"{who}: a CPU tensor on a bare NCCL group gave {r.get('cpu_tensor_on_nccl')!r}")
        if "has no backend for CPU tensors" not in str(r.get("check_nccl")):
            bad.append(f"{who}: check_serves_cpu on a bare NCCL group: {r.get('check_nccl')!r}")
    return bad


def dp_row(ranks: int, deepspeed: bool) -> str:
    """See the module docstring. ``ranks`` 1 is the fallback of a one-GPU machine."""
    if ranks > 1:
        need_gpus(ranks, f"{ranks} torchrun ranks, one GPU each")
    else:
        need_cuda()
        if gpu_count() >= 2:
            raise Skip(f"{gpu_count()} GPUs here: the 2-rank row runs instead of this 1-GPU fallback")
    env = {}
    if deepspeed:
        try:
            import deepspeed  # noqa: F401  # late: an optional package, asked only by this row
        except ImportError as e:
            raise Skip(f"needs DeepSpeed (pip install deepspeed): {e}") from None
        env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ZERO2)}
    results = _torchrun("gpu_worker_dp.py", ranks, [], env, cap_s=300)
    bad = dp_problems(results, ranks)
    how = "DeepSpeed init_distributed (ZeRO-2 config)" if deepspeed else "accelerate"
    figure = f"{ranks} rank(s), group made by {how}: {results[0].get('backend_config')}"
    if bad:
        raise AssertionError(f"{figure}; " + "; ".join(bad[:6]))
    return figure + ("; the loop's collectives give the CPU test's values, CUDA gradients sum, a bare NCCL group "
                     "refused" if ranks > 1 else "; CPU and CUDA all_reduce, all_gather_object, barrier complete")


RANK_GPU_ROWS = ("each rank on its own GPU, 2 ranks (torch)", "each rank's vLLM engine on its own GPU, 2 ranks")


def rank_gpu_rows(model_dir) -> list[tuple[str, str, str]]:
    """Both rows of RANK_GPU_ROWS from one launch (the engine row skipped without vLLM's CUDA build)."""
    need_gpus(2, "two ranks on two GPUs")
    try:
        need_vllm_cuda()
        engine, why = True, ""
    except Skip as e:
        engine, why = False, str(e)
    results = _torchrun("gpu_worker_rank_engine.py", 2, [str(model_dir()), *(["--engine"] if engine else [])],
                        {}, cap_s=420)
    torch_bad, engine_bad = [], []
    for r in results:
        rank, local = r["rank"], r["local_rank"]
        others = [j for j in range(len(r["reserved"])) if j != local]
        if r["current_before"] != local:
            torch_bad.append(f"rank {rank}: current device {r['current_before']}, LOCAL_RANK {local}")
        if r["gathered"] != [0, 1]:
            torch_bad.append(f"rank {rank}: gather_objects {r['gathered']!r}")
        held = {j: r["reserved"][j] for j in others if r["reserved"][j]}
        if held:
            (engine_bad if engine else torch_bad).append(f"rank {rank} holds memory on GPU(s) {held}")
        if engine:
            if r.get("engine_device") != f"cuda:{local}":
                engine_bad.append(f"rank {rank}: vLLM's worker on {r.get('engine_device')}, expected cuda:{local}")
            if r.get("current_after") != local:
                engine_bad.append(f"rank {rank}: current device {r.get('current_after')} after LLM()")
            if not r.get("generated") or not all(r["generated"]):
                engine_bad.append(f"rank {rank}: generated {r.get('generated')!r}")
    torch_fig = "; ".join(torch_bad) if torch_bad else "ranks 0, 1 on cuda:0, cuda:1; gather [0, 1]; nothing held on the other GPU"
    rows = [(RANK_GPU_ROWS[0], "FAIL" if torch_bad else "pass", torch_fig)]
    if not engine:
        rows.append((RANK_GPU_ROWS[1], "skipped", why))
    else:
        fig = "; ".join(engine_bad) if engine_bad else ("each rank's vLLM worker on cuda:LOCAL_RANK, the current device "
                                                        "kept, nothing reserved on the other GPU")
        rows.append((RANK_GPU_ROWS[1], "FAIL" if engine_bad else "pass", fig))
    return rows


def capacity_row() -> str:
    need_cuda()
    count, seen, bad = torch.cuda.device_count(), [], []
    saved = os.environ.get("LOCAL_RANK")
    try:
        for k in range(count):
            os.environ["LOCAL_RANK"] = str(k)
            got, want = gpu_total_bytes(), torch.cuda.get_device_properties(k).total_memory
            seen.append(f"{k}: {got / 2**30:.1f} GiB")
            if got != want:
                bad.append(f"LOCAL_RANK {k}: {got} bytes, GPU {k} has {want}")
        os.environ["LOCAL_RANK"] = str(count)
        try:
            gpu_total_bytes()
            bad.append(f"LOCAL_RANK {count} (no such GPU) was not refused")
        except PlacementError:
            pass
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved
    figure = f"LOCAL_RANK -> GPU memory: {', '.join(seen)}; LOCAL_RANK {count} refused"
    if bad:
        raise AssertionError("; ".join(bad))
    return figure
