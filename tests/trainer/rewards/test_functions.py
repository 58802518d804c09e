"""Tests for trainer/rewards/functions.py: resolving reward specs and combining rewards."""

from __future__ import annotations

import math
import re
import textwrap

import numpy as np
import pytest

from trainer.data.tasks.arithmetic import exact_answer_reward, format_reward
from trainer.rewards.functions import compute_rewards, resolve_reward

MODULE_SRC = textwrap.dedent(
    """
    import math

    THRESHOLD = 0.5

    def length_reward(prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]

    class Scorers:
        @staticmethod
        def constant(prompts, completions, **kwargs):
            return [1.0] * len(prompts)
    """
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(MODULE_SRC)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


# ------------------------------------------------------------------ resolve_reward


def test_resolve_builtin():
    assert resolve_reward("builtin:arithmetic.exact_answer") is exact_answer_reward
    assert resolve_reward("builtin:arithmetic.format") is format_reward


def test_resolve_module_function(user_module):
    fn = resolve_reward("my_rewards_mod:length_reward")
    assert fn(["p", "q"], ["ab", "c"]) == [2.0, 1.0]
    assert resolve_reward("my_rewards_mod:Scorers.constant")(["p"], ["c"]) == [1.0]
    assert resolve_reward("trainer.data.tasks.arithmetic:format_reward") is format_reward


def test_resolve_file_path(tmp_path, monkeypatch):
    (tmp_path / "file_rewards.py").write_text(MODULE_SRC)
    fn = resolve_reward(f"{tmp_path / 'file_rewards.py'}:length_reward")
    assert fn(["p"], ["abc"]) == [3.0]
    monkeypatch.chdir(tmp_path)
    assert resolve_reward("file_rewards.py:length_reward")(["p"], ["ab"]) == [2.0]


@pytest.mark.parametrize("spec", ["no_colon", "a:b:c", ":fn", "module:", " : "])
def test_malformed_spec(spec):
    with pytest.raises(ValueError, match=re.escape(f"malformed reward spec {spec!r}; expected 'module:function'")):
        resolve_reward(spec)


def test_unknown_builtin():
    with pytest.raises(ValueError, match=r"unknown builtin reward 'builtin:arithmetic.exact'.*arithmetic.exact_answer"):
        resolve_reward("builtin:arithmetic.exact")


def test_module_not_importable_includes_import_error():
    message = "cannot import module 'no_such_mod_xyz': ModuleNotFoundError: No module named 'no_such_mod_xyz'"
    with pytest.raises(ImportError, match=re.escape(message)):
        resolve_reward("no_such_mod_xyz:f")


def test_module_failing_on_import(tmp_path, monkeypatch):
    (tmp_path / "broken_mod.py").write_text("import definitely_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match="cannot import module 'broken_mod'.*definitely_missing_dependency"):
        resolve_reward("broken_mod:f")
    (tmp_path / "broken_file.py").write_text("1 / 0\n")
    with pytest.raises(ImportError, match="executing .*broken_file.py' failed: ZeroDivisionError"):
        resolve_reward(f"{tmp_path / 'broken_file.py'}:f")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.py' does not exist"):
        resolve_reward(f"{tmp_path / 'nope.py'}:f")


def test_attribute_missing_lists_callables(user_module):
    message = "'my_rewards_mod' has no attribute 'lenght_reward'; its public callables: ['Scorers', 'length_reward']"
    with pytest.raises(AttributeError, match=re.escape(message)):
        resolve_reward("my_rewards_mod:lenght_reward")
    with pytest.raises(AttributeError, match=r"'my_rewards_mod:Scorers' has no attribute 'nope'"):
        resolve_reward("my_rewards_mod:Scorers.nope")


def test_not_callable(user_module):
    with pytest.raises(TypeError, match=r"'my_rewards_mod:THRESHOLD' names a float, which is not callable"):
        resolve_reward("my_rewards_mod:THRESHOLD")


# ------------------------------------------------------------------ compute_rewards

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["3 + 5 = 8. The answer is 8.", "The answer is 7", "nine"]
COLUMNS = {"answer": ["8", "6", "9"], "level": [1, 2, 3]}


def test_compute_rewards_weighted_sum():
    fns = {"correct": exact_answer_reward, "format": format_reward}
    total, per_fn = compute_rewards(fns, {"correct": 1.0, "format": 0.5}, PROMPTS, COMPLETIONS, COLUMNS)
    # correct: 8 == 8 -> 1; 7 != 6 -> 0; no integer -> 0
    # format:  full format -> 1; missing final '.' -> 0; -> 0
    assert per_fn == {"correct": [1.0, 0.0, 0.0], "format": [1.0, 0.0, 0.0]}
    assert total == [1.0 * 1.0 + 0.5 * 1.0, 0.0, 0.0]


def test_missing_weight_defaults_to_one_and_columns_are_passed():
    seen = {}

    def spy(prompts, completions, answer, level):
        seen.update(prompts=prompts, completions=completions, answer=answer, level=level)
        return [0.25, -1, True]  # ints and bools are numbers too

    total, per_fn = compute_rewards({"spy": spy, "fmt": format_reward}, {"fmt": 2.0}, PROMPTS, COMPLETIONS, COLUMNS)
    assert seen == {"prompts": PROMPTS, "completions": COMPLETIONS, **COLUMNS}
    assert per_fn["spy"] == [0.25, -1.0, 1.0]
    # total = 1.0 * spy + 2.0 * fmt = [0.25 + 2.0, -1.0 + 0, 1.0 + 0]
    assert total == [2.25, -1.0, 1.0]


def test_numpy_and_torch_outputs():
    import torch

    _, per_fn = compute_rewards(
        {"np": lambda p, c, **k: np.array([0.5, 1.0, 0.0]), "pt": lambda p, c, **k: torch.tensor([1.0, 2.0, 3.0])},
        {}, PROMPTS, COMPLETIONS, {},
    )  # fmt: skip
    assert per_fn == {"np": [0.5, 1.0, 0.0], "pt": [1.0, 2.0, 3.0]}
    assert all(type(v) is float for v in per_fn["np"] + per_fn["pt"])


@pytest.mark.parametrize(
    "output, message",
    [
        ([1.0, 2.0], "reward function 'bad' returned 2 rewards for 3 samples"),
        ([1.0, float("nan"), 0.0], "reward function 'bad' returned nan at sample 1, expected a finite number"),
        ([1.0, 0.0, math.inf], "reward function 'bad' returned inf at sample 2, expected a finite number"),
        ([1.0, None, 0.0], "reward function 'bad' returned None (NoneType) at sample 1, expected a number"),
        ([1.0, "1", 0.0], "reward function 'bad' returned '1' (str) at sample 1, expected a number"),
        (1.0, "reward function 'bad' returned float, expected a list of 3 floats"),
        ("abc", "reward function 'bad' returned str, expected a list of 3 floats"),
    ],
)
def test_bad_outputs_name_function_and_index(output, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        compute_rewards({"ok": format_reward, "bad": lambda p, c, **k: output}, {}, PROMPTS, COMPLETIONS, {})


def test_exception_inside_function_is_annotated():
    def broken(prompts, completions, **kwargs):
        raise KeyError("answer")

    with pytest.raises(KeyError) as info:
        compute_rewards({"broken": broken}, {}, PROMPTS, COMPLETIONS, {})
    assert "raised by reward function 'broken'" in info.value.__notes__


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fns": {}}, "fns is empty"),
        ({"weights": {"corect": 1.0}}, "unknown reward function(s) ['corect']; reward functions: ['correct']"),
        ({"weights": {"correct": float("nan")}}, "weights['correct']=nan must be a finite number"),
        ({"weights": {"correct": "1"}}, "weights['correct']='1' must be a finite number"),
        ({"completions": ["a"]}, "completions has 1 items but prompts has 3"),
        ({"columns": {"answer": ["8"]}}, "column 'answer' has 1 items but prompts has 3"),
        ({"columns": {"answer": ["8"] * 3, "prompts": ["x"] * 3}}, "column name 'prompts' clashes"),
    ],
)
def test_compute_rewards_input_errors(kwargs, message):
    args = {"fns": {"correct": exact_answer_reward}, "weights": {}, "prompts": PROMPTS,
            "completions": COMPLETIONS, "columns": {"answer": COLUMNS["answer"]}}  # fmt: skip
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        compute_rewards(**args)


def test_a_module_in_the_current_directory_is_found_by_an_installed_command(tmp_path, monkeypatch):
    """`parityrl` (a console script) starts with its bin directory on sys.path, not the current one, where a
    user's `my_rewards.py` sits next to the recipe naming `my_rewards:f`."""
    import sys

    (tmp_path / "parityrl_cwd_rewards.py").write_text("def f(prompts, completions, **kw):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert resolve_reward("parityrl_cwd_rewards:f")(["p"], ["c"]) == [1.0]
    assert sys.path[-1] == str(tmp_path)
    with pytest.raises(ImportError, match="cannot import module 'parityrl_no_such_module'"):
        resolve_reward("parityrl_no_such_module:f")
