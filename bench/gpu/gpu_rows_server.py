"""Rows of bench/gpu/gpu_check.py on server mode (issue 44 items 3, 9 and 11).

- ``stream_wait_row`` (torch only): vLLM's packed NCCL producer copies the update on a side stream of its own
  (``weight_transfer/packed_tensor.py``); the merged weights are written on the trainer's current stream just
  before. A tensor written on the current stream behind a long ``torch.cuda._sleep`` and then copied on a side
  stream, as the producer does: after ``rollout.server_engine.nccl_ready`` the copy holds the new values (pass);
  the same copy without it shows whether the race is real on this GPU (printed, not judged).
- ``serve_routes_row``: ``parityrl serve --dry-run`` of an MoE recipe with routing replay on, on CUDA: exit 2 naming
  "a server on CUDA cannot return routes". No vLLM needed.
- ``serve_note_row``: ``parityrl serve --dry-run`` of a dense recipe on CUDA: exit 0 and the note that server and
  trainer need disjoint GPUs. No vLLM needed.
- ``server_nccl_row`` (2 GPUs, vLLM's CUDA build): ``parityrl serve`` on one GPU (NCCL weight transfer) and
  ``parityrl train`` in server mode on another, 2 steps with ``parity.on_violation: stop`` (a push that left wrong
  weights trips the probe's limit): exit 0, both steps logged, weights pushed, parity/mae and probe/mae printed.
"""
from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

import torch
from gpu_rows_common import (
    REPO,
    child_env,
    free_port,
    need_cuda,
    need_gpus,
    need_vllm_cuda,
    run_process,
    stop_server_group,
    tail,
    train,
)

from rollout.server_engine import SERVER_ROUTES_ON_CUDA, nccl_ready
from trainer.commands.serve import GPU_SHARE_NOTE

SLEEP_CYCLES = 500_000_000  # ~0.2-0.3 s of one SM spinning at 1.5-2 GHz: long enough for the side stream to win


def stream_wait_row() -> str:
    device = need_cuda()
    n = 1 << 22
    side = torch.cuda.Stream()

    def written_then_copied(wait: bool) -> bool:
        """True when the side stream's copy holds the new values."""
        t = torch.zeros(n, device=device)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)  # the current stream is busy...
        t.fill_(1.0)  # ...then writes the update, as the merge does before a push
        named = nccl_ready([("w", t)]) if wait else [("w", t)]
        with torch.cuda.stream(side):
            copy = named[0][1].clone()
        side.synchronize()
        ok = bool((copy == 1.0).all())
        torch.cuda.synchronize()
        return ok

    control = written_then_copied(wait=False)
    waited = written_then_copied(wait=True)
    figure = ("after nccl_ready the side stream read the new values" if waited else
              "after nccl_ready the side stream read STALE values")
    figure += ("; without it: the new values (the race did not show on this GPU)" if control else
               "; without it: stale values (the race is real: the wait is needed)")
    if not waited:
        raise AssertionError(figure)
    return figure


