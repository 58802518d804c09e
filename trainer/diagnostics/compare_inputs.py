"""`parityrl compare`'s inputs: its settings checked, the model directory, the prompts read and encoded.

Every refusal is a ``CompareError`` naming the setting or file, its value and what was expected,
raised before anything is written or started.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import datasets

from trainer.builtin.resolve import resolve_model_path
from trainer.config.validate import sampling_rules, topk_range
from trainer.data.datasets import encode_prompts, load_prompt_dataset
from trainer.models.policy import DTYPES
from trainer.precision import DEFAULT_RECIPE
from trainer.precision.checks import compare_rules

ENGINES = ("vllm", "hf")
PROMPT_SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")


class CompareError(ValueError):
    """Bad input to a comparison (file, column, setting); the message names it and what was expected."""


def check_settings(*, engine, temperature, top_p, top_k, min_p=0.0, max_new_tokens, n, dtype, batch_size, num_prompts,
                    max_model_len, max_prompt_tokens, topk, precision=DEFAULT_RECIPE) -> None:
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    checks = [
        (engine is None or engine in ENGINES or hasattr(engine, "generate"), "engine", engine,
         f"one of {ENGINES} or a started engine object with .generate()"),
        (isinstance(temperature, (int, float)) and temperature > 0, "temperature", temperature, "a number > 0"),
        *sampling_rules(top_p, top_k, min_p, prefix=""),
        (is_int(max_new_tokens) and max_new_tokens >= 1, "max_new_tokens", max_new_tokens, "an integer >= 1"),
        (is_int(n) and n >= 1, "n", n, "an integer >= 1"),
        topk_range(topk, key="topk"),
        (dtype in DTYPES, "dtype", dtype, f"one of {sorted(DTYPES)}"),
        # the precision recipe's record: its name, what it refuses in compare, its dtypes and engines
        *compare_rules(precision, engine=engine, dtype=dtype),
        (is_int(batch_size) and batch_size >= 1, "batch_size", batch_size, "an integer >= 1"),
        (num_prompts is None or (is_int(num_prompts) and num_prompts >= 1), "num_prompts", num_prompts,
         "an integer >= 1 or None (all)"),
        (max_model_len is None or (is_int(max_model_len) and max_model_len >= 2), "max_model_len", max_model_len,
         "an integer >= 2 or None (longest prompt + max_new_tokens)"),
        (max_prompt_tokens is None or (is_int(max_prompt_tokens) and max_prompt_tokens >= 1), "max_prompt_tokens",
         max_prompt_tokens, "an integer >= 1 or None"),
    ]
    for ok, key, value, expected in checks:
        if not ok:
            raise CompareError(f"{key} = {value!r}: expected {expected}")


def resolve_model_dir(model: str) -> str:
    """``builtin:*`` -> its built directory; anything else must be a local HF model directory."""
    try:
        path = resolve_model_path(str(model))
    except ValueError as e:
        raise CompareError(str(e)) from None
    if not (Path(path) / "config.json").is_file():
        raise CompareError(f"model = {str(model)!r}: expected a local Hugging Face model directory containing "
                           "config.json, or builtin:tiny / builtin:tiny-base")
    return path


def load_prompts(path: str | Path, *, prompt_column: str = "prompt", num_prompts: Optional[int] = None) -> list[str]:
    """Prompt strings from a ``.txt`` file (one per line; blank lines skipped) or a
    ``.jsonl``/``.json``/``.parquet`` file with a string column ``prompt_column``
    (read by ``trainer.data.datasets.load_prompt_dataset``, like a training recipe's data).

    Returns the first ``num_prompts`` prompts (all if None). Raises CompareError naming
    the file, the row and the expectation for a missing file, an unsupported suffix, a
    missing column, an empty or non-string prompt, or a file with no prompts.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise CompareError(f"prompts file {str(p)!r} does not exist (expected a {'/'.join(PROMPT_SUFFIXES)} file)")
    suffix = p.suffix.lower()
    if suffix not in PROMPT_SUFFIXES:
        raise CompareError(f"prompts file {str(p)!r}: unsupported suffix {suffix!r}; expected one of {PROMPT_SUFFIXES}")
    if suffix == ".txt":
        prompts = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    else:
        prompts = _dataset_prompts(p, prompt_column)
    if not prompts:
        raise CompareError(f"prompts file {str(p)!r} holds no prompts (expected at least one non-blank prompt)")
    return prompts[:num_prompts] if num_prompts is not None else prompts


def _dataset(path: Path, prompt_column: str) -> datasets.Dataset:
    try:
        return load_prompt_dataset(str(path), prompt_column=prompt_column, answer_column=None)
    except (ValueError, TypeError, FileNotFoundError, datasets.exceptions.DatasetGenerationError) as e:
        cause = f"{e} ({e.__cause__})" if e.__cause__ is not None else str(e)
        raise CompareError(f"prompts file {str(path)!r}: {cause}") from None


def _dataset_prompts(path: Path, prompt_column: str) -> list[str]:
    prompts = _dataset(path, prompt_column)["prompt"]
    for i, text in enumerate(prompts):
        if not isinstance(text, str) or not text.strip():
            raise CompareError(f"prompts file {str(path)!r}: row {i} column {prompt_column!r} = {text!r}; "
                               "expected a non-empty string")
    return list(prompts)


def load_image_column(path: str | Path, *, image_column: str, prompt_column: str = "prompt",
                      num_prompts: Optional[int] = None) -> list:
    """The ``image_column`` value of each prompt ``load_prompts`` reads from ``path``, row for row: a prompt's
    image(s), as a recipe's ``data.image_column`` holds them (``trainer.vision.images.row_images``). Raises
    CompareError for a ``.txt`` file (no columns) or a file without that column."""
    p = Path(path).expanduser()
    if p.suffix.lower() == ".txt":
        raise CompareError(f"image_column = {image_column!r}: prompts file {str(p)!r} is a .txt file, which holds no "
                           "columns; expected a .jsonl/.json/.parquet file with the prompt and image columns")
    ds = _dataset(p, prompt_column)
    if image_column not in ds.column_names:
        raise CompareError(f"image_column = {image_column!r}: prompts file {str(p)!r} has no such column; its "
                           f"columns: {ds.column_names}")
    values = ds[image_column]
    return values[:num_prompts] if num_prompts is not None else values


def chat_template_info(tokenizer, use_chat_template: Optional[bool], model_dir: str) -> dict:
    """Decide whether to use the chat template (None: if the tokenizer has one) and describe it."""
    template = getattr(tokenizer, "chat_template", None) or None
    if not isinstance(template, (str, type(None))):  # a dict of named templates
        template = json.dumps(template, sort_keys=True)
    used = bool(template) if use_chat_template is None else bool(use_chat_template)
    if used and not template:
        raise CompareError(f"use_chat_template = True: the tokenizer of {model_dir!r} has no chat template; "
                           "expected a tokenizer with one, or encode the prompts as plain text (--chat-template off)")
    return {"used": used, "available": template is not None,
            "sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "text": template}


def encode_prompt_ids(tokenizer, prompts: list[str], used: bool, max_prompt_tokens: Optional[int],
            system_prompt: Optional[str] = None) -> list[list[int]]:
    try:
        return encode_prompts(tokenizer, prompts, use_chat_template=used, max_prompt_tokens=max_prompt_tokens,
                              system_prompt=system_prompt)
    except ValueError as e:
        raise CompareError(str(e)) from None


def context_len(prompt_ids, max_new_tokens: int, max_model_len: Optional[int], model_max: Optional[int]) -> int:
    """Tokens per sequence the engine needs: the longest prompt + max_new_tokens, within the model's context."""
    need = max(len(p) for p in prompt_ids) + max_new_tokens
    if max_model_len is not None and max_model_len < need:
        raise CompareError(f"max_model_len = {max_model_len}: the longest prompt ({need - max_new_tokens} tokens) "
                           f"+ max_new_tokens ({max_new_tokens}) = {need}; expected at least that")
    length = max_model_len or need
    if model_max is not None and length > model_max:
        raise CompareError(f"max_model_len = {length} (longest prompt + max_new_tokens, or as given) exceeds the "
                           f"model's max_position_embeddings = {model_max}; expected fewer new tokens or shorter prompts")
    return length
