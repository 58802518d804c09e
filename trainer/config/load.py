"""Reading a recipe: YAML + ``--set`` overrides, converted into the schema's dataclasses with type checks."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, Optional

import yaml

from parity.corrections import (
    CorrectionPlan,
    OptionError as RuleOptionError,
    PlanError,
    get_preset,
    get_rule,
    is_rule,
    rule_names,
    rules as correction_rules,
)
from trainer.algorithms import ALGORITHMS, OptionError
from trainer.config.schema import AlgorithmConfig, CorrectionSection, RecipeError, RunConfig, recipe_key
from trainer.config.strict_yaml import DuplicateKey, load_unique
from trainer.config.utf8 import decode_utf8
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


def _convert(value: Any, tp: Any, key: str, where: str, salvage: Optional["_Salvage"] = None) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (int -> float, dict -> dataclass).
    ``salvage``: a section directly under this key is built leniently (``_Salvage``)."""

    def bad() -> RecipeError:
        return RecipeError(f"{where}: {key} = {value!r}: expected {_describe(tp)}")

    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise bad()
        return _build(tp, value, key, where, salvage)
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
        # YAML 1.1 reads a bare off / on as false / true: a choice spelled 'off' (rollout.in_flight) takes it back
        if isinstance(value, bool) and ("on" if value else "off") in typing.get_args(tp):
            return "on" if value else "off"
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
    "rollout.logit_bias": "a logit bias adds constants the trainer does not add",
    "rollout.bad_words": "bad_words forbids tokens (probability 0 in the engine only)",
    "rollout.allowed_token_ids": "allowed_token_ids masks the vocabulary in the engine only",
}


class _Salvage:
    """A lenient build's record: the keys whose values were refused (left at their defaults).

    A recipe with a type error or an unknown key cannot be built, but its other values can still be
    checked: built without the refused keys, the config is validated and every problem not involving
    a refused key is reported with the type errors (``build_and_validate``), instead of one at a time.
    """

    def __init__(self) -> None:
        self.keys: list[str] = []


def _build(cls: type, data: dict, prefix: str, where: str, salvage: Optional[_Salvage] = None):
    if cls is AlgorithmConfig:
        return _build_algorithm(data, prefix, where, salvage)
    if cls is CorrectionSection:
        return _build_correction(data, prefix, where, salvage)
    return _build_plain(cls, data, prefix, where, salvage)


def _build_plain(cls: type, data: dict, prefix: str, where: str, salvage: Optional[_Salvage] = None):
    hints = typing.get_type_hints(cls)
    fields = {recipe_key(f.name): f.name for f in dataclasses.fields(cls)}
    metadata = {f.name: f.metadata for f in dataclasses.fields(cls)}
    names = list(fields)
    kwargs, errors = {}, []
    for k, v in data.items():  # every key's problem is collected: the user sees them all at once
        key = f"{prefix}.{k}" if prefix else str(k)
        try:
            if k not in names and key in UNREPRODUCIBLE_SAMPLING:
                raise RecipeError(f"{where}: {key} = {v!r}: not supported: {UNREPRODUCIBLE_SAMPLING[key]}, so the "
                                  "trainer could not score the sampled tokens under the distribution they were drawn "
                                  "from (parity metrics and importance ratios would measure the sampler). Remove the key.")
            if k not in names:
                raise RecipeError(f"{where}: unknown key {key!r}{_did_you_mean(k, names, prefix)}; valid keys here: "
                                  f"{', '.join(names)}")
            try:
                kwargs[fields[k]] = _convert(v, hints[fields[k]], key, where, salvage)
            except RecipeError as e:
                # a field whose type alone would not say the form it wants (a string naming a mapping, not one)
                form = metadata[fields[k]].get("expected")
                if form is None or "\n" in str(e):
                    raise
                raise RecipeError(f"{where}: {key} = {v!r}: expected {form}") from None
        except RecipeError as e:
            errors.append(e)
            if salvage is not None:
                salvage.keys.append(key)
    if errors and salvage is None:
        raise RecipeError.several(errors)
    return cls(**kwargs)


