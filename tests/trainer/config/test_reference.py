"""Every recipe key the schema defines is in README's "Recipe keys" table (trainer/config/reference.py)."""
from trainer.config.reference import _expand, documented_keys, recipe_keys


def test_every_recipe_key_is_documented():
    missing = sorted(set(recipe_keys()) - documented_keys())
    assert not missing, f"recipe keys missing from README's table: {missing}"


def test_the_table_reader_expands_shorthand():
    readme = ("### Recipe keys\n\n| key | default | meaning |\n|---|---|---|\n"
              "| `a.b.{x,y}` | 1 | m |\n| `c.p`, `q` | 2 | m |\n| `d.k_{u,v}` | 3 | m |\n\nafter\n| `e.f` | | |\n")
    assert documented_keys(readme) == {"a.b.x", "a.b.y", "c.p", "c.q", "d.k_u", "d.k_v"}
    assert _expand("plain") == ["plain"]
    assert "train.steps" in recipe_keys() and "algorithm.tau" in recipe_keys()  # sections and algorithm options
