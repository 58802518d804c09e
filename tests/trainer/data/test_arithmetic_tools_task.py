"""Tests for trainer/data/tasks/arithmetic_tools.py: the built-in two-step task solved with the calculator."""

from __future__ import annotations

import json
import re

import pytest

from trainer.data.tasks import BUILTIN_DATASETS
from trainer.data.tasks.arithmetic import ADD_VERBS, SUB_VERBS, exact_answer_reward
from trainer.data.tasks.arithmetic_tools import (
    DIRECT_FRACTION,
    answers_directly,
    arithmetic_tools_dataset,
    problem_split,
    sft_messages,
    sft_messages_sometimes_direct,
)

_PARSE = re.compile(r"has (\d+) \w+, (" + "|".join(ADD_VERBS + SUB_VERBS) + r") (\d+) and ("
                    + "|".join(ADD_VERBS + SUB_VERBS) + r") (\d+)\. How many")


def _core(prompt: str) -> tuple[str, int, int, str, int]:
    a, v1, b, v2, c = _PARSE.search(prompt).groups()
    return ("+" if v1 in ADD_VERBS else "-", int(a), int(b), "+" if v2 in ADD_VERBS else "-", int(c))


def test_golden_row_and_registry():
    row = arithmetic_tools_dataset(1, seed=0).to_list()[0]
    assert row == {"prompt": "Ann has 6 coins, sells 2 and buys 1. How many coins does Ann have?", "answer": "5",
                   "expression": "6 - 2 + 1"}
    assert BUILTIN_DATASETS["arithmetic_tools"] is arithmetic_tools_dataset


def test_deterministic_and_seeded():
    a = arithmetic_tools_dataset(50, seed=3).to_list()
    assert a == arithmetic_tools_dataset(50, seed=3).to_list()
    assert a != arithmetic_tools_dataset(50, seed=4).to_list()


@pytest.mark.parametrize("split", ["train", "test"])
def test_answers_are_correct_and_non_negative(split):
    for row in arithmetic_tools_dataset(300, seed=1, split=split, max_operand=12).to_list():
        op1, a, b, op2, c = _core(row["prompt"])
        assert row["expression"] == f"{a} {op1} {b} {op2} {c}"
        mid = a + b if op1 == "+" else a - b
        final = mid + c if op2 == "+" else mid - c
        assert mid >= 0 and final >= 0 and row["answer"] == str(final)
        assert 0 <= a <= 12 and 1 <= b <= 12 and 1 <= c <= 12
        assert problem_split(op1, a, b, op2, c) == split


def test_splits_are_disjoint():
    train = {r["expression"] for r in arithmetic_tools_dataset(3000, split="train", max_operand=6).to_list()}
    test = {r["expression"] for r in arithmetic_tools_dataset(1000, split="test", max_operand=6).to_list()}
    assert train and test and not train & test


def test_sft_messages_are_a_solved_episode_the_reward_scores():
    row = arithmetic_tools_dataset(1, seed=0).to_list()[0]
    messages = sft_messages(**row)
    call = {"type": "function", "function": {"name": "calculate", "arguments": {"expression": "6 - 2 + 1"}}}
    assert messages == [{"role": "user", "content": row["prompt"]},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "content": "5"},
                        {"role": "assistant", "content": "The answer is 5."}]
    # the episode's text (what the model writes and reads) ends with the answer the reward checks
    episode = json.dumps(call["function"]) + " 5 " + messages[-1]["content"]
    assert exact_answer_reward([row["prompt"]], [episode], [row["answer"]]) == [1.0]
    assert exact_answer_reward([row["prompt"]], [episode.replace("is 5.", "is 6.")], [row["answer"]]) == [0.0]


def test_the_warm_starts_episodes_answer_a_quarter_of_the_problems_without_the_tool():
    rows = arithmetic_tools_dataset(4000, seed=0).to_list()
    # the first rows' choices, from SHA-256("direct:" + core)[:8] / 2**64 against 0.25 (0.387, 0.984, 0.078, 0.590)
    assert [answers_directly(r["expression"]) for r in rows[:4]] == [False, False, True, False]
    assert DIRECT_FRACTION == 0.25
    direct = [r for r in rows if answers_directly(r["expression"])]
    assert 0.22 < len(direct) / len(rows) < 0.28
    assert sft_messages_sometimes_direct(**rows[0]) == sft_messages(**rows[0])
    row = rows[2]  # "2 + 15 + 8"
    assert sft_messages_sometimes_direct(**row) == [{"role": "user", "content": row["prompt"]},
                                                    {"role": "assistant", "content": "The answer is 25."}]
    assert exact_answer_reward([row["prompt"]], ["The answer is 25."], [row["answer"]]) == [1.0]


def test_the_transcripts_tool_reply_is_what_the_calculator_replies():
    from trainer.environments.arithmetic_tools import calculate

    for row in arithmetic_tools_dataset(200, seed=3).to_list():
        assert sft_messages(**row)[2]["content"] == calculate(row["expression"])


def test_a_rendered_transcript_fits_the_tiny_model():
    from trainer.builtin.tiny import build_tokenizer
    from trainer.environments.loading import resolve_tools

    tok = build_tokenizer(512, 256)
    tools = resolve_tools("builtin:arithmetic_calculator").schemas
    lengths = [len(tok(tok.apply_chat_template(sft_messages(**r), tools=tools, tokenize=False),
                       add_special_tokens=False)["input_ids"])
               for r in arithmetic_tools_dataset(200, seed=0).to_list()]
    assert max(lengths) < 150, max(lengths)


