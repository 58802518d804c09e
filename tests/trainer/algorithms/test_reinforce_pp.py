import math
import statistics

import pytest
import torch

from trainer.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    AdvantageInputs,
    grpo_loss,
    reinforce_pp_baseline_advantages,
)

NAN = float("nan")
R8 = 1 / math.sqrt(8)  # 0.3535534


def _adv(rewards, mask, g):
    return reinforce_pp_baseline_advantages(AdvantageInputs(rewards=rewards, mask=mask, group_size=g), None)


def test_registered():
    assert ADVANTAGES.get("reinforce_pp_baseline") is reinforce_pp_baseline_advantages
    assert POLICY_LOSSES.get("reinforce_pp_baseline") is grpo_loss


def test_hand_computed_batch_whitening_over_tokens():
    # groups of 2: [1, 0] -> centred [0.5, -0.5]; [2, 2] -> [0, 0] (equal: exactly 0 before whitening)
    # lengths 3, 1, 2, 2 -> valid token values [.5,.5,.5, -.5, 0,0, 0,0], N = 8
    # batch mean (1.5 - 0.5) / 8 = 0.125; deviations .375 (x3), -.625, -.125 (x4)
    # squares .421875 + .390625 + .0625 = 0.875; unbiased var .875 / 7 = 0.125; std = 1/sqrt(8)
    # -> .375*sqrt8 = 3/sqrt8 = 1.0606602; -.625*sqrt8 = -5/sqrt8 = -1.7677670; -.125*sqrt8 = -1/sqrt8
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]])
    expected = torch.tensor(
        [[3 * R8, 3 * R8, 3 * R8], [-5 * R8, 0, 0], [-R8, -R8, 0], [-R8, -R8, 0]]
    )
    adv = _adv(rewards, mask, 2)
    torch.testing.assert_close(adv, expected)
    assert adv.dtype == torch.float32
    # unlike GRPO, the constant group is NOT zero after the batch-level shift, and the group std is unused:
    # GRPO would give group 0 (0.5 / std 0.7071) = +-0.7071 on every token.


def test_matches_a_python_reference():
    gen = torch.Generator().manual_seed(0)
    g, groups, t = 4, 5, 6
    rewards = torch.randint(0, 4, (g * groups,), generator=gen).double()
    mask = torch.rand(g * groups, t, generator=gen) < 0.7
    adv = _adv(rewards, mask, g)
    tokens = []  # one centred value per valid token
    for i in range(g * groups):
        group = rewards[(i // g) * g : (i // g + 1) * g].tolist()
        tokens += [rewards[i].item() - statistics.fmean(group)] * int(mask[i].sum())
    mean, std = statistics.fmean(tokens), statistics.stdev(tokens)
    for i in range(g * groups):
        group = rewards[(i // g) * g : (i // g + 1) * g].tolist()
        a = (rewards[i].item() - statistics.fmean(group) - mean) / math.sqrt(std**2 + 1e-8)
        torch.testing.assert_close(adv[i], torch.where(mask[i], a, 0.0).to(adv.dtype))


def test_errors():
    with pytest.raises(ValueError, match="reinforce_pp_baseline_advantages: group_size must be >= 2"):
        _adv(torch.zeros(2), torch.ones(2, 2), 1)
    with pytest.raises(ValueError, match=r"rewards are not finite at sequence indices \[1\]"):
        _adv(torch.tensor([0.0, NAN]), torch.ones(2, 2), 2)
    with pytest.raises(ValueError, match="whiten: needs at least 2 valid tokens"):
        _adv(torch.tensor([0.0, 1.0]), torch.tensor([[1, 0], [0, 0]]), 2)
