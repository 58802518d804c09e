"""train.cpu_threads: sizes the process's pool before the engine starts, and is refused when not >= 1."""
import pytest
import torch

from trainer.config import RecipeError
from trainer.config.load import read_recipe
from trainer.distributed.cpu_threads import apply_cpu_threads


def test_sets_the_pool_and_names_the_key():
    before = torch.get_num_threads()
    try:
        line = apply_cpu_threads(1)
        assert torch.get_num_threads() == 1
        assert line.startswith("1 CPU thread of ") and "train.cpu_threads" in line
    finally:
        torch.set_num_threads(before)


def test_null_leaves_the_default():
    before = torch.get_num_threads()
    assert apply_cpu_threads(None) is None
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("value", [0, -2])
def test_refused_below_one(value):
    with pytest.raises(RecipeError, match=rf"train.cpu_threads.*{value}.*an integer >= 1 or null"):
        read_recipe("recipes/grpo_tiny.yaml", [f"train.cpu_threads={value}"])
