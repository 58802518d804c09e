import math

import pytest
import torch

from trainer.algorithms.sequence import (
    broadcast_to_tokens,
    constant_groups,
    grouped_rewards,
    leave_one_out_mean,
    per_sequence,
    sequence_lengths,
    sequence_log_ratio,
    whiten,
)

F64 = torch.float64
NAN = float("nan")


def test_leave_one_out_mean_hand_computed():
    r = torch.tensor([[1.0, 0.0, 0.0], [0.5, 1.0, 0.0]], dtype=F64)
    # row 0: others of 1 -> (0+0)/2 = 0; of each 0 -> (1+0)/2 = 0.5
    # row 1: others of 0.5 -> (1+0)/2 = 0.5; of 1 -> 0.25; of 0 -> 0.75
    expected = torch.tensor([[0.0, 0.5, 0.5], [0.5, 0.25, 0.75]], dtype=F64)
    torch.testing.assert_close(leave_one_out_mean(r), expected)


def test_constant_groups_and_grouped_rewards_errors():
    r = torch.tensor([[0.1, 0.1], [0.1, 0.2]], dtype=F64)
    assert constant_groups(r).flatten().tolist() == [True, False]
    with pytest.raises(ValueError, match="f: group_size must be >= 2 for a group baseline, got 1"):
        grouped_rewards("f", torch.zeros(4), 1)
    with pytest.raises(ValueError, match=r"f: rewards are not finite at sequence indices \[1, 3\]"):
        grouped_rewards("f", torch.tensor([0.0, math.inf, 0.0, NAN]), 2)


def test_broadcast_and_lengths():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]])
    out = broadcast_to_tokens(torch.tensor([2.0, 3.0, -1.0]), mask, F64)
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, -1.0, -1.0]], dtype=F64))
    assert sequence_lengths(mask).tolist() == [2, 0, 2]


def test_per_sequence_reads_first_valid_token_and_refuses_varying_rows():
    # row 2 is left-padded: its first valid token is at index 1 (the padding holds a different value)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 1]])
    x = torch.tensor([[2.0, 2.0, 9.0], [7.0, 7.0, 7.0], [5.0, -1.0, -1.0]])
    assert per_sequence("f", "advantages", x, mask).tolist() == [2.0, 0.0, -1.0]  # empty row -> 0
    x[2, 2] = -1.5
    with pytest.raises(ValueError, match=r"f: advantages must be one value per sequence .* rows \[2\] vary"):
        per_sequence("f", "advantages", x, mask)
    x[2, 2] = NAN
    with pytest.raises(ValueError, match=r"f: advantages are not finite on valid tokens of rows \[2\]"):
        per_sequence("f", "advantages", x, mask)


def test_sequence_log_ratio_value_gradient_and_nan_padding():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    lp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -math.inf, NAN]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.5, -1.0, NAN], [-0.25, NAN, 0.0]], dtype=F64)
    delta = sequence_log_ratio(lp, old, mask)
    # row 0: (-1 + 1.5) + (-2 + 1) = -0.5; row 1: -0.5 + 0.25 = -0.25
    torch.testing.assert_close(delta, torch.tensor([-0.5, -0.25], dtype=F64))
    delta.sum().backward()
    # d Delta_i / d lp[i, t] = 1 on valid tokens, exactly 0 (not NaN) on padding
    torch.testing.assert_close(lp.grad, mask.to(F64))


def test_whiten_hand_computed():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    x = torch.tensor([[1.0, 2.0, 3.0], [5.0, NAN, 7.0]], dtype=F64)
    # valid [1, 2, 3, 5]: mean 11/4 = 2.75; deviations [-1.75, -0.75, 0.25, 2.25];
    # squares sum 3.0625 + 0.5625 + 0.0625 + 5.0625 = 8.75; unbiased var 8.75 / 3 = 2.9166667,
    # std 1.7078251 -> [-1.0246951, -0.4391550, 0.1463850, 1.3174651]
    w = [[-1.0246951, -0.4391550, 0.1463850], [1.3174651, 0.0, 0.0]]
    torch.testing.assert_close(whiten(x, mask), torch.tensor(w, dtype=F64), atol=1e-7, rtol=0)
    # keep the mean: + 2.75 on valid tokens, padding still 0
    kept = [[1.7253049, 2.3108450, 2.8963850], [4.0674651, 0.0, 0.0]]
    torch.testing.assert_close(whiten(x, mask, shift_mean=False), torch.tensor(kept, dtype=F64), atol=1e-7, rtol=0)


def test_whiten_errors_and_dtype():
    with pytest.raises(ValueError, match="at least 2 valid tokens .* got 1"):
        whiten(torch.ones(2, 2), torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 3\), expected \(2, 2\)"):
        whiten(torch.ones(2, 2), torch.ones(2, 3))
    out = whiten(torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16), torch.ones(1, 2))
    assert out.dtype == torch.float32
    # [1, 3]: mean 2, unbiased var 2 -> [-1/sqrt2, 1/sqrt2]
    torch.testing.assert_close(out, torch.tensor([[-0.7071068, 0.7071068]]))
