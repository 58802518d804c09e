"""Reading a recipe: YAML + ``--set`` overrides, converted into the schema's dataclasses with type checks."""
from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from pathlib import Path
from typing import Any, Iterable, Literal

import yaml

from trainer.algorithms import ALGORITHMS, OptionError
from trainer.config.schema import AlgorithmConfig, RecipeError, RunConfig
from trainer.config.strict_yaml import DuplicateKey, load_unique
from trainer.config.validate import Check, validate


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin is dict:
        k, v = typing.get_args(tp)
        return f"a mapping of {_describe(k)} to {_describe(v)}"
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (int -> float, dict -> dataclass)."""

    def bad() -> RecipeError:
        return RecipeError(f"{where}: {key} = {value!r}: expected {_describe(tp)}")

    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad()
        return _build(tp, value, key, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise bad()
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, key, where)
            except NotFinite:
                raise
            except RecipeError:
                pass
        raise bad()
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise bad()
        return value
    if origin is list:
        if not isinstance(value, list):
            raise bad()
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise bad()
        kt, vt = typing.get_args(tp)
        return {_convert(k, kt, key, where): _convert(v, vt, f"{key}.{k}", where) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise bad()
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad()
        return value
    if tp is float:
        return _finite(_to_float(value, bad), key, where)
    if tp is str:
        if not isinstance(value, str):
            raise bad()
        return value
    raise TypeError(f"config.py: unsupported annotation {tp!r} for {key}")


def _to_float(value: Any, bad) -> float:
    if isinstance(value, str):
        # PyYAML reads "1e-4" (no dot) as a string (YAML 1.1); accept what float() reads.
        try:
            return float(value)
        except ValueError:
            raise bad() from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad()
    return float(value)


class NotFinite(RecipeError):
    pass


def _finite(x: float, key: str, where: str) -> float:
    # No recipe number means anything when infinite or NaN (a limit that is off is null, not .inf).
    if not math.isfinite(x):
        raise NotFinite(f"{where}: {key} = {x!r}: expected a finite number")
    return x


# Sampling options a user may expect but the trainer cannot reproduce in its log-probs:
# they change the distribution the engine samples from in ways that depend on the
# sequence so far (penalties), force or suppress tokens (min_tokens suppresses EOS,
# logit_bias, bad_words), or truncate it (min_p). The engine's log-probs would then
# not be log softmax(logits / T) and every parity metric would measure the sampler,
# not the numerics -- the negative-KL trouble of the StackLLaMA write-up
# (https://huggingface.co/blog/stackllama, "a negative KL"). Refused with the reason.
UNREPRODUCIBLE_SAMPLING = {
    "rollout.repetition_penalty": "a repetition penalty rescales logits by the sequence so far",
    "rollout.presence_penalty": "a presence penalty shifts logits by the sequence so far",
    "rollout.frequency_penalty": "a frequency penalty shifts logits by the sequence so far",
    "rollout.min_tokens": "min_tokens suppresses EOS for the first tokens (EOS gets probability 0)",
    "rollout.min_p": "min_p truncates the distribution by a probability threshold",
    "rollout.logit_bias": "a logit bias adds constants the trainer does not add",
    "rollout.bad_words": "bad_words forbids tokens (probability 0 in the engine only)",
    "rollout.allowed_token_ids": "allowed_token_ids masks the vocabulary in the engine only",
}


def _build(cls: type, data: dict, prefix: str, where: str):
    if cls is AlgorithmConfig:
        return _build_algorithm(data, prefix, where)
    return _build_plain(cls, data, prefix, where)


def _build_plain(cls: type, data: dict, prefix: str, where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs, errors = {}, []
    for k, v in data.items():  # every key's problem is collected: the user sees them all at once
        key = f"{prefix}.{k}" if prefix else str(k)
        try:
            if k not in names and key in UNREPRODUCIBLE_SAMPLING:
                raise RecipeError(f"{where}: {key} = {v!r}: not supported: {UNREPRODUCIBLE_SAMPLING[key]}, so the "
                                  "trainer could not score the sampled tokens under the distribution they were drawn "
                                  "from (parity metrics and importance ratios would measure the sampler). Remove the key.")
            if k not in names:
                raise RecipeError(f"{where}: unknown key {key!r}; valid keys here: {', '.join(names)}")
            kwargs[k] = _convert(v, hints[k], key, where)
        except RecipeError as e:
            errors.append(e)
    if errors:
        raise RecipeError.several(errors)
    return cls(**kwargs)


def _build_algorithm(data: dict, prefix: str, where: str) -> AlgorithmConfig:
    """The ``algorithm:`` section: the shared keys, and the chosen algorithm's own keys into its options."""
    name = data.get("name", AlgorithmConfig.name)
    if not isinstance(name, str) or name not in ALGORITHMS:
        raise RecipeError(f"{where}: {prefix}.name = {name!r}: expected one of {', '.join(ALGORITHMS.names())}")
    record = ALGORITHMS.get(name)
    shared = [f.name for f in dataclasses.fields(AlgorithmConfig) if f.name != "options"]
    own = record.option_names()
    errors: list[RecipeError] = []
    for k, v in data.items():
        if k in shared or k in own:
            continue
        owners = [r.name for r in ALGORITHMS.values() if k in r.option_names()]
        if owners:
            errors.append(RecipeError(f"{where}: {prefix}.{k} = {v!r}: not an option of {name}; it belongs to "
                                      f"{', '.join(owners)} (options of {name}: {', '.join(own) or 'none'})"))
        else:
            errors.append(RecipeError(f"{where}: unknown key '{prefix}.{k}'; valid keys here: "
                                      f"{', '.join(shared + own)}"))
    section = options = None
    try:
        section = _build_plain(AlgorithmConfig, {k: v for k, v in data.items() if k in shared}, prefix, where)
    except RecipeError as e:
        errors.append(e)
    try:
        options = _build_plain(record.options, {k: v for k, v in data.items() if k in own}, prefix, where)
    except OptionError as e:
        errors.append(RecipeError(f"{where}: {prefix}.{e.key} = {e.value!r}: expected {e.expected} ({name})"))
    except RecipeError as e:
        errors.append(e)
    if errors:
        raise RecipeError.several(errors)
    section.options = options
    return section


