"""``bf16``: both phases in the model dtype, BF16 (or float32 for CPU reference runs); the default."""
from trainer.precision.record import FLOAT32_FLOOR, MaeFloor, PrecisionRecipe
from trainer.precision.registry import register_recipe

BF16 = register_recipe(PrecisionRecipe(
    name="bf16",
    doc="both phases BF16 (or float32), no quantization: the baseline every recipe's parity is read against",
    dtypes=("bfloat16", "float32"),
    dtype_reason="both phases run in model.dtype",
    # BF16, the tiny model's probe (vLLM CPU vs HF, 2026-11-25): the demo's read 1.6e-4 to 6.8e-3 after
    # its syncs (median 2.8e-3; `parityrl compare` ~2e-3 at 4 layers); at lr 2e-2, 10x the demo's, one
    # healthy run went from below 2e-3 to 1.16e-2 in one sync. 5 x 4e-3 = 2e-2 leaves 1.7x over that;
    # a skipped sync reads 0.16. Deeper models sit higher (5e-2 at 30 layers): their own level sets
    # their limit.
    mae_floor={"bfloat16": MaeFloor(4e-3, any_depth=False),
               "float32": FLOAT32_FLOOR},
))
