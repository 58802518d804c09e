"""The built-in verifiable task: one-step arithmetic word problems.

Problems are tiny on purpose: the default model (``trainer.builtin.tiny``) has ~1M
parameters and the demo must show GRPO raising the reward within minutes on a
2-core CPU. Each problem is one addition or one subtraction of small operands
dressed in a template sentence::

    prompt:      "Mia has 7 coins and loses 2. How many coins does Mia have left?"
    answer:      "5"
    completion:  "7 - 2 = 5. The answer is 5."          (``sft_text``)

Completion format (what the SFT warm start teaches and ``format_reward``
checks): ``"{a} {+|-} {b} = {c}. The answer is {c}."``. The equation is a
one-line "reasoning" step that restates the operands next to each other, so a
small model only has to pick the operator from the verb and do one lookup;
the whole completion is ~12 tokens with the tiny tokenizer (+1 EOS), well
inside a 16-24 token generation budget.

Determinism: every draw uses ``random.Random(seed)``; the train/test split is
decided by a SHA-256 of the arithmetic core ``"op:a:b"`` (never ``hash()``,
which is salted per process), so the split is identical on every machine and
the two splits never share an arithmetic fact — a test problem is never a
train problem with another name or object swapped in.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Sequence

import datasets

__all__ = [
    "SPLITS",
    "TEST_FRACTION",
    "arithmetic_dataset",
    "check_dataset_args",
    "exact_answer_reward",
    "extract_answer",
    "format_reward",
    "problem_split",
    "sft_text",
]

SPLITS = ("train", "test")
# Share of arithmetic cores (op, a, b) reserved for the test split.
TEST_FRACTION = 0.2

NAMES = ("Tom", "Ann", "Sam", "Mia", "Leo", "Zoe")
OBJECTS = ("apples", "pens", "coins", "books", "cards", "eggs")
# Each verb belongs to exactly one operator: that is what lets ``sft_text``
# recover the operator from the prompt alone.
ADD_VERBS = ("buys", "finds", "gets")
SUB_VERBS = ("gives away", "eats", "loses", "sells")

_ADD_TEMPLATE = "{name} has {a} {obj} and {verb} {b} more. How many {obj} does {name} have?"
_SUB_TEMPLATE = "{name} has {a} {obj} and {verb} {b}. How many {obj} does {name} have left?"

# Parses the prompts produced by the two templates above.
_PROMPT_RE = re.compile(
    r"has (?P<a>\d+) \w+ and (?P<verb>" + "|".join(ADD_VERBS + SUB_VERBS) + r") (?P<b>\d+)\b"
)
_ANSWER_IS_RE = re.compile(r"answer is\s*(-?\d+)", re.IGNORECASE)
_INT_RE = re.compile(r"-?\d+")
_FORMAT_RE = re.compile(r"(?:\d+ [+-] \d+ = -?\d+\. )?The answer is -?\d+\.")


def problem_split(op: str, a: int, b: int) -> str:
    """Split ("train"/"test") of the arithmetic core ``a op b``.

    Decided by the first 8 bytes of SHA-256("op:a:b") mapped to [0, 1):
    stable across processes, machines and Python versions, and independent of
    ``max_operand`` (growing the operand range never moves an old problem).
    """
    digest = hashlib.sha256(f"{op}:{a}:{b}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return "test" if u < TEST_FRACTION else "train"


def _cores(split: str, max_operand: int) -> list[tuple[str, int, int]]:
    """All (op, a, b) with 0 <= a, b <= max_operand (b <= a for '-') in ``split``, sorted."""
    cores = []
    for a in range(max_operand + 1):
        for b in range(max_operand + 1):
            cores.append(("+", a, b))
            if b <= a:  # subtraction results stay non-negative
                cores.append(("-", a, b))
    return [c for c in cores if problem_split(*c) == split]


def check_dataset_args(num_examples: object, split: object, max_operand: object) -> None:
    """``ValueError`` naming the argument unless it is one a built-in arithmetic dataset takes."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not supported; expected one of {SPLITS}")
    if not isinstance(num_examples, int) or isinstance(num_examples, bool) or num_examples <= 0:
        raise ValueError(f"num_examples={num_examples!r} must be a positive int")
    if not isinstance(max_operand, int) or isinstance(max_operand, bool) or max_operand < 1:
        raise ValueError(f"max_operand={max_operand!r} must be an int >= 1")


