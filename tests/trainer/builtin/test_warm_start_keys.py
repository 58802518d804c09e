"""The warm-started built-ins' cache keys (trainer/builtin/warm_start.py): each is keyed by its recipe and by the
model it starts from, so changing builtin:tiny rebuilds builtin:tiny-tools; nothing is built here."""
import hashlib

import pytest

from trainer.builtin import warm_start
from trainer.builtin.model_path import BUILTIN_MODELS, builtin_max_positions
from trainer.builtin.tiny import default_cache_dir, tiny_base_dir
from trainer.config.supervised import read_sft_recipe


def test_builtin_tiny_key_is_its_recipe_and_the_base_build():
    recipe = warm_start.REPO_ROOT / "recipes" / "sft_tiny.yaml"
    key = hashlib.sha256(recipe.read_bytes() + str(tiny_base_dir()).encode() + b"2").hexdigest()[:12]
    assert warm_start.warm_start_dir() == warm_start.warm_start_dir("builtin:tiny") == default_cache_dir() / f"tiny-sft-{key}"


def test_tiny_tools_is_keyed_by_builtin_tiny(monkeypatch, tmp_path):
    tools = warm_start.warm_start_dir("builtin:tiny-tools")
    assert tools.name.startswith("tiny-tools-sft-") and tools.parent == default_cache_dir()
    changed = tmp_path / "sft_tiny.yaml"
    changed.write_bytes(warm_start.WARM_START_RECIPE.read_bytes() + b"# changed\n")
    tiny = warm_start.WARM_STARTS["builtin:tiny"]
    monkeypatch.setitem(warm_start.WARM_STARTS, "builtin:tiny", warm_start.WarmStart(
        tiny.name, changed, tiny.base, tiny.prefix, tiny.what))
    assert warm_start.warm_start_dir("builtin:tiny-tools") != tools


def test_each_recipe_starts_from_the_model_its_key_names():
    for ws in warm_start.WARM_STARTS.values():
        assert read_sft_recipe(ws.recipe).model.path == ws.base
    assert "builtin:tiny-tools" in BUILTIN_MODELS and builtin_max_positions("builtin:tiny-tools") == 256


def test_unknown_warm_start():
    with pytest.raises(ValueError, match="expected one of builtin:tiny, builtin:tiny-tools"):
        warm_start.warm_start_dir("builtin:tiny-base")
