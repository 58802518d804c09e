"""SIGINT and SIGTERM before the first step -- while the model loads, while vLLM's engine starts -- end `parityrl
train` at once with one line and status 130 / 143, the run lock released (slow: real processes, the tiny model,
the vLLM engine; the moments are found in the run's own output). After the first step the loop's handler
stops at a step boundary with a checkpoint: tests/trainer/lifecycle/test_stops_integration.py."""
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow

# the moment -> a piece of the output line at which the signal is sent
MOMENTS = {
    "model load": "launch:",  # preflight done; the policy, data and engine to come
    "engine init": "Initializing a V1 LLM engine",  # vLLM's engine core starts (its process group, its model)
    "engine weights": "Loading weights took",  # vLLM has its weights; KV cache, warm-up and the first sync follow
}


@pytest.mark.parametrize("signum, moment", [(signal.SIGINT, "model load"), (signal.SIGINT, "engine init"),
                                            (signal.SIGTERM, "engine weights")],
                         ids=["SIGINT-model-load", "SIGINT-engine-init", "SIGTERM-engine-weights"])
def test_a_signal_before_the_first_step_stops_at_once_with_one_line(signum, moment, tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-u", "-m", "trainer", "train", str(REPO / "recipes/grpo_tiny.yaml"), "--verbose",
            "--set", "name=sig", "--set", f"logging.run_dir={run_dir}", "--set", "logging.wandb.mode=disabled",
            "--set", "train.steps=2", "--set", "rollout.prompts_per_step=4", "--set", "algorithm.group_size=4",
            "--set", "rollout.max_new_tokens=8", "--set", "parity.probe_prompts=0"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "INFO"})
    killer = threading.Timer(600, proc.kill)  # a run that ignores the signal fails here instead of hanging
    killer.start()
    lines, sent = [], False
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if not sent and MOMENTS[moment] in line:
                proc.send_signal(signum)
                sent, at = True, len(lines)
        proc.wait()
    finally:
        killer.cancel()
    output = "\n".join(lines)
    assert sent, f"never saw {MOMENTS[moment]!r}:\n{output[-3000:]}"
    assert proc.returncode == 128 + signum, output[-3000:]
    after = lines[at:]
    said = [x for x in after if x.startswith("parityrl: ")]
    assert said == [f"parityrl: {signal.Signals(signum).name} received before the first step: stopped at once "
                    "(nothing was trained in this launch, so there is nothing to checkpoint)"], output[-3000:]
    assert not any(x.startswith("step ") or "Traceback" in x or "Exception ignored" in x for x in after), output
    assert (run_dir / ".lock").read_text() == ""  # released: the next run takes it without a note
