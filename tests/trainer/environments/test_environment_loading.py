"""Environments and tools named in a recipe: resolved like reward functions, checked against the contract."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trainer.environments.arithmetic_tools import ArithmeticCalculator, calculate
from trainer.environments.loading import check_environment_class, resolve_environment_class, resolve_tools
from trainer.environments.tools import Toolbox

REPO = Path(__file__).resolve().parents[3]

ENV_FILE = '''
class Maze:
    def reset(self, row):
        return None

    def step(self, message):
        return [], 1.0, True


class NoStep:
    def reset(self, row):
        return None


class WideStep:
    def reset(self, row):
        return None

    def step(self, message, extra):
        return [], None, True


class NeedsArgs:
    def __init__(self, size):
        self.size = size

    def reset(self, row):
        return None

    def step(self, message):
        return [], None, True


class Static:
    @staticmethod
    def reset(row):
        return None

    @classmethod
    def step(cls, message):
        return [], None, True


def lookup(key: str) -> str:
    """Looks a key up.

    Args:
        key: The key.
    """
    return key


def undocumented(key):
    return key


TOOLS = {"lookup": lookup}
TOOL_LIST = [lookup]
BAD_TOOLS = {"undocumented": undocumented}
'''


@pytest.fixture()
def env_file(tmp_path):
    path = tmp_path / "my_envs.py"
    path.write_text(textwrap.dedent(ENV_FILE))
    return path


def test_builtins_resolve():
    assert resolve_environment_class("builtin:arithmetic_calculator") is ArithmeticCalculator
    toolbox = resolve_tools("builtin:arithmetic_calculator")
    assert isinstance(toolbox, Toolbox) and toolbox.functions == {"calculate": calculate}


def test_a_class_and_tools_from_a_file(env_file):
    cls = resolve_environment_class(f"{env_file}:Maze")
    assert cls.__name__ == "Maze" and cls().step({}) == ([], 1.0, True)
    assert list(resolve_tools(f"{env_file}:TOOLS").functions) == ["lookup"]
    assert list(resolve_tools(f"{env_file}:TOOL_LIST").functions) == ["lookup"]
    assert resolve_environment_class(f"{env_file}:Static").__name__ == "Static"  # static/class methods count


def test_a_class_from_a_module():
    assert resolve_environment_class("trainer.environments.arithmetic_tools:ArithmeticCalculator") is (
        ArithmeticCalculator)


@pytest.mark.parametrize("name, message", [
    ("NoStep", r"environment spec '.*:NoStep' \(class NoStep\) has no method step\(self, message\)"),
    ("WideStep", r"\(class WideStep\): step\(self, message, extra\) must take one argument \(message\)"),
    ("NeedsArgs", r"\(class NeedsArgs\): its constructor NeedsArgs\(size\) needs arguments"),
    ("lookup", r"environment spec '.*:lookup' names a function; expected a class with reset\(self, row\)"),
])
def test_a_class_outside_the_contract_is_refused_naming_it(env_file, name, message):
    with pytest.raises(TypeError, match=message):
        resolve_environment_class(f"{env_file}:{name}")


def test_a_method_taking_nothing_is_refused():
    class Lazy:
        def reset(self):
            return None

        def step(self, message):
            return [], None, True

    with pytest.raises(TypeError, match=r"'t:Lazy' \(class .*Lazy\): reset\(self\) must take one argument \(row\)"):
        check_environment_class(Lazy, "t:Lazy")


@pytest.mark.parametrize("spec, error, message", [
    ("no_colon", ValueError, "malformed environment spec 'no_colon'; expected 'module:Name'"),
    ("builtin:maze", ValueError, r"unknown builtin environment 'builtin:maze'; expected one of \['builtin:arithmetic"),
    ("missing_file.py:Maze", FileNotFoundError, "environment spec 'missing_file.py:Maze': file .* does not exist"),
    ("no_such_module_xyz:Maze", ImportError, "environment spec 'no_such_module_xyz:Maze': cannot import module"),
])
def test_a_spec_that_does_not_resolve_says_which(spec, error, message):
    with pytest.raises(error, match=message):
        resolve_environment_class(spec)


def test_tools_that_are_not_tools_are_refused_naming_the_spec(env_file):
    with pytest.raises(AttributeError, match=r"tools spec '.*:NOPE': '.*my_envs.py' has no attribute 'NOPE'"):
        resolve_tools(f"{env_file}:NOPE")
    with pytest.raises(TypeError, match=r"tools spec '.*:lookup' names a function; expected a mapping"):
        resolve_tools(f"{env_file}:lookup")
    with pytest.raises(TypeError, match=r"tools spec '.*:BAD_TOOLS': tool 'undocumented' .* no docstring"):
        resolve_tools(f"{env_file}:BAD_TOOLS")


def test_an_environment_class_with_recipe_reward_functions_is_said_at_start():
    from trainer.environments.episode_environment import reward_sources
    from trainer.lifecycle.preflight import load_recipe

    recipe = REPO / "recipes" / "grpo_tiny.yaml"
    envs = REPO / "tests" / "trainer" / "rl" / "episode_envs.py"
    cfg = load_recipe(recipe, [f"env.class={envs}:FollowUp"], check_paths=False)
    assert reward_sources(cfg) == (f"episode reward = the environment's ({envs}:FollowUp: reward/env) + "
                                   "reward.functions ['exact_answer'], summed; set reward.functions: {} for the "
                                   "environment's alone")
    assert reward_sources(load_recipe(recipe, [f"env.class={envs}:FollowUp", "reward.functions={}", "eval.every=0"],
                                      check_paths=False)) is None
    assert reward_sources(load_recipe(recipe, [], check_paths=False)) is None
