import math

import pytest
import torch

from trainer.algorithms.aggregation import AGG_MODES, LossNormalizer, aggregate

NAN = float("nan")

# 2 x 3 example used throughout. Row 0 has 3 valid tokens, row 1 has 2 (last is padding,
# holding NaN to prove padding never leaks into the result).
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_from_mask_counts_tokens_and_non_empty_sequences():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    norm = LossNormalizer.from_mask(mask, max_len=8)
    # 2 + 0 + 1 = 3 valid tokens; the all-padding row has no token mean so it does not count.
    assert norm == LossNormalizer(num_tokens=3.0, num_seqs=2.0, max_len=8)


def test_token_mean_hand_computed():
    norm = LossNormalizer.from_mask(MASK, max_len=4)
    # (1 + 2 + 3 + 4 + 5) / 5 valid tokens = 15 / 5 = 3
    assert aggregate(PER_TOKEN, MASK, "token_mean", norm).item() == pytest.approx(3.0)


def test_seq_mean_token_mean_hand_computed():
    norm = LossNormalizer.from_mask(MASK, max_len=4)
    # row 0: (1+2+3)/3 = 2; row 1: (4+5)/2 = 4.5; mean over 2 sequences = 6.5/2 = 3.25
    assert aggregate(PER_TOKEN, MASK, "seq_mean_token_mean", norm).item() == pytest.approx(3.25)


def test_seq_mean_token_sum_norm_hand_computed():
    norm = LossNormalizer.from_mask(MASK, max_len=4)
    # row 0: 6/4 = 1.5; row 1: 9/4 = 2.25; mean over 2 sequences = 3.75/2 = 1.875
    # (the constant 4 is max_len, not the padded width 3 nor the row lengths)
    assert aggregate(PER_TOKEN, MASK, "seq_mean_token_sum_norm", norm).item() == pytest.approx(1.875)


def test_gradient_per_mode_and_zero_on_padding():
    norm = LossNormalizer.from_mask(MASK, max_len=4)
    expected = {
        # d/dx of sum/5: 1/5 on every valid token
        "token_mean": [[0.2, 0.2, 0.2], [0.2, 0.2, 0.0]],
        # 1/(L_s * 2 seqs): row 0 1/6, row 1 1/4
        "seq_mean_token_mean": [[1 / 6, 1 / 6, 1 / 6], [0.25, 0.25, 0.0]],
        # 1/(max_len 4 * 2 seqs) = 1/8 everywhere valid
        "seq_mean_token_sum_norm": [[0.125, 0.125, 0.125], [0.125, 0.125, 0.0]],
    }
    for mode, grad in expected.items():
        x = PER_TOKEN.clone().requires_grad_(True)
        aggregate(x, MASK, mode, norm).backward()
        torch.testing.assert_close(x.grad, torch.tensor(grad, dtype=torch.float64), msg=mode)


def test_empty_sequence_contributes_nothing():
    per_token = torch.tensor([[1.0, 2.0], [7.0, 7.0]])
    mask = torch.tensor([[1, 1], [0, 0]])
    norm = LossNormalizer.from_mask(mask, max_len=2)
    # only row 0 counts: token mean 1.5, seq mean (3/2)/1 = 1.5, sum-norm (3/2)/1 = 1.5
    for mode in AGG_MODES:
        out = aggregate(per_token, mask, mode, norm)
        assert torch.isfinite(out) and out.item() == pytest.approx(1.5), mode


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batch_sum_equals_full_batch(mode):
    gen = torch.Generator().manual_seed(0)
    s, t = 7, 6
    per_token = torch.randn(s, t, generator=gen, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 4])  # includes an empty row
    mask = torch.arange(t)[None, :] < lengths[:, None]
    norm = LossNormalizer.from_mask(mask, max_len=10)
    full = aggregate(per_token, mask, mode, norm)
    total = torch.zeros((), dtype=torch.float64)
    for rows in (slice(0, 2), slice(2, 3), slice(3, 7)):
        # each micro-batch trimmed to its own padded width, as a collator would do
        width = max(int(lengths[rows].max()), 1)
        total = total + aggregate(per_token[rows, :width], mask[rows, :width], mode, norm)
    torch.testing.assert_close(total, full)


def test_unknown_mode_lists_valid_modes():
    norm = LossNormalizer.from_mask(MASK, max_len=4)
    with pytest.raises(ValueError, match="'sum'.*token_mean, seq_mean_token_mean, seq_mean_token_sum_norm"):
        aggregate(PER_TOKEN, MASK, "sum", norm)


def test_shape_errors():
    norm = LossNormalizer.from_mask(MASK, max_len=4)
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\), expected \(2, 3\)"):
        aggregate(PER_TOKEN, MASK[:, :2], "token_mean", norm)
    with pytest.raises(ValueError, match="per_token must be 2-D"):
        aggregate(PER_TOKEN[0], MASK[0], "token_mean", norm)


def test_normalizer_validation():
    with pytest.raises(ValueError, match="no valid tokens"):
        LossNormalizer.from_mask(torch.zeros(2, 3), max_len=4)
    with pytest.raises(ValueError, match="max_len must be an int >= 1, got 0"):
        LossNormalizer.from_mask(MASK, max_len=0)
    with pytest.raises(ValueError, match="num_tokens must be > 0"):
        LossNormalizer(num_tokens=0.0, num_seqs=1.0, max_len=1)
    with pytest.raises(ValueError, match="num_seqs must be > 0"):
        LossNormalizer(num_tokens=1.0, num_seqs=math.nan, max_len=1)
    with pytest.raises(ValueError, match="full_mask must be a 2-D"):
        LossNormalizer.from_mask(torch.ones(3), max_len=4)
