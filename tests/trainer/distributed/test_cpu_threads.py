"""train.cpu_threads: sizes the process's pool before the engine starts, and is refused when not >= 1."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import RecipeError
from trainer.config.load import read_recipe
from trainer.distributed.cpu_threads import apply_cpu_threads

REPO = Path(__file__).resolve().parents[3]


def test_sets_the_pool_and_names_the_key():
    # in a process of its own: once a vLLM CPU engine has started in this one (the suite's engine fixtures),
    # torch.set_num_threads is a no-op here
    code = ("import torch; from trainer.distributed.cpu_threads import apply_cpu_threads; "
            "line = apply_cpu_threads(1); print(torch.get_num_threads()); print(line)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    threads, line = out.stdout.splitlines()[-2:]
    assert threads == "1"
    assert line.startswith("1 CPU thread of ") and line.endswith(" cores (train.cpu_threads)")


def test_null_leaves_the_default():
    before = torch.get_num_threads()
    assert apply_cpu_threads(None) is None
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("value", [0, -2])
def test_refused_below_one(value):
    with pytest.raises(RecipeError, match=rf"train.cpu_threads.*{value}.*an integer >= 1 or null"):
        read_recipe("recipes/grpo_tiny.yaml", [f"train.cpu_threads={value}"])
