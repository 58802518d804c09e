"""Recipes: the schema (typed dataclasses per section), loading (YAML + overrides) and validation.

A recipe is a YAML file (see ``recipes/``) plus ``--set key=value`` overrides.
Reading checks, before anything heavy starts: unknown keys, wrong types,
impossible values and cross-field contradictions (the files and models a recipe
names are checked by ``trainer.lifecycle.preflight``). Each problem is reported
with the file (or the ``--set`` that gave the value), the dotted key, the
value and what was expected; an unknown key with the valid one closest to it.
"""
from trainer.config.load import build_config, load_recipe_dict, parse_override, read_recipe, read_recipe_leniently
from trainer.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    CorrectionSection,
    DataConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    ParityConfig,
    PrecisionConfig,
    RecipeError,
    RewardConfig,
    RewardModelEntry,
    RolloutConfig,
    RunConfig,
    TeacherConfig,
    TrainConfig,
    WandbConfig,
)
from trainer.config.validate import to_dict, validate

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "CorrectionSection", "DataConfig", "LoggingConfig", "LoraConfig",
    "ModelConfig", "ParityConfig", "PrecisionConfig", "RecipeError", "RewardConfig", "RewardModelEntry",
    "RolloutConfig", "RunConfig", "TeacherConfig", "TrainConfig", "WandbConfig", "build_config",
    "load_recipe_dict", "parse_override", "read_recipe", "read_recipe_leniently", "to_dict", "validate",
]
