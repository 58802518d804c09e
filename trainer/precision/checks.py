"""A precision recipe's record, worded for each consumer: the rules a recipe is loaded with, the launch and
model checks of the loop's setup, ``parityrl serve``'s and ``parityrl compare``'s refusals.

Every message names the key (or the command's setting), its value and what was expected, the record's
reason in parentheses.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from trainer.config import RecipeError, RunConfig
from trainer.precision.lora_sync import merged_reasons
from trainer.precision.record import (
    ASYNC,
    COMPARE,
    CUDA,
    HF_ENGINE,
    PROCESSES,
    SERVER,
    PrecisionRecipe,
)
from trainer.precision.registry import RECIPES, compare_choices

# (ok, key, value, expected): one rule's verdict, reported as "key = value: expected ..." when not ok.
Rule = tuple[bool, str, Any, str]


def dtype_rule(recipe: PrecisionRecipe, dtype: str, *, recipe_key: str = "precision.recipe",
               dtype_key: str = "model.dtype") -> Rule:
    """``dtype`` is one the recipe runs in; when not, the recipes that run in it are named."""
    others = [r.name for r in RECIPES.values() if dtype in r.dtypes and r is not recipe]
    hint = f"; {dtype} runs with {recipe_key} {' or '.join(others)}" if others else ""
    return (dtype in recipe.dtypes, dtype_key, dtype,
            f"{' or '.join(recipe.dtypes)} with {recipe_key} {recipe.name} ({recipe.dtype_reason}){hint}")


def hf_engine_rule(recipe: PrecisionRecipe, engine: Any, *, recipe_key: str = "precision.recipe",
                   engine_key: str = "rollout.engine") -> Rule:
    why = recipe.refuses.get(HF_ENGINE)
    return (why is None or engine != "hf", engine_key, engine, f"'vllm' with {recipe_key} {recipe.name} ({why})")


def cuda_rule(recipe: PrecisionRecipe, cuda: bool, *, recipe_key: str = "precision.recipe") -> Rule:
    why = recipe.refuses.get(CUDA)
    return (why is None or not cuda, recipe_key, recipe.name, f"a CPU run: {why}")


def recipe_rules(cfg: RunConfig, cuda: Optional[bool] = None) -> list[Rule]:
    """Every rule ``precision.recipe``'s record sets on the rest of a training recipe."""
    name, r = cfg.precision.recipe, cfg.rollout
    if name not in RECIPES:
        return [(False, "precision.recipe", name, f"one of {', '.join(RECIPES.names())} (trainer/precision/)")]
    recipe = RECIPES.get(name)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    refuses = recipe.refuses
    return [
        dtype_rule(recipe, cfg.model.dtype),
        hf_engine_rule(recipe, r.engine),
        (SERVER not in refuses or r.mode != "server", "rollout.mode", r.mode,
         f"'colocate' with precision.recipe {name} ({refuses.get(SERVER)})"),
        (ASYNC not in refuses or not r.max_staleness, "precision.recipe", name,
         f"not {name} with rollout.max_staleness {r.max_staleness} ({refuses.get(ASYNC)})"),
        cuda_rule(recipe, cuda),
        lora_sync_rule(cfg, recipe),
    ]


def lora_sync_rule(cfg: RunConfig, recipe: PrecisionRecipe) -> Rule:
    """An explicit ``rollout.lora_sync: adapter`` the engine can serve (``trainer.precision.lora_sync``)."""
    reasons = merged_reasons(cfg, recipe) if cfg.rollout.lora_sync == "adapter" else []
    return (not reasons, "rollout.lora_sync", cfg.rollout.lora_sync,
            f"'merged' (or 'auto', which falls back to it): the engine cannot serve this recipe's adapter "
            f"({'; '.join(reasons)})")


def check_recipe(cfg: RunConfig, need) -> None:
    """``trainer.config.validate``'s section for the recipe's record: every broken rule, not only the first
    (the rules are independent of each other)."""
    errors = []
    for rule in recipe_rules(cfg):
        try:
            need(*rule)
        except RecipeError as e:
            errors.append(e)
    if errors:
        raise RecipeError.several(errors)


def check_launch(recipe: PrecisionRecipe, *, stage: int, world_size: int) -> None:
    """RecipeError naming what the recipe does not run under: several processes, DeepSpeed ZeRO ``stage``."""
    problems = []
    key = f"precision.recipe = {recipe.name!r}"
    if world_size > 1 and PROCESSES in recipe.refuses:
        problems.append(RecipeError(f"{key}: launched with {world_size} processes; expected one process "
                                    f"({recipe.refuses[PROCESSES]})"))
    if stage and f"zero{stage}" in recipe.refuses:
        allowed = [f"DeepSpeed ZeRO stage {s}" for s in (2, 3) if f"zero{s}" not in recipe.refuses]
        problems.append(RecipeError(f"{key}: launched under DeepSpeed ZeRO stage {stage}; expected "
                                    f"{' or '.join(allowed + ['no DeepSpeed ZeRO'])} ({recipe.refuses[f'zero{stage}']})"))
    if problems:
        raise RecipeError.several(problems)


def check_model_config(recipe: PrecisionRecipe, config, *, where: str = "", model_path: Optional[str] = None) -> None:
    """RecipeError when the recipe cannot run a model of this config (``PrecisionRecipe.check_model``)."""
    if recipe.check_model is None:
        return
    try:
        recipe.check_model(config)
    except ValueError as e:
        at = f"{where}: " if where else ""
        model = f" with model.path = {model_path!r}" if model_path is not None else ""
        raise RecipeError(f"{at}precision.recipe = {recipe.name!r}{model}: {e}") from None


def server_problem(recipe: PrecisionRecipe) -> Optional[str]:
    """Why a server (``parityrl serve``) cannot run the recipe, naming those it can; None if it can."""
    why = recipe.refuses.get(SERVER)
    if why is None:
        return None
    served = " or ".join(repr(r.name) for r in RECIPES.values() if SERVER not in r.refuses)
    return f"precision.recipe = {recipe.name!r}: expected {served} in server mode ({why})"


def compare_rules(precision: str, *, engine: Any, dtype: str, cuda: Optional[bool] = None) -> list[Rule]:
    """``parityrl compare``'s ``precision`` setting against its ``engine`` and ``dtype``."""
    if precision not in RECIPES:
        return [(False, "precision", precision, f"one of {tuple(compare_choices())}")]
    recipe = RECIPES.get(precision)
    why = recipe.refuses.get(COMPARE)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return [
        (why is None, "precision", precision, f"not {precision!r} here: {why}"),
        dtype_rule(recipe, dtype, recipe_key="precision", dtype_key="dtype"),
        hf_engine_rule(recipe, engine, recipe_key="precision", engine_key="engine"),
        cuda_rule(recipe, cuda, recipe_key="precision"),
    ]
