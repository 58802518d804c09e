"""The parity level a healthy setup reaches: a precision recipe's floor for a dtype, grown with the model's depth
where the floor says the level grows (BF16, FP16, FP8). What `parityrl compare` prints beside its figures and what
`parityrl doctor` judges against.

How it grows: the probe mae measured 2e-3 on the 4-layer tiny model and 5e-2 on the 30-layer SmolLM2-135M in BF16
(``trainer.precision.record.MaeFloor``); a power law through both has exponent log(25) / log(7.5) = 1.6, applied
from the floors' depth (the tiny model's 4 layers) up.
"""
from __future__ import annotations

from trainer.precision.record import PrecisionRecipe

DEPTH_EXPONENT = 1.6
FLOOR_DEPTH = 4


def parity_level(recipe: PrecisionRecipe, dtype: str, num_layers: int) -> float:
    """The ``parity/mae`` a healthy run of ``recipe`` in ``dtype`` reaches on a model of ``num_layers`` layers."""
    floor = recipe.mae_floor[dtype]
    if floor.any_depth:
        return floor.mae
    return floor.mae * max(1.0, num_layers / FLOOR_DEPTH) ** DEPTH_EXPONENT
