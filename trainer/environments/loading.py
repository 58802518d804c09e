"""Environments named in a recipe, with the loading rules of reward functions (``trainer.rewards.functions``).

Specs::

    builtin:<name>           a built-in (``BUILTIN_ENVIRONMENTS`` for env.class, ``BUILTIN_TOOLS`` for env.tools)
    package.module:Name      any importable module; the attribute may be dotted (``pkg.mod:Outer.Inner``)
    path/to/file.py:Name     a Python file loaded by path (relative to the current directory)

``resolve_environment_class`` resolves and checks a class against the contract (``contract.Environment``):
constructible with no arguments (one instance per episode), with callable ``reset(row)`` and ``step(message)``
each taking exactly one argument. ``resolve_tools`` resolves a mapping name -> function (or a list of functions)
and checks it by building a ``Toolbox`` (type hints and docstrings). Every error names the spec and what was
expected, so the recipe validator can report it before the engine starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from trainer.environments.arithmetic_tools import TOOLS as ARITHMETIC_TOOLS, ArithmeticCalculator
from trainer.environments.tools import Toolbox

# The reward functions' own import (a private module name per file path, the current directory searched under
# the installed console script), so an environment file loads exactly as a reward file does.
from trainer.rewards.functions import import_spec_module

__all__ = ["BUILTIN_ENVIRONMENTS", "BUILTIN_TOOLS", "check_environment_class", "resolve_environment_class",
           "resolve_tools"]

BUILTIN_ENVIRONMENTS: dict[str, type] = {"arithmetic_calculator": ArithmeticCalculator}
BUILTIN_TOOLS: dict[str, Mapping[str, Callable[..., Any]]] = {"arithmetic_calculator": ARITHMETIC_TOOLS}

_SPEC_HELP = "expected 'module:Name', 'path/to/file.py:Name' or 'builtin:<name>'"


def resolve_environment_class(spec: str) -> type:
    """The environment class named by ``spec``, checked by ``check_environment_class``."""
    cls = _resolve(spec, "environment", BUILTIN_ENVIRONMENTS)
    check_environment_class(cls, spec)
    return cls


def resolve_tools(spec: str) -> Toolbox:
    """The tools named by ``spec`` (a mapping name -> function, or a list of functions), as a checked ``Toolbox``."""
    tools = _resolve(spec, "tools", BUILTIN_TOOLS)
    if not isinstance(tools, (Mapping, list, tuple)):
        raise TypeError(f"tools spec {spec!r} names a {type(tools).__name__}; expected a mapping name -> function "
                        "or a list of functions")
    try:
        return Toolbox(tools)
    except (TypeError, ValueError) as e:
        raise type(e)(f"tools spec {spec!r}: {e}") from e


def check_environment_class(cls: Any, spec: str) -> None:
    """Raise ``TypeError`` naming ``spec`` unless ``cls`` is a class following the environment contract."""
    where = f"environment spec {spec!r}"
    if not inspect.isclass(cls):
        raise TypeError(f"{where} names a {type(cls).__name__}; expected a class with reset(self, row) and "
                        "step(self, message) (one instance per episode)")
    where = f"{where} (class {cls.__qualname__})"
    try:
        inspect.signature(cls).bind()
    except TypeError:
        raise TypeError(f"{where}: its constructor {cls.__qualname__}{inspect.signature(cls)} needs arguments; "
                        "expected one callable with none (the loop makes one instance per episode)") from None
    except ValueError:  # no signature to read (a builtin type): calling it is the test
        pass
    for method, argument in (("reset", "row"), ("step", "message")):
        fn = getattr(cls, method, None)
        if fn is None:
            raise TypeError(f"{where} has no method {method}(self, {argument}); expected reset(self, row) -> "
                            "list[dict] | None and step(self, message) -> (messages, reward, done)")
        if not callable(fn):
            raise TypeError(f"{where}: {method} is a {type(fn).__name__}, not a method; expected "
                            f"{method}(self, {argument})")
        _check_arity(cls, method, argument, where)


def _check_arity(cls: type, method: str, argument: str, where: str) -> None:
    """The method must accept exactly one positional argument after ``self`` (static and class methods: one)."""
    try:
        signature = inspect.signature(getattr(cls, method))
    except (TypeError, ValueError):  # a builtin or C method: nothing to read
        return
    bound_to_class = isinstance(inspect.getattr_static(cls, method), (staticmethod, classmethod))
    receiver = () if bound_to_class else (object(),)
    try:
        signature.bind(*receiver, object())
    except TypeError:
        raise TypeError(f"{where}: {method}{signature} must take one argument ({argument}); expected "
                        f"{method}(self, {argument})") from None
    try:
        signature.bind(*receiver, object(), object())
    except TypeError:
        return
    raise TypeError(f"{where}: {method}{signature} takes more than one argument; expected {method}(self, "
                    f"{argument})")


def _resolve(spec: Any, kind: str, builtins: Mapping[str, Any]) -> Any:
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"malformed {kind} spec {spec!r}; {_SPEC_HELP}")
    module_part, attr = (s.strip() for s in spec.split(":"))
    if not module_part or not attr:
        raise ValueError(f"malformed {kind} spec {spec!r}; {_SPEC_HELP}")
    if module_part == "builtin":
        if attr not in builtins:
            names = sorted("builtin:" + n for n in builtins)
            raise ValueError(f"unknown builtin {kind} {spec!r}; expected one of {names}")
        return builtins[attr]
    try:
        module = import_spec_module(module_part, spec)
    except (ImportError, FileNotFoundError) as e:  # their messages say "reward spec"; this one is not
        raise type(e)(str(e).replace("reward spec", f"{kind} spec", 1)) from e
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = module_part if i == 0 else f"{module_part}:{'.'.join(attr.split('.')[:i])}"
            public = sorted(n for n in dir(obj) if not n.startswith("_"))
            raise AttributeError(f"{kind} spec {spec!r}: {owner!r} has no attribute {part!r}; it has: {public}")
        obj = getattr(obj, part)
    return obj
