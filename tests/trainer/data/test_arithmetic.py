"""Tests for trainer/data/tasks/arithmetic.py: the built-in verifiable task."""

from __future__ import annotations

import re

import pytest

from trainer.data.tasks import BUILTIN_DATASETS, BUILTIN_REWARDS
from trainer.data.tasks.arithmetic import (
    ADD_VERBS,
    SUB_VERBS,
    arithmetic_dataset,
    exact_answer_reward,
    extract_answer,
    format_reward,
    problem_split,
    sft_text,
)
from trainer.data.tasks.arithmetic_tools import arithmetic_tools_dataset

_PARSE = re.compile(r"has (\d+) \w+ and (" + "|".join(ADD_VERBS + SUB_VERBS) + r") (\d+)")


def _core(prompt: str) -> tuple[str, int, int]:
    a, verb, b = _PARSE.search(prompt).groups()
    return ("+" if verb in ADD_VERBS else "-", int(a), int(b))


def test_problem_split_is_pinned():
    # SHA-256("+:3:5")[:8] = 0x925ed995c334e231 -> 0.5718 >= 0.2 -> train
    # SHA-256("-:9:2")[:8] = 0x2939b2e886f47b84 -> 0.1610 <  0.2 -> test
    assert problem_split("+", 3, 5) == "train"
    assert problem_split("-", 9, 2) == "test"


def test_golden_rows():
    # Pinned so a change of RNG use (or a machine difference) is caught.
    assert arithmetic_dataset(3, seed=0).to_list() == [
        {"prompt": "Leo has 16 cards and eats 3. How many cards does Leo have left?", "answer": "13"},
        {"prompt": "Tom has 17 eggs and gives away 6. How many eggs does Tom have left?", "answer": "11"},
        {"prompt": "Zoe has 2 pens and finds 0 more. How many pens does Zoe have?", "answer": "2"},
    ]
    assert arithmetic_dataset(1, seed=0, split="test").to_list() == [
        {"prompt": "Mia has 18 cards and loses 13. How many cards does Mia have left?", "answer": "5"}
    ]


def test_deterministic_and_seeded():
    assert arithmetic_dataset(100, seed=3).to_list() == arithmetic_dataset(100, seed=3).to_list()
    assert arithmetic_dataset(100, seed=3)["prompt"] != arithmetic_dataset(100, seed=4)["prompt"]


def test_answers_are_correct_and_in_range():
    ds = arithmetic_dataset(500, seed=1, max_operand=12)
    assert ds.column_names == ["prompt", "answer"]
    for row in ds:
        op, a, b = _core(row["prompt"])
        assert 0 <= a <= 12 and 0 <= b <= 12
        expected = a + b if op == "+" else a - b
        assert expected >= 0
        assert row["answer"] == str(expected)
        assert row["prompt"].endswith("have left?" if op == "-" else "have?")


def test_splits_are_disjoint_and_cover_pool():
    train = {_core(p) for p in arithmetic_dataset(3000, split="train", max_operand=10)["prompt"]}
    test = {_core(p) for p in arithmetic_dataset(1000, split="test", max_operand=10)["prompt"]}
    assert not train & test
    # max_operand=10: 11*11 = 121 additions + 66 subtractions with b <= a = 187 cores in all.
    assert len(train) + len(test) == 187
    assert all(problem_split(*c) == "test" for c in test)


def test_each_core_once_before_repeats():
    full = arithmetic_dataset(10_000, split="test", max_operand=10)["prompt"]
    pool = len({_core(p) for p in full})
    first_pass = [_core(p) for p in full[:pool]]
    assert len(set(first_pass)) == pool


def test_sft_text():
    assert sft_text("Tom has 3 apples and buys 5 more. How many apples does Tom have?", "8") == (
        "3 + 5 = 8. The answer is 8."
    )
    assert sft_text("Mia has 7 coins and gives away 2. How many coins does Mia have left?", 5) == (
        "7 - 2 = 5. The answer is 5."
    )
    assert sft_text("What is six times seven?", "42") == "The answer is 42."
    for row in arithmetic_dataset(50, seed=2):
        completion = sft_text(row["prompt"], row["answer"])
        assert extract_answer(completion) == int(row["answer"])
        assert format_reward([row["prompt"]], [completion]) == [1.0]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("3 + 5 = 8. The answer is 8.", 8),
        ("The answer is 12", 12),
        ("the ANSWER IS   -4.", -4),
        ("answer is 3, no wait, the answer is 7.", 7),  # last "answer is" wins
        ("The answer is 9 because 4 + 5 = 9 and 10", 9),  # "answer is" beats the last integer
        ("I think 4 + 5 gives 9", 9),  # fallback: last integer
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


def test_exact_answer_reward():
    prompts = ["q"] * 6
    completions = [
        "3 + 5 = 8. The answer is 8.",  # right
        "3 + 5 = 9. The answer is 9.",  # wrong
        "8",  # right by the last-integer fallback
        "The answer is 80.",  # 80 != 8
        "I don't know",  # nothing to extract
        "The answer is 8.",  # right, int answer column
    ]
    answers = ["8", "8", " 8 ", "8", "8", 8]
    assert exact_answer_reward(prompts, completions, answers, extra=[0] * 6) == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]


def test_exact_answer_reward_errors():
    with pytest.raises(ValueError, match=r"answer\[1\]='eight' is not an integer"):
        exact_answer_reward(["q", "q"], ["1", "2"], ["1", "eight"])
    with pytest.raises(ValueError, match="column 'answer' has 1 items but prompts has 2"):
        exact_answer_reward(["q", "q"], ["1", "2"], ["1"])
    with pytest.raises(ValueError, match="completions has 1 items but prompts has 2"):
        exact_answer_reward(["q", "q"], ["1"], ["1", "2"])


def test_format_reward():
    completions = [
        "3 + 5 = 8. The answer is 8.",
        "  The answer is 8.\n",  # surrounding whitespace is fine
        "The answer is 8",  # missing the final period
        "3 + 5 = 8. The answer is 8. Bye",  # trailing text
        "3+5=8. The answer is 8.",  # equation spacing differs
        "8",
    ]
    assert format_reward(["q"] * 6, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_examples": 0}, "num_examples=0 must be a positive int"),
        ({"num_examples": 5, "split": "validation"}, "split='validation' is not supported"),
        ({"num_examples": 5, "max_operand": 0}, "max_operand=0 must be an int >= 1"),
    ],
)
@pytest.mark.parametrize("dataset", [arithmetic_dataset, arithmetic_tools_dataset])
def test_dataset_errors(kwargs, message, dataset):
    with pytest.raises(ValueError, match=re.escape(message)):
        dataset(**kwargs)


def test_registries():
    assert BUILTIN_DATASETS["arithmetic"] is arithmetic_dataset
    assert BUILTIN_REWARDS["arithmetic.exact_answer"] is exact_answer_reward
    assert BUILTIN_REWARDS["arithmetic.format"] is format_reward
