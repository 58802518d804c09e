"""Rollout engines behind one interface (``rollout.base.RolloutEngine``) and the weight sync into them.

- ``VLLMEngine``: in-process vLLM, the default (``rollout.vllm_engine``).
- ``HFEngine``: Transformers ``generate``, the reference and fallback (``rollout.hf_engine``).
- ``ServerEngine``: a separate vLLM server (``rollout.server_engine``).
- The rules every engine applies: requests (``rollout.requests``), weight updates into vLLM
  (``rollout.weight_updates``), what is read from a model directory (``rollout.model_files``).
- ``merged_lora_weights`` / ``full_weights``: what a sync sends (``rollout.weight_export``);
  the CUDA FP8 format of it (``rollout.fp8_weights``).
- Each precision recipe's engine options (``rollout.engine_options``); the engine's CPU forward
  rerun for exact mode (``rollout.engine_forward``); code that runs inside vLLM
  (``rollout.vllm_plugins``).

Nothing here imports vllm or transformers until an engine is built.
"""
from rollout.hf_engine import HFEngine
from rollout.types import Rollouts, SamplingSpec
from rollout.vllm_engine import VLLMEngine
from rollout.weight_export import full_weights, iter_merged_lora_weights, merged_lora_weights, payload_bytes

__all__ = [
    "HFEngine",
    "Rollouts",
    "SamplingSpec",
    "VLLMEngine",
    "full_weights",
    "iter_merged_lora_weights",
    "merged_lora_weights",
    "payload_bytes",
]
