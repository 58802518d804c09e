"""A tool environment from plain Python functions: ``name -> function``, one ``ToolEnvironment`` per episode.

``Toolbox(tools)`` checks the functions once (JSON schemas from type hints and Google-style docstrings by
``transformers.utils.get_json_schema``; a function without either is refused at construction, by name) and holds
the schemas the chat template offers (``apply_chat_template(tools=toolbox.schemas)``). ``ToolEnvironment`` follows
the environment contract (``trainer.environments.contract``):

* ``reset(row)`` appends nothing (the tools are offered by the template, the task by the dataset's prompt);
* ``step(message)`` runs each parsed call of the assistant's turn, in order, each within ``timeout_s``, and
  returns one ``tool`` message per call, then one per call that did not parse; reward None (the recipe's reward
  functions score the episode); done when the turn has no call at all (the final answer) or when it was the
  ``max_turns``-th assistant turn, whose calls are then not run (no turn would read their results).

Whatever goes wrong in a call goes back to the model as the tool message's content, ``"Error: ..."``, and is
counted in ``tool_errors``, never raised: an unknown tool, arguments the schema refuses, a call that did not
parse, a function that raises (``SystemExit`` included), overstays ``timeout_s``, or returns something that is
neither a str nor JSON-serialisable (a str is passed as is; anything else as ``json.dumps``).

Time limit: each call runs in a worker thread the caller waits on with a timeout, as reward functions do
(trainer/rewards/time_limit.py says why not signals or subprocesses). A thread cannot be killed: a call that
overstays is abandoned (a daemon thread, counted in ``tool_timeouts``), so a tool that hangs every time leaves a
thread per call; the loop can stop a run on that count.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["ToolEnvironment", "Toolbox"]

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
    "object": (dict,), "null": (type(None),),
}


class Toolbox:
    """Checked tools and their JSON schemas; built once, shared by every episode's ``ToolEnvironment``.

    Args:
        tools: name -> function, or a sequence of functions (named by ``__name__``). The name is what the model
            calls; it replaces the function's own name in its schema.

    Attributes:
        functions: name -> function.
        schemas: the chat-template tool list, ``[{"type": "function", "function": {"name", "description",
            "parameters"}}]``, in the order given.

    Raises:
        TypeError / ValueError naming the tool: not callable, no type hints or no docstring (with a description
        of each argument), a name that is not a non-empty str, or no tools at all.
    """

    def __init__(self, tools: Mapping[str, Callable[..., Any]] | Sequence[Callable[..., Any]]):
        from transformers.utils import get_json_schema

        if isinstance(tools, Mapping):
            items = list(tools.items())
        elif isinstance(tools, (list, tuple)):
            items = [(getattr(fn, "__name__", repr(fn)), fn) for fn in tools]
        else:
            raise TypeError(f"tools is a {type(tools).__name__}; expected a mapping name -> function or a list of "
                            "functions")
        if not items:
            raise ValueError("tools is empty; a tool environment needs at least one tool")
        self.functions: dict[str, Callable[..., Any]] = {}
        self.schemas: list[dict] = []
        for name, fn in items:
            if not isinstance(name, str) or not name:
                raise ValueError(f"tool name {name!r} must be a non-empty str")
            if name in self.functions:
                raise ValueError(f"tool {name!r} is given twice")
            if not callable(fn):
                raise TypeError(f"tool {name!r} is a {type(fn).__name__}, which is not callable")
            try:
                schema = get_json_schema(fn)
            except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException
                raise TypeError(
                    f"tool {name!r} ({_qualname(fn)}): its JSON schema cannot be made from its signature and "
                    f"docstring: {e}. Expected type hints on every argument and a Google-style docstring with "
                    "a description and an 'Args:' line per argument"
                ) from e
            schema["function"]["name"] = name
            schema["function"].pop("return", None)  # chat templates ignore it; kept out of the prompt
            self.functions[name] = fn
            self.schemas.append(schema)
        self._parameters = {s["function"]["name"]: s["function"]["parameters"] for s in self.schemas}

    def argument_error(self, name: str, arguments: dict) -> str | None:
        """Why ``arguments`` do not fit tool ``name``'s schema (missing, unknown, or of another JSON type), or None."""
        parameters = self._parameters[name]
        properties = parameters.get("properties", {})
        missing = [p for p in parameters.get("required", []) if p not in arguments]
        unknown = [a for a in arguments if a not in properties]
        if missing or unknown:
            parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
            return f"tool {name!r} takes arguments {list(properties)}; {', '.join(parts)}"
        for key, value in arguments.items():
            if not _fits(value, properties[key]):
                expected = properties[key].get("type")
                return f"tool {name!r}: argument {key!r} is {json.dumps(value)}; expected a JSON {expected}"
        return None


