"""Recipes: the schema (typed dataclasses per section), loading (YAML + overrides) and validation.

A recipe is a YAML file (see ``recipes/``) plus ``--set key=value`` overrides.
Loading checks, before anything heavy starts: unknown keys, wrong types,
impossible values and cross-field contradictions. Each problem is reported
with the file, the dotted key, the value and what was expected.
"""
from trainer.config.load import build_config, load_recipe, load_recipe_dict, parse_override
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
    TrainConfig,
    WandbConfig,
)
from trainer.config.validate import check_model_path, correction_config, model_max_positions, to_dict, validate

__all__ = [
    "AlgorithmConfig", "CheckpointConfig", "CorrectionSection", "DataConfig", "LoggingConfig", "LoraConfig",
    "ModelConfig", "ParityConfig", "PrecisionConfig", "RecipeError", "RewardConfig", "RewardModelEntry",
    "RolloutConfig", "RunConfig", "TrainConfig", "WandbConfig", "build_config", "check_model_path",
    "correction_config", "load_recipe", "load_recipe_dict", "model_max_positions", "parse_override", "to_dict",
    "validate",
]
