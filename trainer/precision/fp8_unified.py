"""``fp8_unified``: both phases run the same FP8 linear layers, one quantizer (``parity.precision``); Jet-RL
(arXiv 2601.14243). The engine is ``fp8_rollout``'s; the trainer's decoder linears become FP8 layers."""
from trainer.config.schema import RecipeError
from trainer.models.precision import convert_to_fp8
from trainer.precision.fp8_rollout import FP8_ENGINE
from trainer.precision.record import ZERO3, PrecisionRecipe
from trainer.precision.registry import register_recipe


def fp8_layers(model):
    """The trainer's decoder linears run the engine's FP8 forward (quantized merged LoRA weight, quantized
    activations), after ``add_lora``. A model whose layers cannot run them is refused naming the recipe."""
    try:
        convert_to_fp8(model)
    except ValueError as e:  # RecipeError included
        raise RecipeError(f"precision.recipe = 'fp8_unified': {e}") from None
    return model


FP8_UNIFIED = register_recipe(PrecisionRecipe(
    name="fp8_unified",
    doc="both phases the same FP8 linear layers, one quantizer (Jet-RL, arXiv 2601.14243)",
    transform=fp8_layers,
    **{**FP8_ENGINE, "refuses": {
        **FP8_ENGINE["refuses"],
        # ZeRO-2 does not partition weights: allowed (tested against data parallel).
        ZERO3: "the trainer's FP8 LoRA layers read their weights directly to merge and quantize them, without "
               "calling those submodules, so ZeRO-3's per-module hooks leave them partitioned; use ZeRO-2 "
               "(recipes/accelerate/zero2.yaml) or data parallel (ddp.yaml / torchrun)"}},
))
