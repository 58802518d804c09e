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
  started from a block-FP8 checkpoint and synced in that format (``rollout.fp8_weights``), on the
  CUTLASS kernel: ``kernel_config.linear_backend_per_quant`` pins it for block-FP8 layers only (vLLM's
  ``_get_linear_backend``, ``vllm/model_executor/kernels/linear/__init__.py``), because its activation
  quantizer is ``parity.precision``'s and vLLM's default kernels on Hopper/Blackwell (FlashInfer,
  DeepGEMM) quantize differently (``rollout.fp8_weights`` says how). The pinned backend filters the
  candidates rather than preferring one: where CUTLASS cannot run, vLLM fails to start ("Failed to find a
  kernel") instead of picking another quantizer; the engine also checks the kernel each layer got.

Asking for a plug-in's method imports the plug-in, which registers it with vLLM in this
process (the engine is in-process). Needs no vLLM import otherwise.
"""
from __future__ import annotations

from rollout.fp8_weights import FP8_LINEAR_BACKEND, FP8_LINEAR_QUANT_KEY
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
    """vLLM's own block-FP8 layers (CUDA) on the CUTLASS kernel, loading the checkpoint ``rollout.fp8_weights`` writes."""
    return {"quantization": "fp8",
            "kernel_config": {"linear_backend_per_quant": {FP8_LINEAR_QUANT_KEY: FP8_LINEAR_BACKEND}}}
