"""``fp16``: both phases in FP16 ("Defeating the Training-Inference Mismatch via FP16")."""
from trainer.precision.record import MaeFloor, PrecisionRecipe
from trainer.precision.registry import register_recipe

FP16 = register_recipe(PrecisionRecipe(
    name="fp16",
    doc="both phases FP16: 3 more mantissa bits than BF16 (Defeating the Training-Inference Mismatch via FP16)",
    dtypes=("float16",),
    dtype_reason="both phases run in FP16",
    # bench/RESULTS.md "Precision recipes": the tiny model 1.2e-4 (compare), mean train-step mae 1.6e-4
    # over 30 demo steps; ~8x below BF16 at every depth measured: BF16's floor 4e-3 / 8.
    mae_floor={"float16": MaeFloor(5e-4, any_depth=False)},
))
