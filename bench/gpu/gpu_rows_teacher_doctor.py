"""Rows of bench/gpu/gpu_check.py on issue 57 items 2 and 3: a teacher server under several ranks, and ``doctor`` on a
CUDA FP8 recipe. The CUDA behaviour both rows check was read from vLLM 0.32's source and tested on the CPU against
vLLM's own classes (tests/trainer/teacher/test_server_teacher_ranks.py, tests/doctor/test_weight_sync_fp8.py); these
rows are its first run on a GPU.

- ``server_teacher_ranks_row`` (2 GPUs, vLLM's CUDA build): ``parityrl serve`` of the built-in tiny teacher on one GPU
  (NCCL weight-transfer backend, as on CUDA by default), then ``torchrun --nproc_per_node 2`` of
  bench/gpu/gpu_worker_teacher.py with the other GPU visible: each rank starts the opd recipe's teacher
  (``Teacher.from_config``, ``teacher.engine: server``) on a gloo group and scores the same sequences. Expected: exit
  0 within the cap, both ranks' teacher log-probs equal and finite, no rank opened a weight transfer, and the server's
  weight version still vLLM's initial ``default`` (``GET /weight_info``). Before the fix each rank opened an NCCL
  transfer as the server's rank 0 and set its own version: one failed its version check, the other waited in
  vLLM's group creation (the cap turns that into a FAIL).
- ``doctor_fp8_row`` (1 GPU, vLLM's CUDA build): ``parityrl doctor`` of grpo_tiny on the Qwen2.5-0.5B-shaped model
  (vLLM's block-FP8 layers refuse the tiny model's shapes) with ``precision.recipe=fp8_rollout``, ``--only
  weight_sync --only prefix_cache``. Expected: exit 0; weight_sync's merged sync delivers every module bit for bit
  (vLLM's ``Fp8LinearMethod`` layers read by their FP8 values and scales), its restore reads 0 and the engine's
  log-probs after the check equal those before (max |dlp| 0: the FP8 values and scales put back as they were);
  prefix_cache's legs, the sync leg included, PASS or WARN. Before the fix every FP8 module read "wrong" and the
  restore left each layer's scale unloaded (its log-probs moved, or NaN).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from gpu_rows_common import (
    BENCH,
    REPO,
    child_env,
    free_port,
    need_gpus,
    need_vllm_cuda,
    run_process,
    stop_server_group,
    tail,
)

from rollout.server_engine.engine import SERVED_VERSION

TEACHER_ROWS = ("server teacher under 2 ranks",)
DOCTOR_ROWS = ("doctor on an FP8 recipe (CUDA)",)


def _visible() -> list[str]:
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [x.strip() for x in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]


def _weight_version(url: str) -> str:
    with urllib.request.urlopen(f"{url}/weight_info", timeout=10) as r:
        return json.loads(r.read())["weight_version"]


def server_teacher_ranks_row() -> str:
    need_gpus(2, "the teacher server owns one GPU, the trainer's ranks run with the other")
    need_vllm_cuda()
    trainer_gpu, server_gpu = _visible()[:2]
    url = f"http://127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="gpu_check_teacher_") as tmp:
        log = open(Path(tmp) / "server.log", "w")
        server = subprocess.Popen(
            [sys.executable, "-m", "trainer", "serve", str(REPO / "recipes" / "grpo_tiny.yaml"),
             "--set", "model.path=builtin:tiny-teacher", "--set", f"rollout.server_url={url}",
             "--transfer-backend", "nccl"],
            cwd=REPO, env=child_env(CUDA_VISIBLE_DEVICES=server_gpu),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                   str(BENCH / "gpu_worker_teacher.py"), tmp, url]
            proc = run_process(cmd, cap_s=300, what="torchrun gpu_worker_teacher.py",
                               env={"CUDA_VISIBLE_DEVICES": trainer_gpu})
            results = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank_*.json"))]
            version = _weight_version(url) if server.poll() is None else f"(server exited {server.returncode})"
        finally:
            stop_server_group(server, log)
    if proc.returncode != 0 or len(results) != 2:
        raise AssertionError(f"torchrun exit {proc.returncode}, {len(results)}/2 ranks wrote results: {tail(proc)}")
    scores = [r["logprobs"] for r in results]
    problems = [f"rank {r['rank']} opened a weight transfer" for r in results if r["transfer"]]
    if scores[0] != scores[1] or not all(abs(x) < float("inf") for s in scores for row in s for x in row):
        problems.append(f"the ranks' teacher log-probs differ or are not finite: {scores[0][0][:3]} vs "
                        f"{scores[1][0][:3]}")
    if version != SERVED_VERSION:
        problems.append(f"the server's weight version is {version!r}, expected {SERVED_VERSION!r}")
    figure = (f"2 ranks scored {sum(len(row) for row in scores[0])} tokens each on one teacher server (GPU "
              f"{server_gpu}), equal; no transfer opened; server version {version!r}")
    if problems:
        raise AssertionError(f"{figure}: {'; '.join(problems)}")
    return figure


def doctor_fp8_row(shaped_dir) -> str:
    need_vllm_cuda()
    with tempfile.TemporaryDirectory(prefix="gpu_check_doctor_") as tmp:
        out = Path(tmp) / "report"
        cmd = [sys.executable, "-m", "trainer", "doctor", str(REPO / "recipes" / "grpo_tiny.yaml"),
               "--set", f"model.path={shaped_dir()}", "--set", "precision.recipe=fp8_rollout",
               "--set", f"logging.run_dir={tmp}/run", "--only", "weight_sync", "--only", "prefix_cache",
               "--out", str(out)]
        proc = run_process(cmd, cap_s=420, what="parityrl doctor fp8_rollout")
        report = json.loads((out / "doctor.json").read_text()) if (out / "doctor.json").is_file() else None
    if report is None:
        raise AssertionError(f"doctor exit {proc.returncode} without doctor.json: {tail(proc)}")
    findings = report["findings"]
    rows = [f"{f['check']}: {f['item']} = {f.get('figure')} {f['verdict']}" for f in findings]
    bad = [r for r, f in zip(rows, findings) if f["verdict"] not in ("PASS", "WARN")]
    checks = {f["check"] for f in findings}
    if proc.returncode != 0 or bad or checks != {"weight_sync", "prefix_cache"}:
        raise AssertionError(f"doctor exit {proc.returncode}; not passed: {bad[:4] or sorted(checks)}")
    sync = next(f for f in findings if f["check"] == "weight_sync")
    return f"exit 0, {len(findings)} rows PASS/WARN; weight_sync: {sync['item']} = {sync.get('figure')}"
