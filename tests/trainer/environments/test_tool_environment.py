"""ToolEnvironment: schemas from the functions, calls run under a time limit, every failure a counted tool message."""
from __future__ import annotations

import threading

import pytest

from trainer.environments.contract import Environment, check_step_result
from trainer.environments.tool_calls import parse_assistant
from trainer.environments.tools import Toolbox, ToolEnvironment


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    return text.upper()


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: Ignored.
    """
    raise RuntimeError("disk on fire")


def leaves(x: int) -> int:
    """Exits.

    Args:
        x: Ignored.
    """
    raise SystemExit(3)


RELEASE = threading.Event()


def hangs(x: int) -> int:
    """Waits until the test releases it.

    Args:
        x: Ignored.
    """
    RELEASE.wait(30)
    return x


def returns_a_set(x: int) -> set:
    """Returns what JSON cannot hold.

    Args:
        x: Ignored.
    """
    return {x}


TOOLS = {"add": add, "shout": shout, "broken": broken, "leaves": leaves, "hangs": hangs, "a_set": returns_a_set}


def turn(*calls, text=""):
    body = "".join(f"<tool_call>{c}</tool_call>" for c in calls)
    return parse_assistant(text + body)


def test_schemas_come_from_type_hints_and_docstrings_under_the_given_names():
    toolbox = Toolbox({"plus": add, "shout": shout})
    assert toolbox.schemas[0] == {"type": "function", "function": {
        "name": "plus", "description": "Add two integers.",
        "parameters": {"type": "object", "required": ["a", "b"], "properties": {
            "a": {"type": "integer", "description": "The first integer."},
            "b": {"type": "integer", "description": "The second integer."}}}}}
    assert [s["function"]["name"] for s in Toolbox([add, shout]).schemas] == ["add", "shout"]


def no_hints(x):
    """Has a docstring.

    Args:
        x: Something.
    """


def no_docstring(x: int) -> int:
    return x


@pytest.mark.parametrize("tools, message", [
    ({"f": no_hints}, r"tool 'f' \(.*no_hints\): its JSON schema cannot be made.*missing a type hint"),
    ({"g": no_docstring}, r"tool 'g' \(.*no_docstring\): .*no docstring"),
    ({"h": 3}, "tool 'h' is a int, which is not callable"),
    ({}, "tools is empty"),
    ("add", "tools is a str; expected a mapping"),
])
def test_a_tool_that_cannot_be_described_is_refused_at_construction_by_name(tools, message):
    with pytest.raises((TypeError, ValueError), match=message):
        ToolEnvironment(tools, max_turns=2)


def test_a_call_runs_and_its_result_goes_back_as_a_tool_message():
    env = ToolEnvironment(TOOLS, max_turns=4)
    assert isinstance(env, Environment) and env.reset({"prompt": "p"}) is None
    out = env.step(turn('{"name": "add", "arguments": {"a": 2, "b": 3}}', '{"name": "shout", "arguments": {"text": "hi"}}'))
    assert check_step_result(out, "ToolEnvironment") == (
        [{"role": "tool", "name": "add", "content": "5"}, {"role": "tool", "name": "shout", "content": "HI"}],
        None, False)
    assert (env.turns, env.tool_calls, env.tool_errors) == (1, 2, 0)


def test_an_answer_without_a_call_ends_the_episode():
    env = ToolEnvironment(TOOLS, max_turns=4)
    assert env.step(parse_assistant("The answer is 5.")) == ([], None, True)
    assert (env.turns, env.tool_calls, env.tool_errors) == (1, 0, 0)


def test_the_last_allowed_turn_ends_the_episode_without_running_its_calls():
    env = ToolEnvironment(TOOLS, max_turns=2)
    call = '{"name": "add", "arguments": {"a": 1, "b": 1}}'
    assert env.step(turn(call))[2] is False
    assert env.step(turn(call)) == ([], None, True)
    assert (env.turns, env.tool_calls) == (2, 1)


@pytest.mark.parametrize("call, error", [
    ('{"name": "nope", "arguments": {}}', "Error: unknown tool 'nope'; the tools are ['add', 'shout'"),
    ('{"name": "add", "arguments": {"a": 1}}', "Error: tool 'add' takes arguments ['a', 'b']; missing ['b']"),
    ('{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}', "unknown ['c']"),
    ('{"name": "add", "arguments": {"a": "1", "b": 2}}', "Error: tool 'add': argument 'a' is \"1\"; expected a JSON integer"),
    ('{"name": "add", "arguments": {"a": true, "b": 2}}', "argument 'a' is true; expected a JSON integer"),
    ('{"name": "broken", "arguments": {"x": 1}}', "Error: tool 'broken' raised RuntimeError: disk on fire"),
    ('{"name": "leaves", "arguments": {"x": 1}}', "Error: tool 'leaves' raised SystemExit: 3"),
    ('{"name": "a_set", "arguments": {"x": 1}}', "Error: tool 'a_set' returned a set, which is neither text nor JSON"),
    ('{"name": "add", "arguments": {"a": 1, "b": ', "Error: the tool call could not be parsed: the tool call is not valid JSON"),
])
def test_every_failure_goes_back_to_the_model_and_is_counted(call, error):
    env = ToolEnvironment(TOOLS, max_turns=4)
    messages, reward, done = env.step(turn(call, '{"name": "add", "arguments": {"a": 2, "b": 2}}'))
    assert reward is None and done is False
    contents = [m["content"] for m in messages]
    assert "4" in contents  # the good call in the same turn still runs
    assert any(error in c for c in contents) and all(c == "4" or c.startswith("Error: ") for c in contents)
    assert (env.tool_calls, env.tool_errors) == (2, 1)


def test_a_call_over_the_time_limit_is_abandoned_and_counted():
    RELEASE.clear()
    env = ToolEnvironment(TOOLS, max_turns=4, timeout_s=0.2)
    try:
        messages, _, done = env.step(turn('{"name": "hangs", "arguments": {"x": 1}}'))
    finally:
        RELEASE.set()  # let the abandoned thread end
    assert messages == [{"role": "tool", "name": "hangs", "content": "Error: tool 'hangs' did not return within 0.2 s"}]
    assert done is False and (env.tool_errors, env.tool_timeouts) == (1, 1)


def test_without_a_time_limit_a_call_runs_in_the_callers_thread():
    seen = []

    def where(x: int) -> str:
        """Names the thread.

        Args:
            x: Ignored.
        """
        seen.append(threading.current_thread())
        return "ok"

    env = ToolEnvironment({"where": where}, max_turns=2, timeout_s=None)
    assert env.step(turn('{"name": "where", "arguments": {"x": 0}}'))[0][0]["content"] == "ok"
    assert seen == [threading.current_thread()]


@pytest.mark.parametrize("kwargs, message", [
    ({"max_turns": 0}, "max_turns=0 must be an int >= 1"),
    ({"max_turns": 2, "timeout_s": 0}, "timeout_s=0 must be a positive number"),
])
def test_bad_limits_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ToolEnvironment(TOOLS, **kwargs)
