"""DAPO's dynamic sampling (trainer/sampling/dynamic_sampling.py): which groups are kept, how many rounds are drawn, and
what is trained on when the rounds run out. One process here; with 2 ranks in tests/trainer/distributed/test_data_parallel.py."""
import pytest
import torch

from rollout.types import Rollouts
from trainer.distributed.data_parallel import DataParallel
from trainer.sampling.drawn import Drawn
from trainer.sampling.dynamic_sampling import fill_with_signal, groups_to_train

G = 2


def _drawn(group_rewards: list[tuple[float, float]], tag: str) -> Drawn:
    """One round: a group per reward pair; prompt rows and completions name the round and group."""
    n = len(group_rewards)
    rollouts = Rollouts(prompt_ids=[[i] for i in range(n) for _ in range(G)],
                        completion_ids=[[100 + i, j] for i in range(n) for j in range(G)],
                        rollout_logprobs=[[-0.5, -0.25] for _ in range(n * G)], finish_reasons=["stop"] * (n * G),
                        group_size=G)
    rewards = [r for pair in group_rewards for r in pair]
    return Drawn(rows=[{"prompt": f"{tag}{i}"} for i in range(n)], rollouts=rollouts, rewards=rewards,
                 per_fn={"exact": rewards}, generate_s=1.0, reward_s=0.5)


def _rounds(*rounds):
    calls = []

    def draw(k: int) -> Drawn:
        calls.append(k)
        return rounds[k]

    return draw, calls


def test_rollouts_take_and_concat_whole_groups():
    a, b = _drawn([(0, 1), (1, 1), (0, 0)], "a").rollouts, _drawn([(1, 0)], "b").rollouts
    taken = a.take_groups([2, 0])
    assert taken.completion_ids == [[102, 0], [102, 1], [100, 0], [100, 1]] and taken.group_size == G
    both = Rollouts.concat([taken, b])
    assert len(both) == 6 and both.completion_ids[4:] == [[100, 0], [100, 1]]
    with pytest.raises(IndexError, match="groups \\[3\\] out of range for 3 groups"):
        a.take_groups([3])


def test_groups_to_train_is_the_smallest_rank_capped_and_divisible():
    assert groups_to_train([5, 7], share=4, group_size=2, mini_batches=1) == 4
    assert groups_to_train([3, 7], share=4, group_size=2, mini_batches=1) == 3
    assert groups_to_train([3, 7], share=4, group_size=2, mini_batches=4) == 2  # 3 x 2 samples not in 4 parts
    assert groups_to_train([0, 7], share=4, group_size=2, mini_batches=1) == 0


def test_refills_from_further_rounds_keeping_order_and_stops_when_full():
    draw, calls = _rounds(_drawn([(0, 1), (1, 1), (0, 0), (1, 0)], "a"),  # 2 with signal
                          _drawn([(1, 1), (0.5, 0)], "b"),  # 1 more
                          _drawn([(0, 2), (3, 1)], "c"),  # enough: stop here
                          _drawn([(0, 1)], "never"))
    train, drawn, m = fill_with_signal(draw, share=4, group_size=G, mini_batches=1, max_rounds=10, dp=DataParallel())
    assert calls == [0, 1, 2] and len(drawn) == 3
    assert [r["prompt"] for r in train.rows] == ["a0", "a3", "b1", "c0"]  # first kept first, surplus c1 dropped
    assert train.rewards == [0, 1, 1, 0, 0.5, 0, 0, 2] and train.per_fn["exact"] == train.rewards
    assert train.rollouts.completion_ids[:2] == [[100, 0], [100, 1]] and len(train.rollouts) == 8
    assert m == {"rollout/ds_rounds": 3.0, "rollout/ds_signal_frac": 5 / 8, "rollout/ds_train_groups": 4.0,
                 "rollout/ds_fallback": 0.0}


def test_short_after_the_last_round_trains_on_what_was_kept():
    draw, calls = _rounds(_drawn([(0, 1), (1, 1)], "a"), _drawn([(1, 1), (0, 0)], "b"), _drawn([(2, 1)], "c"))
    train, _, m = fill_with_signal(draw, share=2, group_size=G, mini_batches=1, max_rounds=2, dp=DataParallel())
    assert calls == [0, 1] and [r["prompt"] for r in train.rows] == ["a0"]
    assert m["rollout/ds_train_groups"] == 1 and m["rollout/ds_fallback"] == 0


def test_nothing_kept_falls_back_to_the_first_round_as_drawn():
    draw, _ = _rounds(_drawn([(1, 1), (0, 0)], "a"), _drawn([(1, 1), (1, 1)], "b"))
    train, drawn, m = fill_with_signal(draw, share=2, group_size=G, mini_batches=1, max_rounds=2, dp=DataParallel())
    assert train is drawn[0] and m["rollout/ds_fallback"] == 1.0 and m["rollout/ds_signal_frac"] == 0.0
    assert m["rollout/ds_train_groups"] == 2.0


def test_one_round_with_enough_signal_draws_nothing_more():
    draw, calls = _rounds(_drawn([(0, 1), (1, 0)], "a"))
    train, drawn, m = fill_with_signal(draw, share=2, group_size=G, mini_batches=1, max_rounds=10, dp=DataParallel())
    assert calls == [0] and [r["prompt"] for r in train.rows] == ["a0", "a1"] and m["rollout/ds_rounds"] == 1


def test_concat_sums_the_timings():
    both = Drawn.concat([_drawn([(0, 1)], "a"), _drawn([(1, 0)], "b")])
    assert (both.generate_s, both.reward_s, both.num_groups) == (2.0, 1.0, 2)
    assert torch.equal(torch.tensor(both.rewards), torch.tensor([0.0, 1.0, 1.0, 0.0]))