def _set_dotted(tree: dict, dotted: str, value: Any, where: str) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        nxt = node.setdefault(p, {})
        if not isinstance(nxt, dict):
            raise RecipeError(f"{where}: --set {dotted}: {p!r} holds a value, not a section")
        node = nxt
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``key.sub=value`` -> (key, YAML-parsed value): ``--set train.steps=5`` gives an int."""
    if "=" not in text:
        raise RecipeError(f"--set {text!r}: expected key=value, e.g. --set train.steps=5")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise RecipeError(f"--set {text!r}: the key before '=' is empty")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def load_recipe_dict(path: str | os.PathLike, overrides: list[str] = ()) -> tuple[dict, str]:
    p = Path(path)
    where = str(p)
    if not p.is_file():
        raise RecipeError(f"{where}: recipe file not found")
    try:
        data = load_unique(p.read_text())
    except DuplicateKey as e:
        raise RecipeError(f"{where}: {e}") from None
    except yaml.YAMLError as e:
        raise RecipeError(f"{where}: not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:  # an empty file would otherwise be a whole run on the defaults
        raise RecipeError(f"{where}: the recipe is empty; expected a mapping of sections (an explicit `{{}}` "
                          "runs on every default)")
    if not isinstance(data, dict):
        raise RecipeError(f"{where}: expected a mapping of sections at the top level, got {type(data).__name__}")
    for o in overrides:
        k, v = parse_override(o)
        _set_dotted(data, k, v, where)
    return data, where


def build_config(cls: type, data: dict, where: str = "<recipe>"):
    return _build(cls, data, "", where)


def read_recipe(path: str | os.PathLike, overrides: list[str] = (), checks: Iterable[Check] = ()) -> RunConfig:
    """Read, override, type-check and validate a training recipe on its own (``trainer.rl.preflight.load_recipe``
    also checks the files and models it names). ``checks``: validation sections of the caller's, reported
    with this package's own (``trainer.config.validate.validate``)."""
    data, where = load_recipe_dict(path, overrides)
    cfg = build_config(RunConfig, data, where)
    validate(cfg, where, checks)
    return cfg
