"""The precision-recipe registry: one ``record.PrecisionRecipe`` per name.

A new recipe is one module of this package: its record and one ``register_recipe(...)``, imported
by ``trainer/precision/__init__.py``. The recipe loader, the engine construction and sync, the loop,
``parityrl serve`` and ``parityrl compare`` (its ``--precision`` choices too) look the record up by
``precision.recipe`` and ask it, never the name.
"""
from __future__ import annotations

from trainer.algorithms.registry import Registry
from trainer.precision.record import COMPARE, PrecisionRecipe

# The recipe a run gets without precision.recipe (trainer.config.schema.PrecisionConfig's default: the
# schema sits below this package and cannot ask it; a test holds the two equal).
DEFAULT_RECIPE = "bf16"

RECIPES: Registry[PrecisionRecipe] = Registry("precision recipe", accepts=lambda r: isinstance(r, PrecisionRecipe),
                                              expected="a record.PrecisionRecipe")


def register_recipe(record: PrecisionRecipe) -> PrecisionRecipe:
    """Register ``record`` under its name; a duplicate name is refused (import order must not pick one)."""
    return RECIPES.register(record.name)(record)


def recipe_for(name: str) -> PrecisionRecipe:
    """The record named ``name``; ValueError listing the registered names otherwise."""
    return RECIPES.get(name)


def compare_choices() -> list[str]:
    """The recipes `parityrl compare --precision` takes: those that do not refuse compare."""
    return [r.name for r in RECIPES.values() if COMPARE not in r.refuses]
