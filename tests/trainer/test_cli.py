"""The real command line, end to end at a tiny budget (each in its own process, as a user runs it)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args, timeout=900):
    env = {**os.environ, "WANDB_MODE": "offline"}
    env.pop("WANDB_API_KEY", None)
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_invalid_recipe_exits_2_with_one_clear_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("algorithm: {group_size: 1}\n")
    proc = run_cli("train", str(p), timeout=120)
    assert proc.returncode == 2
    assert "invalid recipe" in proc.stderr and "algorithm.group_size = 1" in proc.stderr and str(p) in proc.stderr


def test_bad_override_exits_2(tmp_path):
    proc = run_cli("train", str(REPO / "recipes" / "grpo_tiny.yaml"), "--set", "train.learning_rate=-1", timeout=120)
    assert proc.returncode == 2 and "train.learning_rate = -1" in proc.stderr


@pytest.mark.slow
def test_train_recipe_through_cli_then_resume(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "cli_run"
    common = ["--set", f"logging.run_dir={run_dir}", "--set", "rollout.prompts_per_step=4",
              "--set", "algorithm.group_size=4", "--set", "checkpoint.every=1"]
    proc = run_cli("train", str(REPO / "recipes" / "grpo_tiny.yaml"), "--set", "train.steps=2", *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "=== parityrl run summary ===" in proc.stdout and "wandb" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert {"reward/mean", "parity/mae", "parity/kl_k3", "perf/rollout_tokens_per_s", "train/loss"} <= rows[0].keys()
    assert list((run_dir / "wandb").glob("offline-run-*")), "wandb should have run offline"
    # a second start without --resume refuses; with --resume it continues to the new budget
    again = run_cli("train", str(REPO / "recipes" / "grpo_tiny.yaml"), "--set", "train.steps=3", *common)
    assert again.returncode == 2 and "--resume" in again.stderr
    resumed = run_cli("train", str(REPO / "recipes" / "grpo_tiny.yaml"), "--set", "train.steps=3", "--resume", *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.slow
def test_sft_recipe_through_cli(tmp_path):
    out = tmp_path / "sft_model"
    proc = run_cli("sft", str(REPO / "recipes" / "sft_tiny.yaml"), "--set", "train.steps=3", "--set", f"output_dir={out}",
                   "--set", "data.num_examples=64")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    info = json.loads((out / "parityrl_sft.json").read_text())
    assert info["sft_steps"] == 3