class ToolEnvironment:
    """One episode of a tool-using model (see the module docstring for what ``step`` does).

    Args:
        tools: a ``Toolbox``, or what ``Toolbox`` takes (then checked here; build one ``Toolbox`` to share).
        max_turns: assistant turns in the episode (>= 1).
        timeout_s: seconds for one tool call (> 0), or None: calls run in the caller's thread, unbounded.

    Attributes (per episode): ``turns`` (assistant turns stepped), ``tool_calls`` (calls attempted, parsed or
    not), ``tool_errors`` (those that went back as an error), ``tool_timeouts`` (of those, calls abandoned).
    """

    def __init__(self, tools: Toolbox | Mapping[str, Callable[..., Any]] | Sequence[Callable[..., Any]], *,
                 max_turns: int, timeout_s: float | None = 10.0):
        if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
            raise ValueError(f"max_turns={max_turns!r} must be an int >= 1")
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                      or not timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds or None")
        self.toolbox = tools if isinstance(tools, Toolbox) else Toolbox(tools)
        self.max_turns, self.timeout_s = max_turns, timeout_s
        self.turns = self.tool_calls = self.tool_errors = self.tool_timeouts = 0

    @property
    def schemas(self) -> list[dict]:
        """The tools as the chat template takes them (``apply_chat_template(tools=...)``)."""
        return self.toolbox.schemas

    def reset(self, row: dict) -> None:
        """Nothing to append: the prompt states the task and the template offers the tools."""
        self.turns = self.tool_calls = self.tool_errors = self.tool_timeouts = 0
        return None

    def step(self, message: dict) -> tuple[list[dict], None, bool]:
        """``(tool messages, None, done)`` for the assistant's parsed turn ``message`` (``tool_calls.py``'s shape)."""
        self.turns += 1
        calls = list(message.get("tool_calls") or [])
        unparsed = list(message.get("tool_call_errors") or [])
        if not calls and not unparsed:
            return [], None, True
        if self.turns >= self.max_turns:
            return [], None, True
        replies = []
        for call in calls:
            self.tool_calls += 1
            name, content = self._run(call)
            replies.append({"role": "tool", "name": name, "content": content})
        for error in unparsed:
            self.tool_calls += 1
            self.tool_errors += 1
            replies.append({"role": "tool", "content": f"Error: the tool call could not be parsed: {error}"})
        return replies, None, False

    def _run(self, call: dict) -> tuple[str, str]:
        """(tool name, the tool message's content) of one parsed call; errors counted here."""
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", {}) if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return str(name), self._error(f"malformed tool call {call!r}; expected "
                                          "{'function': {'name': str, 'arguments': dict}}")
        if name not in self.toolbox.functions:
            return name, self._error(f"unknown tool {name!r}; the tools are {list(self.toolbox.functions)}")
        bad = self.toolbox.argument_error(name, arguments)
        if bad is not None:
            return name, self._error(bad)
        outcome = _call_bounded(self.toolbox.functions[name], arguments, self.timeout_s, f"tool:{name}")
        if outcome is _TIMED_OUT:
            self.tool_timeouts += 1
            return name, self._error(f"tool {name!r} did not return within {self.timeout_s:g} s")
        ok, value = outcome
        if not ok:
            return name, self._error(f"tool {name!r} raised {type(value).__name__}: {value}")
        if isinstance(value, str):
            return name, value
        try:
            return name, json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            return name, self._error(f"tool {name!r} returned a {type(value).__name__}, which is neither text nor "
                                     f"JSON-serialisable ({e})")

    def _error(self, text: str) -> str:
        self.tool_errors += 1
        return f"Error: {text}"


_TIMED_OUT = object()


def _call_bounded(fn: Callable[..., Any], kwargs: dict, timeout_s: float | None, thread_name: str) -> Any:
    """``(True, result)``, ``(False, exception)`` or ``_TIMED_OUT``; the worker thread is abandoned on timeout."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = (True, fn(**kwargs))
        except BaseException as e:  # noqa: BLE001 - SystemExit from a tool is the tool's failure, not an exit
            box["out"] = (False, e)

    if timeout_s is None:
        target()
        return box["out"]
    worker = threading.Thread(target=target, name=thread_name, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return _TIMED_OUT if worker.is_alive() else box["out"]


def _fits(value: Any, schema: dict) -> bool:
    """Whether ``value`` has a JSON type ``schema`` allows (a schema without a type allows anything)."""
    declared = schema.get("type")
    types = [declared] if isinstance(declared, str) else list(declared or [])
    types += [t for choice in schema.get("anyOf", []) for t in ([choice.get("type")] if choice.get("type") else [])]
    if schema.get("nullable"):
        types.append("null")
    if not types:
        return True
    for t in types:
        python = _JSON_TYPES.get(t)
        if python is None:
            return True  # a type this check does not know: the function decides
        if isinstance(value, bool) and t not in ("boolean",):
            continue  # JSON true is not a number
        if isinstance(value, python):
            return True
    return False


def _qualname(fn: Callable[..., Any]) -> str:
    module = getattr(fn, "__module__", None)
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}.{qual}" if module else qual
