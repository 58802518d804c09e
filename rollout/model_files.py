"""What an engine reads from a local Hugging Face model directory: its EOS ids and its parameters' shapes."""
from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """EOS ids of a local HF model dir: generation_config.json first, then config.json."""
    for fname in ("generation_config.json", "config.json"):
        path = Path(model_dir) / fname
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Parameter name -> shape from a local safetensors checkpoint's headers (no tensor is read)."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                shapes[k] = tuple(sf.get_slice(k).get_shape())
    return shapes


def has_vision_tower(model_dir: str | Path) -> bool:
    """Whether a local HF model dir's config.json describes a vision-language model (a ``vision_config`` beside its
    language model's): vLLM then builds a multimodal processor, which needs the tokenizer even for text prompts."""
    path = Path(model_dir) / "config.json"
    try:
        return isinstance(json.loads(path.read_text()).get("vision_config"), dict)
    except (OSError, ValueError):
        return False
