"""The built-in tool task (``builtin:arithmetic_tools``): two-step arithmetic word problems solved with a calculator.

Each problem chains two additions/subtractions of small operands, so the tiny model (``trainer.builtin.tiny``)
gains from calling the calculator (``trainer.environments.arithmetic_tools.calculate``, offered to the model as
the tool ``calculate`` by ``builtin:arithmetic_calculator``) rather than adding in its weights::

    prompt:  "Tom has 7 apples, eats 2 and buys 5. How many apples does Tom have?"
    answer:  "10"

The episode ``sft_messages`` writes (what the ``builtin:tiny-tools`` warm start, ``recipes/sft_tools_tiny.yaml``,
teaches)::

    user:       the prompt
    assistant:  "" + tool call calculate(expression="7 - 2 + 5")
    tool:       "10"
    assistant:  "The answer is 10."

The final answer is scored by the arithmetic task's reward (``builtin:arithmetic.exact_answer``: the last
"answer is N" counts). Prompts are short on purpose: rendered with the tiny template and the tool line, a whole
transcript is about 130 tokens of the model's 256 positions.

Determinism and split as in ``trainer.data.tasks.arithmetic``: ``random.Random(seed)`` draws, and the split is
decided by a SHA-256 of the arithmetic core ``"op1:a:b:op2:c"``, so train and test never share a computation.
Every intermediate and final result is non-negative.
"""

from __future__ import annotations

import hashlib
import random

import datasets

from trainer.data.tasks.arithmetic import (
    ADD_VERBS,
    NAMES,
    OBJECTS,
    SUB_VERBS,
    TEST_FRACTION,
    check_dataset_args,
)

__all__ = ["TOOL_NAME", "arithmetic_tools_dataset", "expression", "problem_split", "sft_messages",
           "sft_messages_sometimes_direct"]

TOOL_NAME = "calculate"

_TEMPLATE = "{name} has {a} {obj}, {verb1} {b} and {verb2} {c}. How many {obj} does {name} have?"

# The core of a row, kept in a column so the transcript does not have to parse the prompt back.
_CORE_COLUMN = "expression"


def problem_split(op1: str, a: int, b: int, op2: str, c: int) -> str:
    """Split ("train"/"test") of the core ``a op1 b op2 c``: SHA-256 of ``"op1:a:b:op2:c"`` mapped to [0, 1)."""
    digest = hashlib.sha256(f"{op1}:{a}:{b}:{op2}:{c}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "test" if u < TEST_FRACTION else "train"


def _value(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def _cores(split: str, max_operand: int) -> list[tuple[str, int, int, str, int]]:
    """All cores with a in 0..max_operand, b and c in 1..max_operand (a step of 0 is no step), intermediate and
    final results >= 0, in ``split``."""
    cores = []
    r = range(1, max_operand + 1)
    for op1 in "+-":
        for a in range(max_operand + 1):
            for b in r:
                mid = _value(a, op1, b)
                if mid < 0:
                    continue
                for op2 in "+-":
                    for c in r:
                        if _value(mid, op2, c) >= 0:
                            cores.append((op1, a, b, op2, c))
    return [core for core in cores if problem_split(*core) == split]


def arithmetic_tools_dataset(
    num_examples: int, *, seed: int = 0, split: str = "train", max_operand: int = 20
) -> datasets.Dataset:
    """Deterministic two-step word problems.

    Args:
        num_examples: number of rows (> 0).
        seed: seeds ``random.Random``; same arguments -> same rows, everywhere.
        split: "train" or "test"; the splits share no (op1, a, b, op2, c) core.
        max_operand: the first operand is drawn from 0..max_operand, the two others from 1..max_operand (>= 1).

    Returns:
        ``datasets.Dataset`` with columns ``prompt`` (the question), ``answer`` (the integer result as text) and
        ``expression`` (the calculation, e.g. ``"7 - 2 + 5"``, which ``sft_messages`` calls the tool with). Each
        core of the split appears once (in shuffled order) before any repeats.
    """
    check_dataset_args(num_examples, split, max_operand)
    pool = _cores(split, max_operand)
    if not pool:
        raise ValueError(f"split={split!r} has no problems with max_operand={max_operand}; use a larger max_operand")
    rng = random.Random(seed)
    prompts, answers, expressions = [], [], []
    order: list[tuple[str, int, int, str, int]] = []
    for _ in range(num_examples):
        if not order:
            order = pool[:]
            rng.shuffle(order)
        op1, a, b, op2, c = order.pop()
        name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
        verb1 = rng.choice(ADD_VERBS if op1 == "+" else SUB_VERBS)
        # two different verbs: "eats 2 and eats 5" reads as a template, not a problem
        verb2 = rng.choice([v for v in (ADD_VERBS if op2 == "+" else SUB_VERBS) if v != verb1])
        prompts.append(_TEMPLATE.format(name=name, a=a, b=b, c=c, obj=obj, verb1=verb1, verb2=verb2))
        answers.append(str(_value(_value(a, op1, b), op2, c)))
        expressions.append(f"{a} {op1} {b} {op2} {c}")
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers, _CORE_COLUMN: expressions})


def expression(prompt: str, **columns: object) -> str:
    """The calculation a row asks for (its ``expression`` column)."""
    if _CORE_COLUMN not in columns:
        raise KeyError(f"the row has no {_CORE_COLUMN!r} column (columns: {sorted(columns)}); "
                       "expected a row of builtin:arithmetic_tools")
    return str(columns[_CORE_COLUMN])


def sft_messages(prompt: str, **columns: object) -> list[dict]:
    """The solved episode of a row as chat messages: question, tool call, tool result, final answer.

    The tool result is the row's answer, which is what the calculator replies to the expression (an integer
    as text; tests/trainer/data/test_arithmetic_tools_task.py holds the two equal), so the transcript shows the model
    what the environment will really reply; the task does not import the environment (data sits below
    environments in the package order). A ``data.messages_fn`` for ``parityrl sft`` (``trainer.supervised.sft``).
    """
    expr = expression(prompt, **columns)
    result = str(int(columns["answer"]))
    call = {"type": "function", "function": {"name": TOOL_NAME, "arguments": {"expression": expr}}}
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": f"The answer is {result}."},
    ]


# The share of rows sft_messages_sometimes_direct answers without the tool.
DIRECT_FRACTION = 0.25


def answers_directly(expr: str) -> bool:
    """Whether ``sft_messages_sometimes_direct`` answers the row of core ``expr`` without the tool: a SHA-256 of the
    core against ``DIRECT_FRACTION``, so the choice is fixed per problem and unrelated to anything the model reads."""
    u = int.from_bytes(hashlib.sha256(f"direct:{expr}".encode()).digest()[:8], "big") / 2**64
    return u < DIRECT_FRACTION


def sft_messages_sometimes_direct(prompt: str, **columns: object) -> list[dict]:
    """``sft_messages`` for most rows; for ``DIRECT_FRACTION`` of them (``answers_directly``) the answer alone, as if
    computed in the weights: question, "The answer is N.".

    The warm start this teaches (``builtin:tiny-tools``) calls the calculator on about three problems in four and
    otherwise guesses, which the tiny model gets right on few problems it has not seen. RL then has a procedure to
    learn that works for any numbers: call the tool (and copy its operands and result), which is what the
    demo's held-out evaluation measures (recipes/grpo_tools_tiny.yaml)."""
    if not answers_directly(expression(prompt, **columns)):
        return sft_messages(prompt, **columns)
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": f"The answer is {int(columns['answer'])}."},
    ]
