"""``exact``: the trainer's log-probs are the engine's, bit for bit (``trainer.models.exact``; the vLLM +
TorchTitan bitwise RL work, vLLM blog 2025-11-10)."""
from rollout.engine_forward import check_supported
from rollout.engine_options import exact_kwargs
from trainer.precision.record import (
    COMPARE,
    CUDA,
    HF_ENGINE,
    PROCESSES,
    SERVER,
    ZERO2,
    ZERO3,
    MaeFloor,
    PrecisionRecipe,
)
from trainer.precision.registry import register_recipe

_CUDA = ("on CUDA the engine's kernels are vLLM's batch-invariant Triton ops and GPU attention, which the "
         "trainer side does not call (trainer/models/exact.py)")
_ONE_PROCESS = "exact mode is single-process for now"


def exact_engine_options(cuda: bool) -> dict:
    if cuda:
        raise ValueError(f"precision.recipe = 'exact': CPU only ({_CUDA})")
    return exact_kwargs()


EXACT = register_recipe(PrecisionRecipe(
    name="exact",
    doc="the engine's own kernels on both sides, batch-invariant: parity/mae = 0 (vLLM blog 2025-11-10)",
    dtypes=("float32", "bfloat16"),
    dtype_reason="the engine's CPU kernels, rerun by the trainer, in float32 or BF16",
    engine_options=exact_engine_options,
    engine_logprobs=True,
    merged_sync="the trainer's forward reruns the engine's kernels on the engine's own weights, which hold the "
                "merged LoRA",
    # Bitwise: every probe reads 0 (tests/trainer/rl/test_exact_tier.py), so any mae above 0 is a fault.
    mae_floor=dict.fromkeys(("float32", "bfloat16"),
                            MaeFloor(0.0, any_depth=True)),
    refuses={HF_ENGINE: "it reruns vLLM's kernels",
             SERVER: "the trainer reads the engine's rotary tables and kernel choices in-process",
             CUDA: _CUDA,
             PROCESSES: _ONE_PROCESS, ZERO2: _ONE_PROCESS, ZERO3: _ONE_PROCESS,
             COMPARE: "compare scores with the trainer's HF forward; exact mode's figures are the training run's "
                      "parity/* (docs/precision.md \"Exact mode\")"},
    check_model=check_supported,
))
