"""``fp8_rollout``: a BF16 trainer and an FP8 engine (the common verl / slime / NeMo-RL setup; the baseline
``fp8_unified`` is measured against). Its FP8 engine is ``fp8_unified``'s too (``FP8_ENGINE``)."""
from rollout.engine_options import block_fp8_kwargs, emulated_fp8_kwargs
from trainer.precision.record import HF_ENGINE, SERVER, MaeFloor, PrecisionRecipe
from trainer.precision.registry import register_recipe


def fp8_engine_options(cuda: bool) -> dict:
    """vLLM's block-FP8 layers on CUDA; on CPU, which has no FP8 kernels, the emulating plug-in."""
    return block_fp8_kwargs() if cuda else emulated_fp8_kwargs()


# What every recipe with an FP8 engine shares: BF16 master weights, the engine options, the weight
# format on CUDA, and what such an engine cannot be.
FP8_ENGINE = dict(
    dtypes=("bfloat16",),
    dtype_reason="BF16 master weights; the FP8 layers dequantize to BF16",
    engine_options=fp8_engine_options,
    block_fp8_on_cuda=True,
    # bench/RESULTS.md "Precision recipes", tiny model: fp8_rollout 5.9e-3 (compare), mean train-step
    # mae 5.5e-3 (both recipes); fp8_unified's probe rose to 1.8e-2 after step 6 of a healthy run
    # with the engine's FP8 weights bitwise the trainer's; the doctor's fp8_rollout row reads 3.2e-3 on the tiny
    # model built on an AMX host and 1.27e-2 on the one built on an AVX2-only host (the warm start's rounding
    # makes another model there). 2e-2: the largest a healthy run reached, rounded up, so "normal" holds for
    # every build of the model and the 3x WARN band above it still separates a broken FP8 path (docs/doctor.md).
    mae_floor={"bfloat16": MaeFloor(2e-2, any_depth=False)},
    merged_sync="the FP8 engine quantizes the effective weight W + s·B·A into 128x128 blocks, which an adapter "
                "served beside FP8 base weights does not reproduce",
    refuses={HF_ENGINE: "the HF engine has no FP8 path",
             SERVER: "the server is started without the FP8 weights and layers"},
)

FP8_ROLLOUT = register_recipe(PrecisionRecipe(
    name="fp8_rollout",
    doc="BF16 trainer, FP8 engine (E4M3, 128x128 weight blocks, 1x128 activation groups): the mismatched baseline",
    **FP8_ENGINE,
))
