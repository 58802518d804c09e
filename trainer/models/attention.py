"""``model.attn_implementation``: which Transformers attention kernel the trainer's model runs, checked at load.

The rule of what an architecture *needs* lives in one place, ``rollout.hf_engine.attention_implementation``
(Gemma2's ``attn_logit_softcapping`` is applied by the eager attention only: ``sdpa_attention_forward``
ignores ``softcap``); this module adds the recipe's choice on top of it and refuses what cannot run:

- null: what the architecture needs (eager), else Transformers' default (SDPA where the model has it);
- "eager" / "sdpa": as asked, "sdpa" refused where the architecture needs eager;
- "flash_attention_2": refused where the architecture needs eager (the rule above is written for the
  kernels that drop the softcap, and parityrl only trusts eager there), without the ``flash_attn``
  package, off CUDA, or in float32 (the kernels run fp16/bf16 only).

Refused with a ``RecipeError`` naming the key before the model loads, so before any engine starts.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from rollout.hf_engine import attention_implementation
from trainer.config.schema import RecipeError

ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2")
KEY = "model.attn_implementation"


def flash_attn_available() -> bool:
    """Whether the ``flash_attn`` package is importable (without importing it: it loads CUDA kernels)."""
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attn_implementation(config, requested: Optional[str], *, dtype: str, device) -> Optional[str]:
    """The ``attn_implementation`` to load the model with (None: Transformers' default), or a RecipeError.

    ``config``: the model's HF config; ``device``: where the model trains (a torch device or its name).
    """
    needs = attention_implementation(config)  # "eager" or None
    if requested is None:
        return needs
    if requested not in ATTN_IMPLEMENTATIONS:
        raise RecipeError(f"{KEY} = {requested!r}: expected null or one of {', '.join(ATTN_IMPLEMENTATIONS)}")
    arch = type(config).__name__.removesuffix("Config")
    if needs == "eager" and requested != "eager":
        raise RecipeError(f"{KEY} = {requested!r}: expected null or 'eager' for {arch}: its attention logit softcap "
                          "(attn_logit_softcapping) is applied by the eager attention only, and the rollout engine "
                          "applies it")
    if requested == "flash_attention_2":
        if not flash_attn_available():
            raise RecipeError(f"{KEY} = 'flash_attention_2': the flash_attn package is not importable "
                              "(pip install flash-attn); expected 'sdpa', 'eager' or null")
        if torch.device(device).type != "cuda":
            raise RecipeError(f"{KEY} = 'flash_attention_2': the model trains on {torch.device(device).type}, "
                              "FlashAttention-2 runs on CUDA only; expected 'sdpa', 'eager' or null")
        if dtype == "float32":
            raise RecipeError(f"{KEY} = 'flash_attention_2' with model.dtype = 'float32': FlashAttention-2 runs "
                              "float16/bfloat16 only; expected model.dtype bfloat16 or float16, or another attention")
    return requested


def attn_kwargs(config, requested: Optional[str], *, dtype: str, device) -> dict:
    """``from_pretrained`` keyword arguments for ``resolve_attn_implementation``'s choice ({} for the default)."""
    attn = resolve_attn_implementation(config, requested, dtype=dtype, device=device)
    return {"attn_implementation": attn} if attn else {}
