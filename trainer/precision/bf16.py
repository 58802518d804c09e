"""``bf16``: both phases in the model dtype, BF16 (or float32 for CPU reference runs); the default."""
from trainer.precision.record import PrecisionRecipe
from trainer.precision.registry import register_recipe

BF16 = register_recipe(PrecisionRecipe(
    name="bf16",
    doc="both phases BF16 (or float32), no quantization: the baseline every recipe's parity is read against",
    dtypes=("bfloat16", "float32"),
    dtype_reason="both phases run in model.dtype",
))