def _did_you_mean(key: object, names: list[str], prefix: str) -> str:
    """`` (did you mean 'train.steps'?)`` for the valid key closest to a typo, or nothing when none is close."""
    close = difflib.get_close_matches(str(key), names, n=1)
    return f" (did you mean '{prefix + '.' if prefix else ''}{close[0]}'?)" if close else ""


def _build_algorithm(data: dict, prefix: str, where: str, salvage: Optional[_Salvage] = None) -> AlgorithmConfig:
    """The ``algorithm:`` section: the shared keys, and the chosen algorithm's own keys into its options."""
    name = data.get("name", AlgorithmConfig.name)
    if not isinstance(name, str) or name not in ALGORITHMS:
        if salvage is not None:  # no record to check the rest against: the whole section is left out
            salvage.keys.append(prefix)
            return AlgorithmConfig()
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
            errors.append(RecipeError(f"{where}: unknown key '{prefix}.{k}'{_did_you_mean(k, shared + own, prefix)}; "
                                      f"valid keys here: {', '.join(shared + own)}"))
    if salvage is not None:
        return _salvage_algorithm(data, shared, own, record, prefix, where, salvage)
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


def _salvage_algorithm(data: dict, shared: list[str], own: list[str], record, prefix: str, where: str,
                       salvage: _Salvage) -> AlgorithmConfig:
    """The section built leniently: the shared keys as ``_build_plain`` does, the options without those an
    option type refuses (its own ``OptionError`` names one at a time)."""
    section = _build_plain(AlgorithmConfig, {k: v for k, v in data.items() if k in shared}, prefix, where, salvage)
    given = {k: v for k, v in data.items() if k in own}
    while True:
        try:
            section.options = _build_plain(record.options, given, prefix, where, salvage)
            return section
        except OptionError as e:
            salvage.keys.append(f"{prefix}.{e.key}")
            if not given:  # the defaults refused themselves: the section keeps its default options
                return section
            if e.key in given:
                given.pop(e.key)
            else:  # a rule across options: none of the given ones can be kept
                salvage.keys.extend(f"{prefix}.{k}" for k in given)
                given = {}


def _build_correction(data: dict, prefix: str, where: str, salvage: Optional[_Salvage] = None) -> CorrectionSection:
    """The ``parity.correction:`` section: its shared keys, a preset expanded, each chosen rule's options (under the
    rule's name) into its record's options type, and the combination checked (``parity.corrections.CorrectionPlan``).

    Every problem is collected: an unknown rule, options of a rule not chosen, an option of another rule (named with
    the rules that have it), a threshold out of range, two importance weights. A lenient build (``salvage``) with
    problems leaves the whole section at its defaults."""
    shared = [f.name for f in dataclasses.fields(CorrectionSection) if f.name != "options"]
    errors: list[RecipeError] = []

    def refuse(key: str, value: Any, expected: str) -> None:
        errors.append(RecipeError(f"{where}: {prefix}.{key} = {value!r}: expected {expected}"))

    try:
        section = _build_plain(CorrectionSection, {k: v for k, v in data.items() if k in shared}, prefix, where)
    except RecipeError as e:
        errors.append(e)
        section = CorrectionSection()
    options: dict[str, Any] = {}
    names = list(section.rules)
    if section.preset is not None:
        try:
            preset = get_preset(section.preset)
        except ValueError as e:
            refuse("preset", section.preset, str(e).split("; ", 1)[1].replace("valid names", "one of"))
        else:
            if names:
                refuse("rule", section.rule, "none with parity.correction.preset set (the preset names its rules)")
            if "bypass" in data and section.bypass != preset.bypass:
                refuse("bypass", section.bypass,
                       f"{str(preset.bypass).lower()} or unset with preset {section.preset} (the preset sets it)")
            names, options = list(preset.rules), dict(preset.options)
            section.bypass = preset.bypass
    for name in names:
        if not is_rule(name):
            refuse("rule", section.rule, f"none, a correction rule or a list of them: {', '.join(rule_names())} "
                   f"({name!r} is none of them)")
    for key, value in data.items():
        if key in shared:
            continue
        if is_rule(key):
            rule_options = _build_rule_options(key, value, key in names, names, options.get(key), prefix, where, errors)
            if rule_options is not None:
                options[key] = rule_options
            continue
        owners = [r.name for r in correction_rules() if key in r.option_names()]
        if owners:
            errors.append(RecipeError(f"{where}: {prefix}.{key} = {value!r}: a rule's option goes under the rule's "
                                      f"name ({prefix}.<rule>.{key}); {key} is an option of {', '.join(owners)}"))
        else:
            keys = shared + rule_names()
            errors.append(RecipeError(f"{where}: unknown key '{prefix}.{key}'{_did_you_mean(key, keys, prefix)}; "
                                      f"valid keys here: {', '.join(shared)}, or a chosen rule's name"))
    if not errors:
        try:
            plan = CorrectionPlan(tuple(names), options, batch_normalize=section.batch_normalize)
        except PlanError as e:
            refuse(e.key, section.rule if e.key == "rule" else e.value, e.expected)
        else:
            section.options = plan.options
            if section.preset is not None:  # recorded expanded (recipe.yaml reads back without the preset)
                section.rule, section.preset = list(names) or "none", None
    if errors:
        if salvage is not None:
            salvage.keys.append(prefix)
            return CorrectionSection()
        raise RecipeError.several(errors)
    return section