def arithmetic_dataset(
    num_examples: int, *, seed: int = 0, split: str = "train", max_operand: int = 20
) -> datasets.Dataset:
    """Deterministic arithmetic word problems.

    Args:
        num_examples: number of rows (> 0).
        seed: seeds ``random.Random``; same arguments -> same rows, everywhere.
        split: "train" or "test"; the splits share no (op, a, b) core.
        max_operand: operands are drawn from 0..max_operand (>= 1).

    Returns:
        ``datasets.Dataset`` with columns ``prompt`` (str, the question) and
        ``answer`` (str, the integer result as text). Each arithmetic core of
        the split appears once (in shuffled order) before any repeats; names,
        objects and verbs are drawn independently per row.
    """
    check_dataset_args(num_examples, split, max_operand)
    pool = _cores(split, max_operand)
    if not pool:
        raise ValueError(f"split={split!r} has no problems with max_operand={max_operand}; use a larger max_operand")
    rng = random.Random(seed)
    prompts, answers = [], []
    order: list[tuple[str, int, int]] = []
    for _ in range(num_examples):
        if not order:
            order = pool[:]
            rng.shuffle(order)
        op, a, b = order.pop()
        name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
        if op == "+":
            verb, template, c = rng.choice(ADD_VERBS), _ADD_TEMPLATE, a + b
        else:
            verb, template, c = rng.choice(SUB_VERBS), _SUB_TEMPLATE, a - b
        prompts.append(template.format(name=name, a=a, b=b, obj=obj, verb=verb))
        answers.append(str(c))
    return datasets.Dataset.from_dict({"prompt": prompts, "answer": answers})


def sft_text(prompt: str, answer: str | int) -> str:
    """Target completion for ``prompt``: ``"a op b = c. The answer is c."``.

    The operands and operator are parsed back from the built-in templates; for
    any other prompt the completion is just ``"The answer is c."``.
    """
    c = int(answer)
    m = _PROMPT_RE.search(prompt)
    if m is None:
        return f"The answer is {c}."
    op = "+" if m["verb"] in ADD_VERBS else "-"
    return f"{m['a']} {op} {m['b']} = {c}. The answer is {c}."


def extract_answer(completion: str) -> int | None:
    """Integer answer of a completion: the last "answer is N", else the last integer, else None."""
    matches = _ANSWER_IS_RE.findall(completion)
    if matches:
        return int(matches[-1])
    ints = _INT_RE.findall(completion)
    return int(ints[-1]) if ints else None


def _check_aligned(prompts: Sequence, completions: Sequence, **columns: Sequence) -> None:
    n = len(prompts)
    if len(completions) != n:
        raise ValueError(f"completions has {len(completions)} items but prompts has {n}")
    for name, col in columns.items():
        if len(col) != n:
            raise ValueError(f"column {name!r} has {len(col)} items but prompts has {n}")


def _as_int(value: object, index: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"answer[{index}]={value!r} is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ValueError(f"answer[{index}]={value!r} is not an integer (or integer text)")


def exact_answer_reward(
    prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str | int], **kwargs: object
) -> list[float]:
    """1.0 where the completion's extracted integer (``extract_answer``) equals ``answer``, else 0.0.

    Reward-function convention: ``f(prompts, completions, **columns) -> list[float]``,
    every column a list aligned with ``prompts``; unused columns land in ``kwargs``.
    """
    _check_aligned(prompts, completions, answer=answer)
    rewards = []
    for i, (completion, ans) in enumerate(zip(completions, answer)):
        target = _as_int(ans, i)
        rewards.append(1.0 if extract_answer(completion) == target else 0.0)
    return rewards


def format_reward(prompts: Sequence[str], completions: Sequence[str], **kwargs: object) -> list[float]:
    """1.0 where the whole completion (whitespace-stripped) is ``"[a op b = c. ]The answer is N."``, else 0.0."""
    _check_aligned(prompts, completions)
    return [1.0 if _FORMAT_RE.fullmatch(c.strip()) else 0.0 for c in completions]
