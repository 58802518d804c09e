"""A run that stops mid-way -- a reward function returning NaN, then a SIGTERM in the middle of a step -- and is
resumed twice trains exactly what the uninterrupted run trains (slow: real processes, the tiny model, HF engine).

The signal is sent by the reward function itself (on its n-th call, i.e. inside step n's rollout phase), so
it lands mid-step on every machine, however loaded.
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow

REWARD = """\
import math, os, signal
from trainer.data.tasks.arithmetic import exact_answer_reward

calls = 0

def reward(prompts, completions, **columns):
    global calls
    calls += 1
    if calls == int(os.environ.get("NAN_AT_CALL", 0)):
        return [math.nan] * len(prompts)
    if calls == int(os.environ.get("SIGTERM_AT_CALL", 0)):
        os.kill(os.getpid(), signal.SIGTERM)
    return exact_answer_reward(prompts, completions, **columns)
"""


def run(tmp_path: Path, name: str, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    sets = [f"name={name}", f"logging.run_dir={tmp_path / name}", "logging.wandb.mode=disabled", "rollout.engine=hf",
            "rollout.prompts_per_step=4", "algorithm.group_size=4", "rollout.max_new_tokens=8", "train.steps=4",
            "train.micro_batch_size=16", "checkpoint.every=0", "parity.probe_prompts=0", "data.num_examples=32",
            "eval.every=0",  # the reward's calls are counted: the held-out evaluation would call it too
            f"reward.functions={{r: '{tmp_path / 'reward.py'}:reward'}}"]
    argv = [sys.executable, "-m", "trainer", "train", str(REPO / "recipes" / "grpo_tiny.yaml"), *extra]
    for s in sets:
        argv += ["--set", s]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def run_printed(line: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The command a stop line names (``continue with `...```), run as printed, from the same directory."""
    (command,) = re.findall(r"continue with `([^`]+)`", line)
    assert command.endswith(" --resume") and "name=cut" in command, command
    return subprocess.run(shlex.split(command), cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def steps(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}  # a resumed run appends: the last record of a step wins


def adapter(run_dir: Path) -> dict:
    from peft.utils import load_peft_weights

    from trainer.io.checkpoint import latest_checkpoint

    return load_peft_weights(str(latest_checkpoint(run_dir) / "adapter"), device="cpu")


def parityrl_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("parityrl:")]


def test_reward_failure_and_sigterm_stop_with_a_checkpoint_and_resume_exactly(tmp_path, tiny_model_dir):
    (tmp_path / "reward.py").write_text(REWARD)
    full = run(tmp_path, "full")
    assert full.returncode == 0, full.stderr[-3000:]

    # step 2's reward is NaN: step 2 is abandoned, step 1 checkpointed (checkpoint.every is 0: not by cadence)
    failed = run(tmp_path, "cut", env={"NAN_AT_CALL": "2"})
    assert failed.returncode == 5, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr
    (line,) = parityrl_lines(failed.stderr)
    assert "stopped: step 2: reward function 'r' returned nan at sample 0" in line
    assert "checkpoint of the last completed step 1 written to" in line and "--resume" in line

    # resumed by the command the line names, as printed, then SIGTERM in the middle of step 2 (the resumed
    # process' first reward call): step 2 finishes
    preempted = run_printed(line, env={"SIGTERM_AT_CALL": "1"})
    assert preempted.returncode == 128 + signal.SIGTERM, preempted.stderr[-3000:]
    assert "Traceback" not in preempted.stderr
    received, stopped = parityrl_lines(preempted.stderr)
    assert "SIGTERM received: stopping after this step" in received
    assert "stopped: SIGTERM after step 2 of 4" in stopped and "step 2 written to" in stopped

    resumed = run_printed(stopped)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = steps(tmp_path / "full"), steps(tmp_path / "cut")
    assert sorted(b) == [1, 2, 3, 4]
    for s in (1, 2, 3, 4):  # the same prompts, samples, rewards and updates
        assert (a[s]["reward/mean"], a[s]["train/loss"]) == (b[s]["reward/mean"], b[s]["train/loss"]), s
    pa, pb = adapter(tmp_path / "full"), adapter(tmp_path / "cut")
    assert pa.keys() == pb.keys()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], rtol=0, atol=0, msg=k)
