"""A local model directory read cheaply, before anything loads it: config.json, the weights' headers, the tokenizer.

Each check returns the problem as text (None when sound) so that the caller names the recipe key; only headers
and small JSON files are read: a safetensors file's 8-byte header length and JSON header, never its tensors
(https://huggingface.co/docs/safetensors/index "Format").
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from trainer.config.utf8 import decode_utf8
from trainer.vision.support import vision_language_problem, vision_language_type

# Bytes per element of the safetensors dtypes (the format's own list).
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
                "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# A header is a few hundred bytes per tensor; safetensors itself refuses headers above 100 MB.
_MAX_HEADER = 100_000_000
# What AutoTokenizer builds a tokenizer from: a fast tokenizer's tokenizer.json, or a slow one's vocabulary.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")


def read_json(path: Path) -> tuple[Optional[object], Optional[str]]:
    """(the parsed file, None) or (None, why not: not UTF-8, or not JSON with its line and column)."""
    try:
        text, problem = decode_utf8(path.read_bytes())
    except OSError as e:
        return None, f"{path.name} cannot be read ({e.strerror or e})"
    if problem:
        return None, f"{path.name}: {problem}"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"{path.name} is not valid JSON ({e.msg}, line {e.lineno}, column {e.colno})"


def config_problem(model_dir: Path) -> Optional[str]:
    """config.json parses, names a ``model_type``, and that type is one Transformers builds as a causal LM
    (``AutoModelForCausalLM``, how the trainer loads the policy)."""
    conf, problem = read_json(model_dir / "config.json")
    if problem:
        return problem
    if not isinstance(conf, dict):
        return f"config.json holds {type(conf).__name__}, expected a JSON object"
    model_type = conf.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        return "config.json has no model_type (expected the Hugging Face architecture name, e.g. 'llama')"
    if vision_language_type(model_type):
        return vision_language_problem(model_type)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"config.json: model_type {model_type!r} is not a causal language model Transformers can build "
                "(AutoModelForCausalLM); parityrl trains decoder-only *ForCausalLM models")
    # The weights were saved from these classes: an encoder's (BERT's BertForMaskedLM) would load into the
    # causal-LM class of its model_type with its head missing, and its layers are not a decoder's.
    architectures = conf.get("architectures")
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if isinstance(architectures, list) and architectures and not any(a in causal for a in architectures):
        return (f"config.json: architectures {architectures}: not a causal language model (expected a decoder-only "
                "*ForCausalLM checkpoint, such as LlamaForCausalLM)")
    return None


def weight_files(model_dir: Path) -> tuple[list[Path], Optional[str]]:
    """(the safetensors files of the checkpoint, None), or ([], the problem). A sharded checkpoint's index must
    name files that exist; a directory with only PyTorch ``.bin`` weights passes with no file to check."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        data, problem = read_json(index)
        if problem:
            return [], problem
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            return [], f"{index.name} has no weight_map (expected tensor name -> shard file)"
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (model_dir / str(s)).is_file()]
        if missing:
            return [], f"{index.name} names {len(missing)} missing shard(s): {', '.join(map(str, missing[:3]))}"
        return [model_dir / s for s in shards], None
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files, None
    if any(model_dir.glob("pytorch_model*.bin")):
        return [], None
    return [], "no weights (expected model.safetensors, sharded *.safetensors with their index, or pytorch_model.bin)"


def safetensors_header(path: Path) -> tuple[dict, Optional[str]]:
    """({tensor name: {dtype, shape, data_offsets}}, None) from the file's header, or ({}, the problem): a file
    too short for its header, a header that is not JSON, or tensors extending past the end (a truncated file)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return {}, f"{path.name} is {size} bytes, shorter than a safetensors header (truncated?)"
        (n,) = struct.unpack("<Q", prefix)
        if n > min(size - 8, _MAX_HEADER):
            return {}, (f"{path.name}: its first 8 bytes give a header of {n} bytes in a {size}-byte file: not a "
                        "safetensors file, or truncated")
        raw = f.read(n)
    text, problem = decode_utf8(raw)
    try:
        header = json.loads(text) if text is not None else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict):
        return {}, f"{path.name}: the header is not a JSON object (not a safetensors file, or damaged)"
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data_bytes = size - 8 - n
    end = 0
    for name, t in tensors.items():
        try:
            begin, stop = (int(x) for x in t["data_offsets"])
            expected = _DTYPE_BYTES[t["dtype"]] * math.prod(int(d) for d in t["shape"])
        except (KeyError, TypeError, ValueError):
            return {}, f"{path.name}: tensor {name!r} has no valid dtype, shape and data_offsets in the header"
        if stop - begin != expected:
            return {}, f"{path.name}: tensor {name!r} spans {stop - begin} bytes, its dtype and shape need {expected}"
        end = max(end, stop)
    if end > data_bytes:
        return {}, (f"{path.name} is truncated: its header describes {end} bytes of tensor data, the file holds "
                    f"{data_bytes}")
    return tensors, None


def parameter_count(headers: list[dict]) -> int:
    """Elements of every tensor of the checkpoint (from ``safetensors_header``)."""
    return sum(math.prod(int(d) for d in t["shape"]) for h in headers for t in h.values())


def tokenizer_problem(model_dir: Path) -> Optional[str]:
    """A tokenizer file is present, and tokenizer.json / tokenizer_config.json parse (``tokenizers`` loads the
    former: a file that is JSON but not a tokenizer is refused too)."""
    if not any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        return f"no tokenizer (expected one of {', '.join(_TOKENIZER_FILES)})"
    for name in ("tokenizer_config.json", "tokenizer.json"):
        if (model_dir / name).is_file():
            _, problem = read_json(model_dir / name)
            if problem:
                return problem
    if (model_dir / "tokenizer.json").is_file():
        try:
            Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - the Rust loader's errors have no common Python type
            return f"tokenizer.json does not load as a tokenizer ({' '.join(str(e).split())[:200]})"
    return None
