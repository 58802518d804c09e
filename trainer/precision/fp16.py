"""``fp16``: both phases in FP16 ("Defeating the Training-Inference Mismatch via FP16")."""
from trainer.precision.record import PrecisionRecipe
from trainer.precision.registry import register_recipe

FP16 = register_recipe(PrecisionRecipe(
    name="fp16",
    doc="both phases FP16: 3 more mantissa bits than BF16 (Defeating the Training-Inference Mismatch via FP16)",
    dtypes=("float16",),
    dtype_reason="both phases run in FP16",
))
