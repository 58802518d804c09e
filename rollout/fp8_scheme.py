"""Names the FP8 export (rollout.fp8_export) and vLLM's emulated-FP8 method (rollout.fp8_quant) agree on.

Kept apart from both so that neither imports the other for them: the export must import
without vLLM, and the quantization method registers itself with vLLM on import.
"""
import re

EMULATED_FP8 = "parityrl_fp8_emulated"  # registered with vLLM by importing rollout.fp8_quant
EXACT = "parityrl_exact"  # registered with vLLM by importing rollout.exact_quant
# FP8 covers the linear layers inside the decoder blocks only (embeddings and lm_head stay in BF16)
DECODER_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")
