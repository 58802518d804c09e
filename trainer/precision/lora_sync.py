"""``rollout.lora_sync`` resolved: does the engine serve the LoRA adapter, or take the merged weights?

One rule for the preflight (a recipe that asks for ``adapter`` where it cannot be served is refused before
anything loads), the engine's start (it is started with LoRA support only for ``adapter``), ``parityrl serve``
(the server likewise) and the sync. ``auto`` is ``adapter`` unless one of these needs the merged weights, and then
the run says why once at its start:

- the precision recipe (``PrecisionRecipe.merged_sync``: the FP8 recipes quantize the effective weight on both
  sides; exact mode reruns the engine's kernels on the engine's own weights);
- the LoRA targets: an embedding or output layer (vLLM's LoRA takes linear layers of every supported model, its
  embedding LoRA only some models', and the trainer refuses lm_head);
- the rank: vLLM serves adapters of rank <= 512 (``rollout.adapters.VLLM_LORA_RANKS``);
- a mixture-of-experts model on a CPU vLLM (``moe_on_cpu``): with LoRA on, vLLM runs every MoE layer on its
  Triton kernel, which the CPU backend lacks;
- an engine handed to the run that was started without LoRA support (``adapter_dtype`` None), or a server
  (``parityrl serve``) that cannot serve it (``ServerEngine.adapter_unavailable`` says why).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from transformers import AutoConfig

from rollout.adapters import VLLM_LORA_RANKS
from rollout.moe_config import is_moe
from trainer.config import RecipeError, RunConfig
from trainer.precision.record import PrecisionRecipe
from trainer.precision.registry import recipe_for

ADAPTER = "adapter"
MERGED = "merged"
# Layers an adapter sync does not serve: vLLM's LoRA of an input embedding exists for some models only, of the
# output layer for none of the trainer's (it refuses lm_head targets itself).
NOT_SERVED = ("embed_tokens", "wte", "word_embeddings", "lm_head")


def merged_reasons(cfg: RunConfig, recipe: Optional[PrecisionRecipe] = None) -> list[str]:
    """Why this recipe's engine cannot serve its adapter (empty: it can), from the recipe alone."""
    recipe = recipe or recipe_for(cfg.precision.recipe)
    lora = cfg.model.lora
    reasons = []
    if recipe.merged_sync:
        reasons.append(f"precision.recipe {recipe.name}: {recipe.merged_sync}")
    served = [t for t in lora.target_modules if t in NOT_SERVED]
    if served:
        reasons.append(f"model.lora.target_modules {served}: the engine serves adapters of linear layers only")
    if lora.r > VLLM_LORA_RANKS[-1]:
        reasons.append(f"model.lora.r {lora.r}: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}")
    moe = moe_on_cpu(cfg)
    if moe:
        reasons.append(moe)
    return reasons


def moe_on_cpu(cfg: RunConfig) -> Optional[str]:
    """Why a vLLM engine on this machine's CPU cannot serve this mixture-of-experts model's adapter (None: it can,
    or the model is not one): with LoRA enabled vLLM picks its Triton MoE kernel for every MoE layer, whatever the
    LoRA targets (``vllm/model_executor/layers/fused_moe/oracle/unquantized.py``:
    ``select_unquantized_moe_backend``), and its CPU backend has no Triton (a forward fails: ``tl.bfloat16``).
    Read from the model's config where it is a local directory; the built-in models are dense."""
    path = cfg.model.path
    if cfg.rollout.engine != "vllm" or torch.cuda.is_available() or path.startswith("builtin:"):
        return None
    try:
        config = AutoConfig.from_pretrained(str(Path(path).expanduser()))
    except (OSError, ValueError):  # a hub id without network: vLLM's own start says what it is
        return None
    if not is_moe(config):
        return None
    return (f"model.path {path}: a mixture-of-experts model on a CPU vLLM (with LoRA enabled vLLM runs its MoE "
            "layers on its Triton kernel, which the CPU backend lacks: "
            "vllm/model_executor/layers/fused_moe/oracle/unquantized.py)")


def lora_sync_mode(cfg: RunConfig, recipe: Optional[PrecisionRecipe] = None) -> tuple[str, Optional[str]]:
    """(``adapter`` | ``merged``, why merged when the recipe did not ask for it); ``RecipeError`` for ``adapter``
    where it cannot be served, naming the key, the reason and the fallback."""
    asked = cfg.rollout.lora_sync
    if asked == MERGED:
        return MERGED, None
    reasons = merged_reasons(cfg, recipe)
    if not reasons:
        return ADAPTER, None
    if asked == ADAPTER:
        raise RecipeError(f"rollout.lora_sync = 'adapter': the engine cannot serve this recipe's adapter "
                          f"({'; '.join(reasons)}); expected 'merged' (or 'auto', which falls back to it)")
    return MERGED, "; ".join(reasons)


def engine_lora_sync(cfg: RunConfig, engine, recipe: Optional[PrecisionRecipe] = None) -> tuple[str, Optional[str]]:
    """``lora_sync_mode`` for a started engine: one without LoRA support (``adapter_dtype`` None, e.g. handed to
    the run already started) takes the merged weights, or is refused for an explicit ``adapter``."""
    mode, why = lora_sync_mode(cfg, recipe)
    if mode == ADAPTER and getattr(engine, "adapter_dtype", None) is None:
        # the engine's own reason where it has one (a server: rollout.server_engine.ServerEngine.adapter_unavailable)
        reason = (getattr(engine, "adapter_unavailable", None)
                  or f"the engine ({type(engine).__name__}) was started without LoRA support")
        if cfg.rollout.lora_sync == ADAPTER:
            raise RecipeError(f"rollout.lora_sync = 'adapter': {reason}; expected an engine started for this recipe, "
                              "or 'merged'")
        return MERGED, reason
    return mode, why
