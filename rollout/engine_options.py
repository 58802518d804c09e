"""What ``VLLMEngine(**kwargs)`` needs for each precision recipe, beyond its dtype.

``engine_llm_kwargs(recipe, cuda=...)``:

- ``bf16``/``fp16``: nothing (the dtype is the engine's ``dtype`` argument);
- ``exact`` (CPU only): ``quantization="parityrl_exact"`` (``rollout.vllm_plugins.exact_quant``):
  vLLM's own kernels made invariant to the batch, which the trainer reruns
  (``rollout.engine_forward``, ``trainer.models.exact``);
- ``fp8_rollout``/``fp8_unified`` on CPU: ``quantization="parityrl_fp8_emulated"``
  (``rollout.vllm_plugins.fp8_quant``): the engine quantizes the BF16 weights it is sent
  with ``parity.precision``. Weight sync is unchanged (merged BF16 weights,
  ``rollout.weight_export``);
- the same recipes on CUDA: ``quantization="fp8"``, vLLM's own block-FP8 linear layers,
  started from a block-FP8 checkpoint and synced in that format (``rollout.fp8_weights``).

Asking for a plug-in's method imports the plug-in, which registers it with vLLM in this
process (the engine is in-process). Needs no vLLM import otherwise.
"""
from __future__ import annotations

from rollout.vllm_plugins.names import EMULATED_FP8, EXACT

__all__ = ["FP8_RECIPES", "PRECISION_RECIPES", "engine_llm_kwargs"]

FP8_RECIPES = ("fp8_rollout", "fp8_unified")
# exact: the model dtype on both phases and the trainer rerunning the engine's kernels (trainer.models.exact).
PRECISION_RECIPES = ("bf16", "fp16", "exact") + FP8_RECIPES


def engine_llm_kwargs(recipe: str, *, cuda: bool) -> dict:
    """Extra ``VLLMEngine`` keyword arguments for a precision recipe (see module docstring)."""
    if recipe not in PRECISION_RECIPES:
        raise ValueError(f"precision.recipe = {recipe!r}: expected one of {PRECISION_RECIPES}")
    if recipe == "exact":
        if cuda:
            raise ValueError("precision.recipe = 'exact': CPU only (trainer/models/exact.py says why)")
        # late: importing the plug-in imports vLLM and registers EXACT with it
        import rollout.vllm_plugins.exact_quant  # noqa: F401

        return {"quantization": EXACT}
    if recipe not in FP8_RECIPES:
        return {}
    if cuda:
        return {"quantization": "fp8"}
    # late: importing the plug-in imports vLLM and registers EMULATED_FP8 with it
    import rollout.vllm_plugins.fp8_quant  # noqa: F401

    return {"quantization": EMULATED_FP8}
