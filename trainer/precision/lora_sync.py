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
- a mixture-of-experts model on vLLM's CPU build: with LoRA on, vLLM runs the experts through its Triton
  fused-MoE kernel (``vllm/model_executor/layers/fused_moe/experts/triton_moe.py``), which has no CPU backend
  (known from the model's config: ``model_config``; on CUDA the adapter is served);
- an engine handed to the run that was started without LoRA support (``adapter_dtype`` None), a server
  (``parityrl serve``) that cannot serve it (``ServerEngine.adapter_unavailable`` says why), or an engine
  started from another model than the run's.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

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


def merged_reasons(cfg: RunConfig, recipe: Optional[PrecisionRecipe] = None, *, model_config=None,
                   cuda: Optional[bool] = None) -> list[str]:
    """Why this recipe's engine cannot serve its adapter (empty: it can): from the recipe alone, and with the
    model's ``model_config`` (a Transformers config) what the model adds, on CUDA or not (``cuda``; None: this
    machine's)."""
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
    if cfg.rollout.in_flight != "off":
        reasons.append(f"rollout.in_flight {cfg.rollout.in_flight}: a running request keeps the adapter it was "
                       "started with, so an update in the middle of a generation must replace the weights it runs on")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    if model_config is not None and is_moe(model_config) and cfg.rollout.engine == "vllm" and not cuda:
        reasons.append("a mixture-of-experts model on vLLM's CPU build: its LoRA runs the experts through vLLM's "
                       "Triton fused-MoE kernel, which has no CPU backend")
    return reasons


def lora_sync_mode(cfg: RunConfig, recipe: Optional[PrecisionRecipe] = None, *, model_config=None,
                   cuda: Optional[bool] = None) -> tuple[str, Optional[str]]:
    """(``adapter`` | ``merged``, why merged when the recipe did not ask for it); ``RecipeError`` for ``adapter``
    where it cannot be served, naming the key, the reason and the fallback (``merged_reasons``' arguments)."""
    asked = cfg.rollout.lora_sync
    if asked == MERGED:
        return MERGED, None
    reasons = merged_reasons(cfg, recipe, model_config=model_config, cuda=cuda)
    if not reasons:
        return ADAPTER, None
    if asked == ADAPTER:
        raise RecipeError(f"rollout.lora_sync = 'adapter': the engine cannot serve this recipe's adapter "
                          f"({'; '.join(reasons)}); expected 'merged' (or 'auto', which falls back to it)")
    return MERGED, "; ".join(reasons)


def engine_lora_sync(cfg: RunConfig, engine, recipe: Optional[PrecisionRecipe] = None, *,
                     model_config=None, model_dir: Optional[str] = None) -> tuple[str, Optional[str]]:
    """``lora_sync_mode`` for a started engine: one without LoRA support (``adapter_dtype`` None, e.g. handed to
    the run already started), or one started from another model directory than the run's ``model_dir`` (an adapter
    would run over that model's base weights, while a merged sync overwrites every LoRA-targeted weight), takes the
    merged weights, or is refused for an explicit ``adapter``."""
    mode, why = lora_sync_mode(cfg, recipe, model_config=model_config)
    if mode != ADAPTER:
        return mode, why
    problem = None
    if getattr(engine, "adapter_dtype", None) is None:
        # the engine's own reason where it has one (a server: rollout.server_engine.ServerEngine.adapter_unavailable)
        problem = (getattr(engine, "adapter_unavailable", None)
                   or f"the engine ({type(engine).__name__}) was started without LoRA support")
    elif model_dir is not None and isinstance(getattr(engine, "model", None), str) and \
            Path(engine.model).resolve() != Path(model_dir).resolve():
        problem = f"the engine ({type(engine).__name__}) was started from {engine.model}, not the run's {model_dir}"
    if problem is None:
        return mode, None
    if cfg.rollout.lora_sync == ADAPTER:
        raise RecipeError(f"rollout.lora_sync = 'adapter': {problem}; expected an engine started for this recipe, "
                          "or 'merged'")
    return MERGED, problem
