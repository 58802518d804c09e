"""Built-in preference pairs for the arithmetic task (reward-model training, offline).

Each row is one prompt of ``trainer.data.tasks.arithmetic`` with two completions in the
task's output format (``sft_text``: ``"a op b = c. The answer is c."``)::

    prompt:    "Mia has 7 coins and loses 2. How many coins does Mia have left?"
    chosen:    "7 - 2 = 5. The answer is 5."        correct
    rejected:  "7 - 2 = 6. The answer is 6."        off_by_k
               "7 + 2 = 9. The answer is 9."        wrong_op   (the verb says '-')
               "7 - 2 = 5. The answer is 7."        inconsistent (the final answer is wrong)

so ``exact_answer_reward`` is 1 on every ``chosen`` and 0 on every ``rejected``: a
reward model trained on these pairs learns the same preference as the rule reward
(which makes its RL signal checkable against the rule). The three kinds differ in
what the model has to read: the sum itself (off_by_k), the verb -> operator map
(wrong_op), or agreement between the equation and the final answer (inconsistent).
The kind is kept in the ``rejected_kind`` column.

Determinism and splits: prompts come from ``arithmetic_dataset`` (same ``seed`` and
``split``, so the train and test splits share no arithmetic fact), the rejected
completion from ``random.Random("arithmetic_prefs:<seed>:<split>")`` (string seeds
are hashed with SHA-512 by ``random``, stable across processes and machines).
"""

from __future__ import annotations

import random

import datasets

from trainer.data.tasks.arithmetic import _PROMPT_RE, ADD_VERBS, arithmetic_dataset, sft_text

__all__ = ["REJECTED_KINDS", "MAX_OFFSET", "preference_dataset", "rejected_completion"]

REJECTED_KINDS = ("off_by_k", "wrong_op", "inconsistent")
# Wrong answers are c +- k with 1 <= k <= MAX_OFFSET: near misses, the errors a
# small model actually makes, rather than absurd numbers a length feature would catch.
MAX_OFFSET = 3


def _wrong_number(c: int, rng: random.Random) -> int:
    """c + k or c - k, 1 <= k <= MAX_OFFSET, never negative (the task's answers are >= 0)."""
    k = rng.randint(1, MAX_OFFSET)
    if c - k < 0 or rng.random() < 0.5:
        return c + k
    return c - k


def rejected_completion(prompt: str, answer: str | int, kind: str, rng: random.Random) -> tuple[str, str]:
    """(a wrong completion of ``kind`` in the task's output format, the kind actually used).

    Every kind ends in a final answer different from ``answer``. ``wrong_op`` falls
    back to ``off_by_k`` where the other operator gives the same result (b = 0) or a
    negative one (a - b with b > a); the returned kind says so.
    """
    if kind not in REJECTED_KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {REJECTED_KINDS}")
    c = int(answer)
    m = _PROMPT_RE.search(prompt)
    if m is None:
        raise ValueError(f"prompt {prompt[:60]!r} is not an arithmetic-task prompt (cannot parse its operands)")
    a, b = int(m["a"]), int(m["b"])
    op = "+" if m["verb"] in ADD_VERBS else "-"
    if kind == "wrong_op":
        other = "-" if op == "+" else "+"
        value = a - b if other == "-" else a + b
        if value != c and value >= 0:
            return f"{a} {other} {b} = {value}. The answer is {value}.", kind
        kind = "off_by_k"
    wrong = _wrong_number(c, rng)
    if kind == "off_by_k":
        return f"{a} {op} {b} = {wrong}. The answer is {wrong}.", kind
    return f"{a} {op} {b} = {c}. The answer is {wrong}.", kind


def preference_dataset(
    num_examples: int, *, seed: int = 0, split: str = "train", max_operand: int = 20
) -> datasets.Dataset:
    """Deterministic (prompt, chosen, rejected) rows for the arithmetic task.

    Args: as ``arithmetic_dataset`` (which supplies the prompts and answers).

    Returns:
        ``datasets.Dataset`` with columns ``prompt``, ``chosen`` (the correct
        ``sft_text`` completion), ``rejected`` (a wrong one), ``rejected_kind`` (one
        of ``REJECTED_KINDS``, drawn uniformly; wrong_op rows that fell back say off_by_k) and ``answer``.
    """
    base = arithmetic_dataset(num_examples, seed=seed, split=split, max_operand=max_operand)
    rng = random.Random(f"arithmetic_prefs:{seed}:{split}")
    chosen, rejected, kinds = [], [], []
    for prompt, answer in zip(base["prompt"], base["answer"]):
        text, kind = rejected_completion(prompt, answer, rng.choice(REJECTED_KINDS), rng)
        chosen.append(sft_text(prompt, answer))
        rejected.append(text)
        kinds.append(kind)
    return datasets.Dataset.from_dict({"prompt": base["prompt"], "chosen": chosen, "rejected": rejected,
                                       "rejected_kind": kinds, "answer": base["answer"]})
