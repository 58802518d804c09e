"""The built-in calculator: exact integer arithmetic, nothing else evaluated."""
from __future__ import annotations

import pytest

from trainer.environments.arithmetic_tools import ArithmeticCalculator, calculate
from trainer.environments.tool_calls import parse_assistant


@pytest.mark.parametrize("expression, result", [
    ("7 - 2", "5"), ("(7 - 2) * 3", "15"), ("2 + 3 * 4", "14"), ("-4 + 10", "6"), ("8 / 2", "4"),
    ("7 / 2", "3.5"), ("7 / 2 * 2", "7"), ("1 / 3", "0.3333333333"), (" 12 ", "12"), ("+5", "5"),
])
def test_integer_arithmetic_is_exact(expression, result):
    assert calculate(expression) == result


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').getcwd()", "only integers, \\+ - \\* / and parentheses are allowed"),
    ("2 ** 10", "found '2 \\*\\* 10'"),
    ("1.5 + 1", "found '1.5'"),
    ("True + 1", "found 'True'"),
    ("x + 1", "found 'x'"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 201, "at most 200"),
])
def test_anything_else_is_refused(expression, message):
    with pytest.raises(ValueError, match=message):
        calculate(expression)


def test_division_by_zero_raises():
    with pytest.raises(ZeroDivisionError):
        calculate("1 / (2 - 2)")


def test_an_arithmetic_episode_with_the_calculator():
    row = {"prompt": "Mia has 9 coins and loses 4. How many coins does Mia have left?", "answer": "5"}  # a task row
    env = ArithmeticCalculator(max_turns=3)
    assert env.reset(row) is None
    assert [s["function"]["name"] for s in env.schemas] == ["calculate"]
    assert env.schemas[0]["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    call = parse_assistant('<tool_call>{"name": "calculate", "arguments": {"expression": "9 - 4"}}</tool_call>')
    assert env.step(call) == ([{"role": "tool", "name": "calculate", "content": "5"}], None, False)
    bad = parse_assistant('<tool_call>{"name": "calculate", "arguments": {"expression": "9 ** 4"}}</tool_call>')
    assert env.step(bad)[0][0]["content"].startswith("Error: tool 'calculate' raised ValueError: only integers")
    assert env.step(parse_assistant("The answer is 5.")) == ([], None, True)
    assert (env.turns, env.tool_calls, env.tool_errors) == (3, 2, 1)
