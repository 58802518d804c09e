"""train.cpu_threads and train.update_cpu_threads: size the process's pool before the engine starts and during the
update, and are refused when not >= 1."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.config import RecipeError
from trainer.config.load import read_recipe
from trainer.distributed.cpu_threads import apply_cpu_threads, update_threads

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


def test_the_update_gets_its_own_pool_and_gives_the_rollout_its_size_back():
    # in a process of its own, after replacing torch.set_num_threads with a no-op as vLLM's CPU worker does once
    # its engine has started (vllm/v1/worker/cpu_worker.py): the update's size must still take effect
    code = ("import torch; from trainer.distributed.cpu_threads import apply_cpu_threads, update_threads\n"
            "line = apply_cpu_threads(1, 2); torch.set_num_threads = lambda n: None\n"
            "with update_threads(2): inside = torch.get_num_threads()\n"
            "print(inside, torch.get_num_threads()); print(line)\n"
            "try:\n"
            "    with update_threads(2): raise KeyError\n"
            "except KeyError: print(torch.get_num_threads())")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    sizes, line, after_error = out.stdout.splitlines()[-3:]
    assert sizes == "2 1"
    assert after_error == "1"
    assert line.endswith(" cores (train.cpu_threads), 2 CPU threads during the update (train.update_cpu_threads)")


def test_no_update_size_leaves_the_pool_alone():
    before = torch.get_num_threads()
    with update_threads(None):
        assert torch.get_num_threads() == before
    assert apply_cpu_threads(None, None) is None


@pytest.mark.parametrize("value", [0, -1])
def test_update_size_refused_below_one(value):
    with pytest.raises(RecipeError, match=rf"train.update_cpu_threads.*{value}.*an integer >= 1 or null"):
        read_recipe("recipes/grpo_tiny.yaml", [f"train.update_cpu_threads={value}"])