def _build_rule_options(name: str, value: Any, chosen: bool, names: list[str], base: Any, prefix: str, where: str,
                        errors: list[RecipeError]) -> Any:
    """``parity.correction.<name>: {...}`` into the rule's options (over ``base``, a preset's), or None (an error)."""
    key = f"{prefix}.{name}"
    rule = get_rule(name)
    own = rule.option_names()
    if not chosen:  # named per option, so that a --set of one is named back
        why = (f"options of {name}, which is not a chosen rule ({prefix}.rule: {', '.join(names) or 'none'}); choose "
               "it or remove its options")
        given = value.items() if isinstance(value, dict) and value else [(None, value)]
        errors.extend(RecipeError(f"{where}: {key if k is None else f'{key}.{k}'} = {v!r}: {why}") for k, v in given)
        return None
    if not isinstance(value, dict):
        errors.append(RecipeError(f"{where}: {key} = {value!r}: expected a mapping of {name}'s options "
                                  f"({', '.join(own)})"))
        return None
    bad = False
    for k, v in value.items():
        if k in own:
            continue
        bad = True
        owners = [r.name for r in correction_rules() if k in r.option_names()]
        if owners:
            errors.append(RecipeError(f"{where}: {key}.{k} = {v!r}: not an option of {name}; it belongs to "
                                      f"{', '.join(owners)} (options of {name}: {', '.join(own)})"))
        else:
            errors.append(RecipeError(f"{where}: unknown key '{key}.{k}'{_did_you_mean(k, own, key)}; valid keys "
                                      f"here: {', '.join(own)}"))
    if bad:
        return None
    merged = {**(dataclasses.asdict(base) if base is not None else {}), **value}
    try:
        return _build_plain(rule.options, merged, key, where)
    except RuleOptionError as e:
        errors.append(RecipeError(f"{where}: {key}.{e.key} = {e.value!r}: expected {e.expected} ({name}: "
                                  f"{rule.formula})"))
    except RecipeError as e:
        errors.append(e)
    return None


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


def read_utf8(p: Path, where: str) -> str:
    """The recipe's text; a file that is not UTF-8 is refused naming the first bad byte's offset and line.

    Read as bytes and decoded here, not with ``read_text()``: that uses the locale's encoding, and a
    decode error would reach the user as a traceback without the file's name.
    """
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise RecipeError(f"{where}: cannot be read: {e.strerror or e}") from None
    text, problem = decode_utf8(raw)
    if problem:
        raise RecipeError(f"{where}: {problem}")
    return text


def load_recipe_dict(path: str | os.PathLike, overrides: list[str] = ()) -> tuple[dict, str]:
    p = Path(path)
    where = str(p)
    if not p.is_file():
        raise RecipeError(f"{where}: recipe file not found")
    try:
        data = load_unique(read_utf8(p, where))
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


