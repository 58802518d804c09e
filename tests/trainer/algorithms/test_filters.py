import math

import pytest
import torch

from trainer.algorithms import AdvantageInputs, GRPOConfig, groups_with_signal, grpo_advantages


def test_groups_with_signal_hand_computed():
    # groups of 2: [1, 0] signal; [1, 1] all correct; [0.1, 0.1] equal; [0, 2] signal
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.1, 0.1, 0.0, 2.0])
    keep, dropped = groups_with_signal(rewards, 2)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, True, False, False, False, False, True, True]
    assert dropped == 2


def test_no_tolerance_and_all_kept():
    keep, dropped = groups_with_signal(torch.tensor([0.5, 0.5 + 1e-6, 3.0, 3.0, 2.0, 3.0], dtype=torch.float64), 3)
    # group 0 differs by 1e-6 -> signal; group 1 = [3, 2, 3] -> signal
    assert keep.all() and dropped == 0


def test_dropped_groups_are_exactly_the_zero_advantage_groups_of_grpo():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (40,), generator=gen).float()  # binary rewards, groups of 4: some constant
    keep, dropped = groups_with_signal(rewards, 4)
    adv = grpo_advantages(AdvantageInputs(rewards=rewards, mask=torch.ones(40, 1), group_size=4), GRPOConfig())
    zero_rows = (adv == 0).all(dim=-1)
    assert torch.equal(~keep, zero_rows)  # with 0/1 rewards no signal group has a member at exactly 0
    assert dropped == int(zero_rows.sum()) // 4 and 0 < dropped < 10


def test_errors():
    with pytest.raises(ValueError, match="group_size must be an int >= 2, got 1"):
        groups_with_signal(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="5 rewards is not a multiple of group_size=2"):
        groups_with_signal(torch.zeros(5), 2)
    with pytest.raises(ValueError, match=r"rewards must be a 1-D \[S\] tensor, got \(2, 2\)"):
        groups_with_signal(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match=r"rewards are not finite at sequence indices \[3\]"):
        groups_with_signal(torch.tensor([0.0, 1.0, 1.0, math.nan]), 2)
