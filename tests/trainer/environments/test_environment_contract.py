"""The environment contract: a class with reset/step is one; what step and reset return is checked by name."""
from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.environments.contract import (
    Environment,
    EnvironmentContractError,
    check_messages,
    check_reset_result,
    check_step_result,
)


class Echo:
    def reset(self, row):
        return None

    def step(self, message):
        return [{"role": "user", "content": message["content"]}], 1, False


def test_a_class_with_reset_and_step_is_an_environment_without_a_base_class():
    assert isinstance(Echo(), Environment)
    assert not isinstance(object(), Environment)


def test_a_valid_step_result_comes_back_with_the_reward_as_a_float():
    messages, reward, done = check_step_result(Echo().step({"content": "hi"}), "Echo")
    assert messages == [{"role": "user", "content": "hi"}] and reward == 1.0 and isinstance(reward, float)
    assert done is False
    assert check_step_result(([], None, True), "Echo") == ([], None, True)
    assert check_step_result([[], np.float32(0.5), np.bool_(True)], "Echo") == ([], 0.5, True)  # numpy scalars


@pytest.mark.parametrize("result, expected", [
    (([], None), r"returned a tuple of length 2; expected a tuple \(messages, reward, done\)"),
    ("done", "returned a str; expected a tuple"),
    (({"role": "user", "content": "x"}, None, False), "messages: got a dict; expected a list of message dicts"),
    ((["hello"], None, False), r"messages\[0\] is a str; expected a dict with 'role' and 'content'"),
    (([{"content": "x"}], None, False), r"messages\[0\] has role None"),
    (([{"role": "tool", "content": 5}], None, False), r"messages\[0\] \(role 'tool'\) has content 5 \(int\)"),
    (([{"role": "assistant", "content": "x"}], None, False), "has role 'assistant'; an environment replies as"),
    (([], math.nan, False), r"returned reward nan \(float\); expected a finite number or None"),
    (([], "1", False), r"returned reward '1' \(str\)"),
    (([], None, 1), r"returned done=1 \(int\); expected True or False"),
    (([], None, None), r"returned done=None"),
])
def test_a_wrong_step_result_is_refused_naming_the_environment(result, expected):
    with pytest.raises(EnvironmentContractError, match=expected) as e:
        check_step_result(result, "my_env.py:Maze")
    assert str(e.value).startswith("environment 'my_env.py:Maze': step()")


def test_reset_may_return_none_or_messages():
    assert check_reset_result(None, "E") == []
    assert check_reset_result([{"role": "user", "content": "go"}], "E") == [{"role": "user", "content": "go"}]
    with pytest.raises(EnvironmentContractError, match=r"environment 'E': reset\(\) messages: got a str"):
        check_reset_result("go", "E")
    assert check_messages((), "here") == []
