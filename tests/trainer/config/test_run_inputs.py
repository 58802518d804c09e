"""Recipe values that would misplace or poison a run: non-finite numbers, repeated keys, a run name that is a path."""
from pathlib import Path

import pytest

from trainer.config import RecipeError
from trainer.lifecycle.preflight import load_recipe

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"


@pytest.mark.parametrize("override", ["train.learning_rate=.inf", "rollout.temperature=.inf", "train.learning_rate=.nan",
                                      "train.max_grad_norm=-.inf", "parity.max_mae=.nan", "train.weight_decay=nan",
                                      "train.adam_betas=[0.9, .inf]",
                                      "parity.correction={rule: token_tis, token_tis: {cap: .inf}}"])
def test_every_number_must_be_finite(override):
    key = override.split("=")[0]
    with pytest.raises(RecipeError, match="expected a finite number") as e:
        load_recipe(RECIPE, [override], check_paths=False)
    assert key in str(e.value)


def test_a_repeated_key_is_refused_naming_it_and_both_lines(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(RECIPE.read_text().replace("  learning_rate: 2.0e-3\n", "  learning_rate: 2.0e-3\n  seed: 3\n"))
    lines = p.read_text().splitlines()
    first = next(i for i, x in enumerate(lines, 1) if x.strip() == "seed: 0")
    second = next(i for i, x in enumerate(lines, 1) if x.strip() == "seed: 3")
    with pytest.raises(RecipeError) as e:
        load_recipe(p, check_paths=False)
    msg = str(e.value)
    assert "'seed'" in msg and f"line {first}" in msg and f"line {second}" in msg, msg
    # the same key in different sections is fine
    p.write_text("name: a\ntrain: {seed: 1}\nrollout: {top_k: 0}\ncheckpoint: {every: 1}\nparity: {topk: 0}\n")
    assert load_recipe(p, check_paths=False).train.seed == 1


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".", "", " x", "a\\b"])
def test_a_run_name_is_one_path_component(name):
    with pytest.raises(RecipeError, match="name = .*one folder name"):
        load_recipe(RECIPE, [f"name={name!r}" if name.strip() != name or not name else f"name={name}"],
                    check_paths=False)


def test_ordinary_run_names_pass():
    for name in ("grpo_tiny", "run-2.b", "x y"):
        assert load_recipe(RECIPE, [f"name={name}"], check_paths=False).name == name
