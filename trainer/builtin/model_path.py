"""A recipe's ``model.path`` before anything is built: a built-in name that exists and can be built here, or a
local model directory; and the context length it declares (``trainer.builtin.resolve`` builds and returns it)."""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Optional

from trainer.builtin.pretrained import SMOLLM2_NAME, missing_requirement
from trainer.builtin.tiny import build_tiny_base
from trainer.builtin.zoo import ZOO_MAX_POSITIONS, ZOO_MODELS
from trainer.builtin.zoo_vl import TINY_VL_NAME, VL_MAX_POSITIONS, VL_MODEL_NAME
from trainer.config import RecipeError

# The built-in models (``model.path: builtin:...``); the architecture zoo's small random models last (docs/models.md).
BUILTIN_MODELS = ("builtin:tiny", "builtin:tiny-base", "builtin:tiny-tools", "builtin:tiny-teacher", "builtin:tiny-tools-teacher",
                  TINY_VL_NAME, SMOLLM2_NAME, *ZOO_MODELS, VL_MODEL_NAME)
# Context of the pretrained built-ins, known without building them (SmolLM2's config.json).
_PRETRAINED_MAX_POSITIONS = {SMOLLM2_NAME: 8192}


def builtin_max_positions(name: str) -> Optional[int]:
    if name in _PRETRAINED_MAX_POSITIONS:
        return _PRETRAINED_MAX_POSITIONS[name]
    if name in ZOO_MODELS:
        return ZOO_MAX_POSITIONS
    if name in (VL_MODEL_NAME, TINY_VL_NAME):  # the warm start keeps its base's config
        return VL_MAX_POSITIONS
    default = inspect.signature(build_tiny_base).parameters.get("max_position_embeddings")
    return None if default is None else default.default


def looks_local(path: str) -> bool:
    # Hub ids ("org/name") also contain a slash, so only an explicit path prefix or an
    # existing path counts as local; anything else is left to the hub loader.
    return path.startswith((".", "/", "~")) or Path(path).expanduser().exists()


def model_max_positions(model_path: str) -> Optional[int]:
    """The model's context length from its config.json, without loading weights (None if unknown)."""
    if model_path.startswith("builtin:"):
        return builtin_max_positions(model_path)
    cfg_file = Path(model_path).expanduser() / "config.json"
    if not cfg_file.is_file():
        return None
    try:
        conf = json.loads(cfg_file.read_bytes())
    except (OSError, ValueError):  # not JSON, or not UTF-8: preflight's config check names the problem
        return None
    if not isinstance(conf, dict):
        return None
    return conf.get("max_position_embeddings") or conf.get("n_positions") or conf.get("max_seq_len")


def check_model_path(mp: str, where: str, key: str = "model.path") -> None:
    """A built-in name that exists, or a local directory with a config.json; hub ids pass. ``key``: the recipe key
    named in the error (``teacher.path`` too)."""
    if mp.startswith("builtin:"):
        if mp not in BUILTIN_MODELS:
            raise RecipeError(f"{where}: {key} = {mp!r}: unknown built-in model; expected one of {', '.join(BUILTIN_MODELS)}")
        if missing_requirement(mp):
            raise RecipeError(f"{where}: {key} = {mp!r}: {missing_requirement(mp)}")
    elif looks_local(mp):
        d = Path(mp).expanduser()
        if not d.is_dir():
            raise RecipeError(f"{where}: {key} = {mp!r}: no such directory")
        if not (d / "config.json").is_file():
            raise RecipeError(f"{where}: {key} = {mp!r}: the directory has no config.json (expected a Hugging Face model directory)")
