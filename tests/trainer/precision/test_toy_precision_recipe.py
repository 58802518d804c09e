"""Adding a precision recipe is one record: a toy recipe defined in this file alone is valid in a recipe,
refused where its record says, starts its engine with its options, transforms the trainer's model and trains
a step.

Nothing outside this file names it: the recipe loader asks its record, the engine construction composes its
options, the policy loader applies its transform.
"""
from pathlib import Path

import pytest
import torch

import trainer.sampling.engines
from trainer.config import RecipeError
from trainer.lifecycle.preflight import load_recipe
from trainer.precision import RECIPES, PrecisionRecipe, compare_choices, register_recipe
from trainer.precision.record import ASYNC, COMPARE, FLOAT32_FLOOR, SERVER

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"
CALLS = {"engine_options": 0, "transform": 0}


def toy_engine_options(cuda: bool) -> dict:
    CALLS["engine_options"] += 1
    return {"toy_option": "cuda" if cuda else "cpu"}


def toy_transform(model):
    """Marks the trainer's model (a real recipe would swap its layers)."""
    CALLS["transform"] += 1
    model.toy_precision = True
    return model


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setattr(RECIPES, "_fns", dict(RECIPES._fns))  # the registry as it was, once the test ends
    CALLS.update(engine_options=0, transform=0)
    yield register_recipe(PrecisionRecipe(
        name="toy_fp32", doc="a float32 toy (this test)", dtypes=("float32",), dtype_reason="the toy runs in float32",
        mae_floor={"float32": FLOAT32_FLOOR},
        engine_options=toy_engine_options, transform=toy_transform,
        refuses={SERVER: "the toy has no server", COMPARE: "the toy is not compared",
                 ASYNC: "the toy is on-policy"}))


def test_an_unregistered_recipe_is_refused():
    with pytest.raises(RecipeError, match="precision.recipe = 'toy_fp32': expected one of bf16, "):
        load_recipe(RECIPE, ["precision.recipe=toy_fp32"], check_paths=False)


def test_a_toy_recipe_is_valid_refused_where_it_says_and_starts_its_engine(toy, tmp_path, monkeypatch):
    cfg = load_recipe(RECIPE, ["precision.recipe=toy_fp32", "model.dtype=float32", f"logging.run_dir={tmp_path}"],
                      check_paths=False)
    assert cfg.precision.recipe == "toy_fp32"
    with pytest.raises(RecipeError, match=r"model.dtype = 'bfloat16': expected float32 with precision.recipe "
                                          r"toy_fp32 \(the toy runs in float32\)"):
        load_recipe(RECIPE, ["precision.recipe=toy_fp32"], check_paths=False)
    with pytest.raises(RecipeError, match=r"rollout.mode = 'server': expected 'colocate' with precision.recipe "
                                          r"toy_fp32 \(the toy has no server\)"):
        load_recipe(RECIPE, ["precision.recipe=toy_fp32", "model.dtype=float32", "rollout.mode=server"],
                    check_paths=False)
    with pytest.raises(RecipeError, match=r"precision.recipe = 'toy_fp32': expected not toy_fp32 with "
                                          r"rollout.max_staleness 2 \(the toy is on-policy\)"):
        load_recipe(RECIPE, ["precision.recipe=toy_fp32", "model.dtype=float32", "rollout.max_staleness=2"],
                    check_paths=False)
    assert "toy_fp32" not in compare_choices()

    made = []
    monkeypatch.setattr(trainer.sampling.engines, "VLLMEngine", lambda model_dir, **kw: made.append((model_dir, kw)))
    trainer.sampling.engines.make_engine(cfg, "/models/base", max_model_len=88)
    ((model_dir, kwargs),) = made
    assert model_dir == "/models/base" and kwargs["toy_option"] == ("cuda" if torch.cuda.is_available() else "cpu")
    assert kwargs["dtype"] == "float32" and CALLS["engine_options"] == 1


@pytest.mark.slow
def test_a_toy_recipe_trains_one_step_on_the_hf_engine(toy, tmp_path, tiny_model_dir):
    from trainer.rl.loop import train

    cfg = load_recipe(RECIPE, [
        "precision.recipe=toy_fp32", "model.dtype=float32", "rollout.engine=hf", "name=toy", f"logging.run_dir={tmp_path}",
        "logging.wandb.mode=disabled", "train.steps=1", "rollout.prompts_per_step=2", "algorithm.group_size=2",
        "rollout.max_new_tokens=8", "train.micro_batch_size=4", "parity.probe_prompts=0", "checkpoint.every=0"])
    (h,) = train(cfg).history
    assert CALLS == {"engine_options": 0, "transform": 1}  # the HF engine takes no vLLM options
    assert h["train/grad_norm"] > 0 and h["parity/mae"] < 1e-3  # float32 on both sides
