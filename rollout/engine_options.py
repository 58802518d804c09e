"""Building blocks of what ``VLLMEngine(**kwargs)`` needs beyond its dtype, for the numerics a run asks of it.

Each precision recipe composes its engine options from these (``trainer/precision/``: a record's
``engine_options(cuda)``); this module names no recipe.

- ``exact_kwargs()`` (CPU only): ``quantization="parityrl_exact"`` (``rollout.vllm_plugins.exact_quant``):
  vLLM's own kernels made invariant to the batch, which the trainer reruns
  (``rollout.engine_forward``, ``trainer.models.exact``);
- ``emulated_fp8_kwargs()`` (CPU): ``quantization="parityrl_fp8_emulated"``
  (``rollout.vllm_plugins.fp8_quant``): the engine quantizes the BF16 weights it is sent
  with ``parity.precision``. Weight sync is unchanged (merged BF16 weights,
  ``rollout.weight_export``);
- ``block_fp8_kwargs()`` (CUDA): ``quantization="fp8"``, vLLM's own block-FP8 linear layers,
  started from a block-FP8 checkpoint and synced in that format (``rollout.fp8_weights``).

Asking for a plug-in's method imports the plug-in, which registers it with vLLM in this
process (the engine is in-process). Needs no vLLM import otherwise.
"""
from __future__ import annotations

from rollout.vllm_plugins.names import EMULATED_FP8, EXACT

__all__ = ["block_fp8_kwargs", "emulated_fp8_kwargs", "exact_kwargs"]


def exact_kwargs() -> dict:
    """vLLM's CPU kernels made batch-invariant, rerun by ``rollout.engine_forward``."""
    # late: importing the plug-in imports vLLM and registers EXACT with it
    import rollout.vllm_plugins.exact_quant  # noqa: F401

    return {"quantization": EXACT}


def emulated_fp8_kwargs() -> dict:
    """The emulated FP8 linear layers (quantize -> dequantize -> BF16 matmul) of ``parity.precision``."""
    # late: importing the plug-in imports vLLM and registers EMULATED_FP8 with it
    import rollout.vllm_plugins.fp8_quant  # noqa: F401

    return {"quantization": EMULATED_FP8}


def block_fp8_kwargs() -> dict:
    """vLLM's own block-FP8 layers (CUDA), loading the checkpoint ``rollout.fp8_weights`` writes."""
    return {"quantization": "fp8"}
