"""Exact mode's trainer side: the straight-through value route, batch unpacking, the recipe-level refusals."""
from pathlib import Path

import pytest
import torch

from trainer.config.schema import RecipeError
from trainer.lifecycle.preflight import load_recipe
from trainer.models.batch import build_token_batch
from trainer.models.exact import sequences_of, straight_through
from trainer.precision import recipe_for
from trainer.precision.checks import check_launch, check_model_config, recipe_rules

REPO = Path(__file__).resolve().parents[3]


def test_straight_through_returns_the_value_and_routes_the_gradient():
    value = torch.tensor([-1.25, -0.5, -3.0])
    x = torch.tensor([0.1, 0.2, 0.3], requires_grad=True)
    differentiable = torch.log(x)  # d/dx = 1/x
    out = straight_through(value, differentiable)
    assert torch.equal(out, value)
    (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.allclose(x.grad, torch.tensor([1 / 0.1, 2 / 0.2, 3 / 0.3]))
    # without a graph there is nothing to route
    assert straight_through(value, differentiable.detach()) is value
    with pytest.raises(ValueError, match=r"value \(2,\) vs differentiable \(3,\)"):
        straight_through(value[:2], differentiable)


def test_sequences_of_recovers_each_rows_real_tokens_from_a_padded_batch():
    batch = build_token_batch([[5, 6, 7], [8]], [[9, 10], [11, 12, 13]], pad_id=0)
    seqs, starts, counts = sequences_of(batch)
    assert seqs == [[5, 6, 7, 9, 10], [8, 11, 12, 13]]
    assert starts == [3, 1] and counts == [2, 3]
    # a micro-batch trims the common left padding and keeps the same rows
    assert sequences_of(batch.select(slice(1, 2)))[0] == [[8, 11, 12, 13]]


@pytest.mark.parametrize("sets, words", [
    (["rollout.engine=hf"], "rollout.engine = 'hf'"),
    (["rollout.mode=server"], "rollout.mode = 'server'"),
    (["model.dtype=float16"], "model.dtype = 'float16'"),
])
def test_exact_recipe_refuses_what_it_does_not_cover_at_load(sets, words):
    with pytest.raises(RecipeError, match=words.replace("(", r"\(")):
        load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["precision.recipe=exact", *sets])


def test_exact_refuses_cuda_several_processes_and_other_architectures():
    from transformers import LlamaConfig, MixtralConfig

    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml", ["precision.recipe=exact"])
    exact = recipe_for("exact")
    assert all(ok for ok, *_ in recipe_rules(cfg, cuda=False))
    assert [key for ok, key, *_ in recipe_rules(cfg, cuda=True) if not ok] == ["precision.recipe"]
    with pytest.raises(RecipeError, match="2 processes"):
        check_launch(exact, stage=0, world_size=2)
    with pytest.raises(RecipeError, match="ZeRO stage 3"):
        check_launch(exact, stage=3, world_size=1)
    with pytest.raises(RecipeError, match="model_type 'mixtral'"):
        check_model_config(exact, MixtralConfig())
    check_launch(exact, stage=0, world_size=1)
    check_model_config(exact, LlamaConfig())
