"""Every recipe key the schema defines is in its command's table of docs/recipe-keys.md (trainer/config/reference.py)."""
import pytest

from trainer.config.reference import TABLES, _expand, documented_keys, main, recipe_keys


@pytest.mark.parametrize("command", sorted(TABLES))
def test_every_recipe_key_is_documented(command, capsys):
    missing = sorted(set(recipe_keys(command)) - documented_keys(section=TABLES[command][0]))
    assert not missing, f"{command} recipe keys missing from docs/recipe-keys.md: {missing}"
    assert main([command]) == 0 and "UNDOCUMENTED" not in capsys.readouterr().out


def test_the_table_reader_expands_shorthand():
    page = ("## parityrl train\n\n| key | default | meaning |\n|---|---|---|\n"
              "| `a.b.{x,y}` | 1 | m |\n| `c.p`, `q` | 2 | m |\n| `d.k_{u,v}` | 3 | m |\n\nafter\n| `e.f` | | |\n")
    assert documented_keys(page) == {"a.b.x", "a.b.y", "c.p", "c.q", "d.k_u", "d.k_v"}
    assert _expand("plain") == ["plain"]
    assert "train.steps" in recipe_keys() and "algorithm.tau" in recipe_keys()  # sections and algorithm options
    assert "train.micro_batch_size" in recipe_keys("sft") and "train.eval_every" in recipe_keys("train-rm")
