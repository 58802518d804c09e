"""The warm-started built-ins' cache keys (trainer/builtin/warm_start.py): each is keyed by everything that decides
the model -- its recipe, the model it starts from (so changing builtin:tiny rebuilds builtin:tiny-tools), its data
functions' and dataset's code, the supervised trainer's code -- and by nothing about where the cache is; nothing is
built here."""
import pytest

from trainer.builtin import warm_start
from trainer.builtin.model_path import BUILTIN_MODELS, builtin_max_positions
from trainer.builtin.tiny import default_cache_dir
from trainer.config.supervised import read_sft_recipe


def test_builtin_tiny_lives_in_the_cache_under_its_key():
    assert warm_start.warm_start_dir() == warm_start.warm_start_dir("builtin:tiny") == \
        default_cache_dir() / f"tiny-sft-{warm_start.build_key('builtin:tiny')}"


def test_the_key_does_not_depend_on_where_the_cache_is(monkeypatch, tmp_path):
    here = {n: warm_start.warm_start_dir(n).name for n in warm_start.WARM_STARTS}
    monkeypatch.setenv("PARITYRL_CACHE", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"
    assert {n: warm_start.warm_start_dir(n).name for n in warm_start.WARM_STARTS} == here


def test_the_data_code_is_the_recipes_data_functions_and_dataset_modules():
    tasks = warm_start.REPO_ROOT / "trainer" / "data" / "tasks"
    assert warm_start.data_code(warm_start.WARM_STARTS["builtin:tiny"].recipe) == [tasks / "arithmetic.py"]
    assert warm_start.data_code(warm_start.WARM_STARTS["builtin:tiny-tools"].recipe) == [tasks / "arithmetic_tools.py"]


@pytest.mark.parametrize("part", ["data", "build"])
def test_an_edit_to_the_data_or_build_code_changes_every_key_downstream(monkeypatch, tmp_path, part):
    before = {n: warm_start.build_key(n) for n in warm_start.WARM_STARTS}
    if part == "data":  # an edited data function (e.g. the share of direct answers) in builtin:tiny-tools' module
        edited = tmp_path / "arithmetic_tools.py"
        real = warm_start.data_code
        edited.write_bytes(real(warm_start.WARM_STARTS["builtin:tiny-tools"].recipe)[0].read_bytes() + b"\n# edit\n")
        monkeypatch.setattr(warm_start, "data_code",
                            lambda recipe: [edited if f.name == edited.name else f for f in real(recipe)])
        changed = {"builtin:tiny-tools", "builtin:tiny-tools-teacher"}  # the teacher starts from tiny-tools
    else:
        edited = tmp_path / "sft.py"
        edited.write_bytes(warm_start.BUILD_CODE[0].read_bytes() + b"\n# edit\n")
        monkeypatch.setattr(warm_start, "BUILD_CODE", (edited, *warm_start.BUILD_CODE[1:]))
        changed = set(warm_start.WARM_STARTS)
    after = {n: warm_start.build_key(n) for n in warm_start.WARM_STARTS}
    assert {n for n in before if before[n] != after[n]} == changed


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
