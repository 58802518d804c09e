"""A warm start is judged before it is cached (trainer/measurement/warm_start_floor.py, in its own process): its held-out greedy accuracy on
its RL recipe's eval rows, against its floor. The training is stood in for by the untrained tiny base (greedy
accuracy 0 on arithmetic), so a floor above 0 is a planted weak build; the judgement itself is real (the recipe's
rows, reward and the Hugging Face engine's greedy completions)."""
import shutil

import pytest

from trainer.builtin import warm_start
from trainer.builtin.tiny import ensure_tiny_base
from trainer.builtin.warm_start import BelowFloor
from trainer.measurement.warm_start_floor import held_out_greedy

GRPO_TINY = warm_start.REPO_ROOT / "recipes" / "grpo_tiny.yaml"


@pytest.fixture
def untrained_build(monkeypatch, tmp_path):
    """builtin:tiny's build in an empty cache, its training replaced by a copy of the untrained base."""
    monkeypatch.setenv("PARITYRL_CACHE", str(tmp_path / "cache"))

    def copy_base(cfg, base_dir):
        shutil.copytree(base_dir, cfg.out_path)
        return cfg.out_path

    monkeypatch.setattr(warm_start, "fit_sft", copy_base)

    def with_floor(floor: float) -> None:
        tiny = warm_start.WARM_STARTS["builtin:tiny"]
        monkeypatch.setitem(warm_start.WARM_STARTS, "builtin:tiny", warm_start.WarmStart(
            tiny.name, tiny.recipe, tiny.base, tiny.prefix, tiny.what, floor_recipe=GRPO_TINY, floor_greedy=floor))
    return with_floor


def test_the_untrained_base_solves_nothing():
    assert held_out_greedy(GRPO_TINY, ensure_tiny_base()) == 0.0


@pytest.mark.slow  # the judgement runs in its own process (about 10 s)
def test_a_build_below_its_floor_fails_with_one_line_and_is_not_cached(untrained_build):
    untrained_build(0.05)
    with pytest.raises(BelowFloor) as e:
        warm_start.ensure_warm_started("builtin:tiny")
    assert "\n" not in str(e.value) and e.value.exit_status == 10
    assert str(e.value).startswith("builtin:tiny: the warm start came out at held-out greedy accuracy 0.000, below "
                                   "its floor 0.05 (grpo_tiny.yaml's eval rows); not cached")
    out = warm_start.warm_start_dir("builtin:tiny")
    assert not out.exists() and [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")] == \
        [f".{out.name}.lock"]  # no scratch left beside the lock


@pytest.mark.slow  # the judgement runs in its own process (about 10 s)
def test_a_build_at_its_floor_is_cached_with_its_figure(untrained_build, capsys):
    untrained_build(0.0)
    out = warm_start.ensure_warm_started("builtin:tiny")
    assert (out / "config.json").is_file()
    assert "built the default model: held-out greedy accuracy 0.000 on grpo_tiny.yaml's eval rows (floor 0.00)" \
        in capsys.readouterr().out


def test_every_built_in_warm_start_has_a_floor_on_an_rl_recipe_of_its_task():
    for ws in warm_start.WARM_STARTS.values():
        assert ws.floor_recipe is not None and ws.floor_recipe.is_file() and 0 < ws.floor_greedy < 1, ws.name
