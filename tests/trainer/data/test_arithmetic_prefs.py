"""The built-in preference pairs (trainer/data/tasks/arithmetic_prefs.py): deterministic, correct vs wrong, split-disjoint."""
import random
import re

import pytest

from trainer.data.datasets import load_prompt_dataset
from trainer.data.tasks.arithmetic import exact_answer_reward, format_reward
from trainer.data.tasks.arithmetic_prefs import REJECTED_KINDS, preference_dataset, rejected_completion


def test_golden_rows():
    # Pinned so a change of RNG use (or a machine difference) is caught.
    assert preference_dataset(3, seed=0).to_list() == [
        {"prompt": "Leo has 16 cards and eats 3. How many cards does Leo have left?", "chosen": "16 - 3 = 13. The answer is 13.",
         "rejected": "16 + 3 = 19. The answer is 19.", "rejected_kind": "wrong_op", "answer": "13"},
        {"prompt": "Tom has 17 eggs and gives away 6. How many eggs does Tom have left?",
         "chosen": "17 - 6 = 11. The answer is 11.", "rejected": "17 - 6 = 10. The answer is 10.",
         "rejected_kind": "off_by_k", "answer": "11"},
        {"prompt": "Zoe has 2 pens and finds 0 more. How many pens does Zoe have?", "chosen": "2 + 0 = 2. The answer is 2.",
         "rejected": "2 + 0 = 5. The answer is 5.", "rejected_kind": "off_by_k", "answer": "2"},
    ]
    assert preference_dataset(1, seed=0, split="test")[0]["rejected"] == "18 - 13 = 5. The answer is 4."


def test_chosen_is_right_and_rejected_wrong_in_the_task_format():
    for split in ("train", "test"):
        ds = preference_dataset(400, seed=1, split=split)
        assert exact_answer_reward(ds["prompt"], ds["chosen"], ds["answer"]) == [1.0] * 400
        assert exact_answer_reward(ds["prompt"], ds["rejected"], ds["answer"]) == [0.0] * 400
        assert format_reward(ds["prompt"], ds["rejected"]) == [1.0] * 400  # wrong, but in the output format
        assert set(ds["rejected_kind"]) == set(REJECTED_KINDS)


def test_each_kind_is_what_it_says():
    ds = preference_dataset(300, seed=2)
    eq = re.compile(r"(\d+) ([+-]) (\d+) = (\d+)\. The answer is (\d+)\.")
    for row in ds:
        ca, cop, cb, cc, cans = eq.fullmatch(row["chosen"]).groups()
        ra, rop, rb, rc, rans = eq.fullmatch(row["rejected"]).groups()
        assert (ra, rb) == (ca, cb)
        kind = row["rejected_kind"]
        if kind == "wrong_op":
            assert rop != cop and rc == rans
        elif kind == "off_by_k":
            assert rop == cop and rc == rans and 1 <= abs(int(rc) - int(cc)) <= 3
        else:  # inconsistent: the equation is right, the final answer is not
            assert (rop, rc) == (cop, cc) and 1 <= abs(int(rans) - int(cc)) <= 3


def test_wrong_op_falls_back_when_the_other_operator_gives_the_same_or_a_negative_result():
    rng = random.Random(0)
    text, kind = rejected_completion("Tom has 3 pens and finds 0 more. How many pens does Tom have?", "3", "wrong_op", rng)
    assert kind == "off_by_k" and not text.startswith("3 - 0")
    text, kind = rejected_completion("Tom has 3 pens and finds 5 more. How many pens does Tom have?", "8", "wrong_op", rng)
    assert kind == "off_by_k" and text.startswith("3 + 5 = ")  # 3 - 5 < 0 is never a task answer
    with pytest.raises(ValueError, match="not an arithmetic-task prompt"):
        rejected_completion("What is love?", "1", "off_by_k", rng)
    with pytest.raises(ValueError, match="kind='bogus'"):
        rejected_completion("Tom has 3 pens and finds 5 more.", "8", "bogus", rng)


def test_deterministic_seeded_and_split_disjoint():
    assert preference_dataset(50, seed=3).to_list() == preference_dataset(50, seed=3).to_list()
    assert preference_dataset(50, seed=3)["rejected"] != preference_dataset(50, seed=4)["rejected"]
    train = {c.split(". The")[0] for c in preference_dataset(600, seed=0)["chosen"]}
    test = {c.split(". The")[0] for c in preference_dataset(200, seed=0, split="test")["chosen"]}
    assert train and test and not train & test  # no shared arithmetic fact "a op b = c"


def test_loadable_as_a_builtin_source():
    ds = load_prompt_dataset("builtin:arithmetic_preferences", split="test", answer_column=None, num_examples=5)
    assert len(ds) == 5 and {"prompt", "chosen", "rejected"} <= set(ds.column_names)
