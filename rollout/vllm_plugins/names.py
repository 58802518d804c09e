"""The names the plug-ins register with vLLM, and the decoder-layer pattern FP8 covers.

Apart from the plug-ins so that code choosing an engine's options (``rollout.engine_options``) or
writing FP8 weights (``rollout.fp8_weights``) reads them without importing vLLM: importing a
plug-in imports vLLM and registers it.
"""
import re

EMULATED_FP8 = "parityrl_fp8_emulated"  # registered with vLLM by importing rollout.vllm_plugins.fp8_quant
EXACT = "parityrl_exact"  # registered with vLLM by importing rollout.vllm_plugins.exact_quant
# FP8 covers the linear layers inside the decoder blocks only (embeddings and lm_head stay in BF16)
DECODER_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")
# A vision-language model's image encoder, whose blocks are "layers" too (Idefics3 / SmolVLM:
# model.vision_model.encoder.layers.N; Qwen-VL: visual; LLaVA: vision_tower), with q/k/v_proj leaves: FP8 leaves it
# in BF16, as the trainer's FP8 layers do (they convert the language model's blocks only, trainer.models.precision)
# and as peers keep it (ignored_layers); on CUDA the checkpoint lists it in ignored_layers
VISION_TOWER = re.compile(r"(?:^|\.)(vision_model|vision_tower|visual)\.")
