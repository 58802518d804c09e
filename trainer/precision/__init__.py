"""Precision recipes as records: one ``record.PrecisionRecipe`` per name, registered by the module named after it.

Importing this package registers every built-in recipe. A consumer does
``recipe = recipe_for(cfg.precision.recipe)`` and asks it (``checks`` words its refusals for each
consumer); no file outside this package branches on a recipe's name. Adding a recipe is one module
here (imported below) and its test (docs/precision.md "Adding a precision recipe").
"""
from trainer.precision import bf16, exact, fp8_rollout, fp8_unified, fp16  # noqa: F401  (register them)
from trainer.precision.record import PrecisionRecipe
from trainer.precision.registry import DEFAULT_RECIPE, RECIPES, compare_choices, recipe_for, register_recipe

__all__ = ["DEFAULT_RECIPE", "RECIPES", "PrecisionRecipe", "compare_choices", "recipe_for", "register_recipe"]
