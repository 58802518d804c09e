"""builtin:tiny's warm start asked for first by the ranks of a launch (`accelerate launch ... recipes/grpo_tiny.yaml`
before any single-process run has built it): built once, as one process, and every rank gets it."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.builtin.warm_start import single_process_env

REPO = Path(__file__).resolve().parents[3]

RANK_SCRIPT = """
import sys
from accelerate import Accelerator
from trainer.builtin.warm_start import ensure_warm_started_tiny
from trainer.distributed.deepspeed import accelerator_kwargs

accelerator = Accelerator(**accelerator_kwargs())  # the process group the training loop joins before the model
path = ensure_warm_started_tiny()
sys.stdout.write(f"rank {accelerator.process_index}: {path}\\n")  # one write: the ranks share the pipe
sys.stdout.flush()
accelerator.wait_for_everyone()
"""


def test_the_build_environment_drops_what_a_launcher_sets_for_its_ranks():
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "ACCELERATE_USE_DEEPSPEED": "true",
           "OMP_NUM_THREADS": "1", "PARITYRL_CACHE": "/c", "PATH": "/bin"}
    assert single_process_env(env) == {"OMP_NUM_THREADS": "1", "PARITYRL_CACHE": "/c", "PATH": "/bin"}


@pytest.mark.slow
def test_two_ranks_build_the_warm_start_once_as_one_process(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "PARITYRL_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # Transformers' Trainer inside a rank would have split sft_tiny.yaml's one micro-batch over 2 processes (refused)
    assert proc.stdout.count("building the default model (once, into the model cache): warm start sft_tiny.yaml, "
                             "300 supervised steps (about 18 s on 2 idle CPU cores)") == 1, proc.stdout
    # Lines of two processes on one pipe can still interleave mid-line (unbuffered writes): match, don't split.
    paths = set(re.findall(r"rank \d+: (\S+?)(?=rank \d+: |\s|$)", proc.stdout))
    assert len(paths) == 1 and (Path(paths.pop()) / "config.json").is_file()
