"""`parityrl merge <base> <adapter> --out <dir>`: fold a LoRA adapter into its base model.

The base may be a built-in name (resolved, and built once, here) or a local Hugging Face model
directory; the merge itself, its checks and what it writes: ``trainer.models.adapter_merge``.
"""
from __future__ import annotations

from pathlib import Path

from trainer.builtin.model_path import BUILTIN_MODELS
from trainer.builtin.resolve import resolve_model_path
from trainer.models import adapter_merge
from trainer.models.adapter_merge import MergeError, describe

__all__ = ["MergeError", "describe", "merge_adapter"]


def _base_dir(base: str) -> Path:
    if base.startswith("builtin:"):
        if base not in BUILTIN_MODELS:
            raise MergeError(f"base = {base!r}: unknown built-in model; expected one of {', '.join(BUILTIN_MODELS)}")
        return Path(resolve_model_path(base))
    d = Path(base).expanduser()
    if not d.is_dir():
        raise MergeError(f"base = {base!r}: no such directory")
    if not (d / "config.json").is_file():
        raise MergeError(f"base = {base!r}: no config.json; expected a Hugging Face model directory")
    return d


def merge_adapter(base: str, adapter: str, out: str, *, dtype: str = "auto") -> Path:
    """Merge ``adapter`` into ``base`` and save a plain HF model + tokenizer to ``out`` (new or empty) atomically."""
    return adapter_merge.merge_adapter(_base_dir(base), adapter, out, dtype=dtype)