def _serve_dry_run(sets: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer", "serve", str(REPO / "recipes" / "grpo_tiny.yaml"), "--dry-run"]
    for s in sets:
        cmd += ["--set", s]
    return run_process(cmd, cap_s=180, what="parityrl serve --dry-run")


def serve_routes_row(moe_dir) -> str:
    need_cuda()
    proc = _serve_dry_run([f"model.path={moe_dir()}", "parity.routing_replay=on"])
    said = "a server on CUDA cannot return routes" in proc.stderr and SERVER_ROUTES_ON_CUDA[:60] in proc.stderr
    figure = f"exit {proc.returncode}: {tail(proc)[:200]}"
    if proc.returncode != 2 or not said:
        raise AssertionError(f"expected exit 2 naming the refusal; {figure}")
    return "refused before anything starts (exit 2): a server on CUDA cannot return routes"


def serve_note_row(dense_dir) -> str:
    need_cuda()
    proc = _serve_dry_run([f"model.path={dense_dir()}"])
    if proc.returncode != 0 or GPU_SHARE_NOTE not in proc.stderr:
        raise AssertionError(f"expected exit 0 and the disjoint-GPU note; exit {proc.returncode}: {tail(proc)}")
    return "exit 0; says the server takes 0.92 of its GPUs and the trainer needs others (CUDA_VISIBLE_DEVICES)"


def _two_gpus() -> tuple[str, str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [x.strip() for x in visible.split(",")] if visible else [str(i) for i in range(torch.cuda.device_count())]
    return ids[0], ids[1]


def need_server_gpus() -> None:
    """Skip unless two GPUs and vLLM's CUDA build are here: a server and a trainer on disjoint GPUs."""
    need_gpus(2, "the server and the trainer on disjoint GPUs")
    need_vllm_cuda()


@contextlib.contextmanager
def _nccl_server(model_set: str, sets: Sequence[str], tmp: Path) -> Iterator[tuple[str, str, str]]:
    """``parityrl serve recipes/grpo_tiny.yaml`` with NCCL weight transfer on the second visible GPU, ``sets`` on its
    recipe; yields (url, the trainer's GPU, the server's GPU) and ends the server's process group after. Its log is
    ``tmp``/server.log. The row calls ``need_server_gpus`` first, before it builds a model."""
    trainer_gpu, server_gpu = _two_gpus()
    url = f"http://127.0.0.1:{free_port()}"
    log = open(tmp / "server.log", "w")
    cmd = [sys.executable, "-m", "trainer", "serve", str(REPO / "recipes" / "grpo_tiny.yaml"), "--set", model_set,
           "--set", f"rollout.server_url={url}", "--transfer-backend", "nccl"]
    server = subprocess.Popen(cmd + [a for x in sets for a in ("--set", x)], cwd=REPO,
                              env=child_env(CUDA_VISIBLE_DEVICES=server_gpu), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        yield url, trainer_gpu, server_gpu
    finally:
        stop_server_group(server, log)


def _server_log_tail(tmp: Path) -> str:
    """The server log's last line (where a server that failed says why), at most 200 characters."""
    lines = (tmp / "server.log").read_text().strip().splitlines()
    return lines[-1][:200] if lines else ""


def train_on_nccl_server(model_set: str, server_sets: Sequence[str], train_sets: Sequence[str], steps: int,
                         prefix: str) -> tuple[list[dict], str, str]:
    """``parityrl train recipes/grpo_tiny.yaml`` in server mode for ``steps`` steps against an ``_nccl_server``
    started with ``server_sets``: (the steps' metric rows, the trainer's GPU, the server's GPU). A run that fails or
    stops short raises with the trainer's and the server's last lines."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        with _nccl_server(model_set, server_sets, Path(tmp)) as (url, trainer_gpu, server_gpu):
            proc, rows = train("grpo_tiny.yaml", [model_set, "rollout.mode=server", *train_sets,
                                                  f"rollout.server_url={url}", "rollout.server_connect_timeout_s=400",
                                                  f"train.steps={steps}", "eval.every=0"],
                               Path(tmp) / "runs", cap_s=540, env={"CUDA_VISIBLE_DEVICES": trainer_gpu})
        server_tail = _server_log_tail(Path(tmp))
    if proc.returncode != 0 or len(rows) < steps:
        raise AssertionError(f"train exit {proc.returncode}, {len(rows)}/{steps} steps: {tail(proc)}; server: "
                             f"{server_tail}")
    return rows, trainer_gpu, server_gpu


def server_nccl_row(dense_dir) -> str:
    need_server_gpus()
    rows, trainer_gpu, server_gpu = train_on_nccl_server(f"model.path={dense_dir()}", [], ["parity.on_violation=stop"],
                                                         2, "gpu_check_server_")
    pushed = sum(r.get("perf/sync_bytes") or 0 for r in rows)
    maes = [r.get("parity/mae", math.nan) for r in rows]
    probes = [r.get("probe/mae", math.nan) for r in rows]
    figure = (f"2 steps, server on GPU {server_gpu}, trainer on GPU {trainer_gpu}: {pushed / 2**20:.1f} MiB pushed "
              f"over NCCL; parity/mae {', '.join(f'{m:.2e}' for m in maes)}, probe/mae "
              f"{', '.join(f'{m:.2e}' for m in probes)}")
    if not pushed > 0:
        raise AssertionError(f"{figure}: nothing pushed")
    return figure
