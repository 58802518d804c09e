"""An assistant turn's text, parsed into the message an environment's ``step`` receives.

The message (the issue's contract, plus the calls that did not parse)::

    {"role": "assistant",
     "content": str,                     # the text outside tool calls, stripped
     "tool_calls": [{"type": "function", "function": {"name": str, "arguments": dict}}, ...],
     "tool_call_errors": [str, ...]}     # one entry per call that did not parse: a reason and the raw text

``tool_calls`` has the shape chat templates render (Qwen2.5's, Llama 3.1's: ``function.name``,
``function.arguments``), so the message can go back into a template as it is.

Two parsers:

* The tokenizer's own, where it has one. transformers 5 (read in 5.19) gives a tokenizer a ``response_template``
  attribute (a declarative spec: regions such as ``thinking``, ``tool_calls``, ``content`` with their delimiters)
  and ``tokenizer.parse_response(text, prefix=...)`` that applies it; ``transformers.utils.chat_parsing`` holds
  the parser. Few tokenizers ship one yet (``transformers serve`` keeps fallbacks per model type in
  ``cli/serving/utils.py``, not reachable from a tokenizer), so it is used only when ``response_template`` is set.
  A template parse fails as a whole when one call's JSON is broken; the turn is then parsed as Hermes, which
  records each broken block alone, and when Hermes finds no block the template parser's error is the one entry.
* Hermes (NousResearch's format, also Qwen2.5's): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, any number per turn. A block that is not a JSON object with a str ``name`` and an object
  ``arguments`` (a JSON string holding an object is taken; absent means ``{}``), or a ``<tool_call>`` never
  closed, is an entry of ``tool_call_errors``, never an exception.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["parse_assistant", "parse_hermes"]

_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_OPEN = "<tool_call>"


def parse_assistant(text: str, tokenizer: Any = None, *, prefix: str = "", tools: list | None = None) -> dict:
    """The message of an assistant turn whose text is ``text`` (see the module docstring for its shape).

    Args:
        text: the turn's sampled ids decoded (special tokens kept or skipped: both parse).
        tokenizer: used when it has a ``response_template`` (transformers 5); otherwise Hermes blocks are parsed.
        prefix: the text the turn continues (the decoded prompt and history), which a ``response_template``
            needs when the template pre-writes part of the turn (e.g. an opening ``<think>``); "" is fine else.
        tools: the JSON schemas offered, passed to ``parse_response`` to cast arguments to their declared types.
    """
    if not isinstance(text, str):
        raise TypeError(f"text is a {type(text).__name__}; expected the assistant turn's decoded text (str)")
    if tokenizer is not None and getattr(tokenizer, "response_template", None):
        try:
            parsed = tokenizer.parse_response(text, prefix=prefix, tools=tools)
        except (ValueError, TypeError, KeyError) as e:
            hermes = parse_hermes(text)
            if hermes["tool_calls"] or hermes["tool_call_errors"]:
                return hermes
            return {**hermes, "tool_call_errors": [f"the tokenizer's response_template could not parse the turn: "
                                                   f"{type(e).__name__}: {e}"]}
        return _from_template(parsed)
    return parse_hermes(text)


def parse_hermes(text: str) -> dict:
    """The message of ``text`` with Hermes ``<tool_call>`` blocks parsed (see the module docstring)."""
    calls, errors, outside, pos = [], [], [], 0
    for m in _BLOCK.finditer(text):
        outside.append(text[pos:m.start()])
        pos = m.end()
        call, error = _hermes_call(m.group(1))
        if error is None:
            calls.append(call)
        else:
            errors.append(f"{error}: {m.group(0)!r}")
    rest = text[pos:]
    if _OPEN in rest:  # a block opened and never closed (e.g. the turn hit its token limit)
        at = rest.index(_OPEN)
        errors.append(f"<tool_call> is not closed by </tool_call>: {rest[at:]!r}")
        rest = rest[:at]
    outside.append(rest)
    return {"role": "assistant", "content": "".join(outside).strip(), "tool_calls": calls, "tool_call_errors": errors}


def _hermes_call(body: str) -> tuple[dict | None, str | None]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"
    return _function_call(obj)


def _function_call(obj: Any) -> tuple[dict | None, str | None]:
    """``obj`` (``{"name", "arguments"}``, or OpenAI's ``{"type", "function": {...}}``) as a checked call."""
    if isinstance(obj, dict) and isinstance(obj.get("function"), dict):
        obj = obj["function"]
    if not isinstance(obj, dict):
        return None, f"the tool call is a JSON {type(obj).__name__}; expected an object with 'name' and 'arguments'"
    name, arguments = obj.get("name"), obj.get("arguments", {})
    if not isinstance(name, str) or not name:
        return None, f"the tool call's 'name' is {name!r}; expected the tool's name as a string"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return None, f"the tool call's 'arguments' is a string that is not a JSON object: {arguments!r}"
    if not isinstance(arguments, dict):
        return None, f"the tool call's 'arguments' is {type(arguments).__name__}; expected a JSON object"
    return {"type": "function", "function": {"name": name, "arguments": arguments}}, None


def _from_template(parsed: Any) -> dict:
    """``parse_response``'s dict in the module's message shape (its extra fields, e.g. ``thinking``, kept)."""
    if not isinstance(parsed, dict):
        return {"role": "assistant", "content": "", "tool_calls": [], "tool_call_errors": [
            f"the tokenizer's response_template parsed the turn into a {type(parsed).__name__}; expected a dict"]}
    message = dict(parsed)
    content = message.get("content")
    message["role"] = "assistant"
    message["content"] = content.strip() if isinstance(content, str) else ""
    calls, errors = [], []
    for raw in message.get("tool_calls") or []:
        call, error = _function_call(raw)
        if error is None:
            calls.append(call)
        else:
            errors.append(f"{error}: {raw!r}")
    message["tool_calls"], message["tool_call_errors"] = calls, errors
    return message