def build_and_validate(cls: type, data: dict, where: str, validate_fn: Callable[[Any], None], overrides: Iterable[str] = ()):
    """``build_config`` then ``validate_fn(cfg)``; when the build refuses a value or a key, the recipe's other
    problems are reported with it: the config is built again without the refused keys (``_Salvage``) and
    validated, keeping the problems that do not name a refused key (those would judge a default, not the
    recipe). A problem with a key that came from ``overrides`` names that ``--set`` instead of the file."""
    try:
        cfg = build_config(cls, data, where)
    except RecipeError as e:
        problems = RecipeError.several([e, *_problems_beside(cls, data, where, validate_fn)])
        raise name_overrides(problems, where, overrides) from None
    try:
        validate_fn(cfg)
    except RecipeError as e:
        raise name_overrides(e, where, overrides) from None
    return cfg


_UNKNOWN_KEY = re.compile(r"^unknown key '([^']+)'")
_KEY_VALUE = re.compile(r"^([A-Za-z_][\w.\[\]-]*) = ")


def name_overrides(error: RecipeError, where: str, overrides: Iterable[str]) -> RecipeError:
    """``error`` with each problem about a key a ``--set`` gave starting ``--set key=value: `` instead of the
    recipe file's name (the user looks for the mistake where the line says it is)."""
    given = [(parse_override(o)[0], o) for o in overrides]
    if not given:
        return error
    lines = []
    for line in error.problems:
        body = line[len(where) + 2:] if line.startswith(f"{where}: ") else None
        m = body is not None and (_UNKNOWN_KEY.match(body) or _KEY_VALUE.match(body))
        source = next((o for k, o in reversed(given)
                       if m and (m.group(1) == k or m.group(1).startswith((k + ".", k + "[")))), None)
        lines.append(f"--set {source}: {body}" if source else line)
    return RecipeError.several([RecipeError(line) for line in lines])


def _problems_beside(cls: type, data: dict, where: str, validate_fn: Callable[[Any], None]) -> list[RecipeError]:
    salvage = _Salvage()
    try:
        validate_fn(_build(cls, data, "", where, salvage))
    except RecipeError as e:
        mention = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in salvage.keys) + r")(?!\w)")
        body = lambda line: line[len(where) + 2:] if line.startswith(f"{where}: ") else line
        return [RecipeError(line) for line in e.problems if not (salvage.keys and mention.search(body(line)))]
    except Exception:  # a rule tripping over a salvaged value: the build's own problems are reported alone
        return []
    return []


def read_recipe(path: str | os.PathLike, overrides: list[str] = (), checks: Iterable[Check] = ()) -> RunConfig:
    """Read, override, type-check and validate a training recipe on its own (``trainer.lifecycle.preflight.load_recipe``
    also checks the files and models it names). ``checks``: validation sections of the caller's, reported
    with this package's own (``trainer.config.validate.validate``). Every problem is reported at once, those
    found beside a refused key included (``build_and_validate``)."""
    data, where = load_recipe_dict(path, overrides)
    return build_and_validate(RunConfig, data, where, lambda cfg: validate(cfg, where, checks), overrides)


def read_recipe_leniently(path: str | os.PathLike, overrides: list[str] = (), checks: Iterable[Check] = ()
                          ) -> tuple[RunConfig, Optional[RecipeError], list[str]]:
    """``read_recipe`` that still gives a config when the recipe has problems, so that the files and models it
    names can be checked in the same pass: (config, its problems or None, the keys left at their defaults).

    With problems the config is the lenient build (``_Salvage``): a refused key holds its default, and a value
    validation refused is kept as written. A recipe file that cannot be read at all still raises."""
    data, where = load_recipe_dict(path, overrides)
    try:
        return build_and_validate(RunConfig, data, where, lambda cfg: validate(cfg, where, checks), overrides), None, []
    except RecipeError as e:
        salvage = _Salvage()
        try:
            return _build(RunConfig, data, "", where, salvage), e, salvage.keys
        except Exception:  # noqa: BLE001 - nothing to check the files against: the recipe's own problems alone
            raise e from None
