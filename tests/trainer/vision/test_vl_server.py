"""The vision-language recipe in server mode (slow tier): `parityrl serve` of the recipe starts a server that loads
the tokenizer and takes images; the trainer sends each image with its prompt, the server's processor expands the
placeholder, its workers fingerprint the pixels it consumed, and the trainer checks them against its own processor's
every step, as with the colocated engine. One server for the module; training runs in this process (server mode
starts no engine here)."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from server_health import free_port, wait_healthy
from vl_faults import processor_at_42_pixels

import trainer.rl.loop as loop
from rollout.server_engine.errors import ServerEngineError
from rollout.server_engine.images import check_image_server
from trainer.lifecycle.preflight import load_recipe
from trainer.lifecycle.stops import RunStopped

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "grpo_vl_tiny.yaml"
# the untrained model (no warm start to build), float32, the recipe's adapter sync (vLLM's LoRA on the server); each
# push is followed by an evaluation of the same held-out images (the server's encoder cache is emptied at every
# push and must be refilled, not read stale)
SETS = ["model.path=builtin:zoo-idefics3", "rollout.kv_cache_memory_bytes=67108864"]
RUN = ["train.steps=2", "algorithm.group_size=4", "eval.every=1", "eval.num_prompts=4", "checkpoint.every=0",
       "logging.wandb.mode=disabled", "reward.functions={digits: 'vl_runs_worker:digit_share'}"]
# the colocated engine's float32 bound on this model (tests/rollout/test_vl_engine.py)
FLOAT32_MAE = 5e-6


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_server")
    url = f"http://127.0.0.1:{free_port()}"
    log = root / "server.log"
    args = [sys.executable, "-m", "trainer.cli", "serve", str(RECIPE), "--set", f"rollout.server_url={url}",
            "--set", f"logging.run_dir={root / 'run'}", *(a for s in SETS for a in ("--set", s))]
    with open(log, "w") as f:
        proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        wait_healthy(proc, url, log, "vision-language server")
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)


def _cfg(url, run_dir, *extra):
    return load_recipe(RECIPE, SETS + RUN + ["rollout.mode=server", f"rollout.server_url={url}",
                                             f"logging.run_dir={run_dir}", *extra])


def test_a_server_run_checks_the_servers_own_pixels_every_step(vl_server, tmp_path):
    res = loop.train(_cfg(vl_server, tmp_path / "clean"))
    steps = [m for m in res.history if "parity/mae" in m]
    assert len(steps) == 2
    for m in steps:
        print({k: m[k] for k in ("step", "parity/mae", "parity/max_abs", "mm/images", "mm/inputs_equal") if k in m})
        assert m["mm/inputs_equal"] == 1.0 and m["mm/images"] == 8 * 4  # 8 prompts x 4 samples, one image each
        assert m["parity/mae"] < FLOAT32_MAE, m["parity/mae"]
    assert all("eval/mean@4" in m for m in res.history if m["step"] in (1, 2))  # after each push, the same images


def test_a_trainer_processor_other_than_the_servers_stops_the_run_before_an_update(vl_server, tmp_path):
    undo = processor_at_42_pixels()
    try:
        with pytest.raises(RunStopped) as e:
            loop.train(_cfg(vl_server, tmp_path / "fault"))
    finally:
        undo()
    # the server's pixels (its processor at 56 pixels) against the trainer's (42): a comparison of two sides
    assert "image 0: pixel tensors differ (engine float32 [1, 3, 56, 56]" in str(e.value), str(e.value)


@pytest.mark.parametrize("info, says", [
    ({"images": None}, "serves text only"),
    ({"images": {"limit": 1, "processor": {}, "device_normalize": False}}, r"takes 1 image\(s\) a prompt, expected >= 2"),
    ({"images": {"limit": 2, "processor": {}, "device_normalize": True}}, "normalises images on the device"),
])
def test_a_server_not_started_for_the_recipes_images_is_refused_with_the_reason(info, says):
    with pytest.raises(ServerEngineError, match=says):
        check_image_server(info, "http://127.0.0.1:1", 2)
