"""Reward functions: resolving them from recipe strings and combining their scores.

Every reward function follows one convention::

    f(prompts: list[str], completions: list[str], **columns) -> list[float]

where ``columns`` are the prompt dataset's other columns (e.g. ``answer``),
each a list aligned with ``prompts``. A function takes the columns it needs
by name and should accept ``**kwargs`` for the rest.

Reward specs (``resolve_reward``):

* ``builtin:<task>.<name>`` — a built-in reward from ``trainer.data.tasks.BUILTIN_REWARDS``,
  e.g. ``builtin:arithmetic.exact_answer``, ``builtin:arithmetic.format``.
* ``package.module:function`` — any importable module; the attribute may be
  dotted (``pkg.mod:Class.method``).
* ``path/to/file.py:function`` — a Python file, loaded by path (relative paths
  are resolved against the current directory).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainer.data.tasks import BUILTIN_REWARDS
from trainer.rewards.time_limit import RewardError, exit_error

__all__ = ["RewardFn", "compute_rewards", "import_spec_module", "resolve_reward"]

RewardFn = Callable[..., Sequence[float]]

_SPEC_HELP = "expected 'module:function', 'path/to/file.py:function' or 'builtin:<task>.<name>'"


def resolve_reward(spec: str) -> RewardFn:
    """The callable named by ``spec`` (see the module docstring for the forms)."""
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"malformed reward spec {spec!r}; {_SPEC_HELP}")
    module_part, attr = (s.strip() for s in spec.split(":"))
    if not module_part or not attr:
        raise ValueError(f"malformed reward spec {spec!r}; {_SPEC_HELP}")
    if module_part == "builtin":
        if attr not in BUILTIN_REWARDS:
            raise ValueError(
                f"unknown builtin reward {spec!r}; expected one of {sorted('builtin:' + n for n in BUILTIN_REWARDS)}"
            )
        return BUILTIN_REWARDS[attr]

    module = _import(module_part, spec)
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            owner = module_part if i == 0 else f"{module_part}:{'.'.join(attr.split('.')[:i])}"
            public = sorted(n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None)))
            raise AttributeError(
                f"reward spec {spec!r}: {owner!r} has no attribute {part!r}; its public callables: {public}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"reward spec {spec!r} names a {type(obj).__name__}, which is not callable")
    return obj


def import_spec_module(module_part: str, spec: str):
    """The module of a ``module:attr`` or ``path/to/file.py:attr`` spec, imported as reward specs are.

    Environments (``trainer.environments.loading``) load the same way; errors name ``spec``."""
    return _import(module_part, spec)


def _import(module_part: str, spec: str):
    if module_part.endswith(".py"):
        path = Path(module_part).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"reward spec {spec!r}: file {str(path)!r} does not exist")
        # A private module name per path, so two reward files named alike don't clash.
        name = f"parityrl_reward_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            raise ImportError(f"reward spec {spec!r}: executing {str(path)!r} failed: {type(e).__name__}: {e}") from e
        return module
    try:
        try:
            return importlib.import_module(module_part)
        except ModuleNotFoundError as e:
            if not _search_current_directory(module_part, e):
                raise
            return importlib.import_module(module_part)
    except ImportError as e:
        raise ImportError(f"reward spec {spec!r}: cannot import module {module_part!r}: {type(e).__name__}: {e}") from e


def _search_current_directory(module_part: str, error: ModuleNotFoundError) -> bool:
    """Put the current directory on ``sys.path`` (last) when the module is there but could not be found.

    ``python -m`` and ``python script.py`` search the current directory; an installed console script
    (``parityrl``) searches its own bin directory instead, so ``my_rewards:f`` next to the recipe would
    otherwise not import. True when the directory was added."""
    top = module_part.split(".")[0]
    here = Path.cwd()
    if error.name != top or str(here) in sys.path or "" in sys.path:
        return False
    if not ((here / f"{top}.py").is_file() or (here / top).is_dir()):
        return False
    sys.path.append(str(here))
    return True


def compute_rewards(
    fns: dict[str, RewardFn],
    weights: dict[str, float],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: dict[str, Sequence[Any]],
) -> tuple[list[float], dict[str, list[float]]]:
    """Call every reward function and combine: ``total[i] = sum_k weights[k] * per_fn[k][i]``.

    Args:
        fns: name -> reward function (names become metric keys, e.g. ``reward/<name>``).
        weights: name -> finite weight; a function without an entry weighs 1.0;
            a weight for an unknown name is refused (a typo would otherwise be silent).
        prompts, completions: length-N lists, completion i answers prompt i.
        columns: dataset columns, each a length-N list, passed as keyword arguments.

    Returns:
        ``(total, per_fn)``: a length-N list, and name -> the function's length-N list
        of floats.

    Raises:
        ValueError naming the function (and sample index) if a function returns
        the wrong length, a non-number, or NaN/inf; exceptions raised inside a
        function propagate with a note naming it; a ``BaseException`` that is not an
        ``Exception`` (``SystemExit``, ``KeyboardInterrupt`` raised by the function)
        becomes ``RewardError`` naming it (trainer/rewards/time_limit.py says why).
    """
    if not fns:
        raise ValueError("fns is empty; at least one reward function is required")
    unknown = sorted(set(weights) - set(fns))
    if unknown:
        raise ValueError(f"weights given for unknown reward function(s) {unknown}; reward functions: {sorted(fns)}")
    for name, w in weights.items():
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise ValueError(f"weights[{name!r}]={w!r} must be a finite number")
    n = len(prompts)
    if len(completions) != n:
        raise ValueError(f"completions has {len(completions)} items but prompts has {n}")
    for key, col in columns.items():
        if key in ("prompts", "completions"):
            raise ValueError(f"column name {key!r} clashes with the reward function argument of the same name")
        if len(col) != n:
            raise ValueError(f"column {key!r} has {len(col)} items but prompts has {n}")

    per_fn: dict[str, list[float]] = {}
    for name, fn in fns.items():
        try:
            out = fn(list(prompts), list(completions), **{k: list(v) for k, v in columns.items()})
        except RewardError:  # its message names the function
            raise
        except Exception as e:
            e.add_note(f"raised by reward function {name!r}")
            raise
        except BaseException as e:  # SystemExit, KeyboardInterrupt raised by the function: a failure, not an exit
            raise exit_error(name, e) from e
        per_fn[name] = _validated(name, out, n)
    total = [sum(float(weights.get(name, 1.0)) * per_fn[name][i] for name in fns) for i in range(n)]
    return total, per_fn


def _validated(name: str, out: Any, n: int) -> list[float]:
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        raise ValueError(f"reward function {name!r} returned {type(out).__name__}, expected a list of {n} floats")
    if len(out) != n:
        raise ValueError(f"reward function {name!r} returned {len(out)} rewards for {n} samples")
    values = []
    for i, v in enumerate(out):
        if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:  # numpy / torch scalars
            v = v.item()
        if not isinstance(v, numbers.Real):  # bools count: True -> 1.0
            raise ValueError(
                f"reward function {name!r} returned {v!r} ({type(v).__name__}) at sample {i}, expected a number"
            )
        v = float(v)
        if not math.isfinite(v):
            raise ValueError(f"reward function {name!r} returned {v} at sample {i}, expected a finite number")
        values.append(v)
    return values
