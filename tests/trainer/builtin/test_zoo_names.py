"""The architecture zoo's models by name (``builtin:zoo-<architecture>``): accepted by a recipe, resolved to the built
model, refused with the list of names when misspelt."""
import pytest

from trainer.builtin.model_path import BUILTIN_MODELS, builtin_max_positions, check_model_path
from trainer.builtin.resolve import resolve_model_path
from trainer.builtin.zoo import ZOO_MODELS, ensure_arch_model
from trainer.config import RecipeError


def test_every_zoo_architecture_has_a_builtin_name():
    assert set(ZOO_MODELS.values()) >= {"qwen2", "qwen3", "gemma2", "qwen2_moe", "qwen3_moe", "mixtral", "olmoe"}
    assert all(name in BUILTIN_MODELS and builtin_max_positions(name) == 256 for name in ZOO_MODELS)
    check_model_path("builtin:zoo-qwen3_moe", "recipe x")
    with pytest.raises(RecipeError, match=r"model.path = 'builtin:zoo-qwen4': unknown built-in model; expected one "
                                          r"of builtin:tiny, .*builtin:zoo-qwen3_moe"):
        check_model_path("builtin:zoo-qwen4", "recipe x")


def test_a_zoo_name_resolves_to_the_zoo_model(tmp_path, monkeypatch):
    monkeypatch.setenv("PARITYRL_CACHE", str(tmp_path))
    assert resolve_model_path("builtin:zoo-qwen2") == str(ensure_arch_model("qwen2", dtype="float32"))
    assert resolve_model_path("builtin:zoo-qwen2").startswith(str(tmp_path))
