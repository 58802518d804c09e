"""parity.correction: each mode's weights and metrics pinned to hand-computed values."""

import math

import pytest
import torch

from parity.correction import VALID_MODES, CorrectionConfig, importance_weights

# 2x3 example; the last position of row 1 is padding holding garbage (+inf / NaN).
#   d = lp_t - lp_r:  row 0: [0.9, -0.1, 0.0]   row 1: [-1.0, -0.6, pad]
#   rho = exp(d):     row 0: [2.459603, 0.904837, 1.0]   row 1: [0.367879, 0.548812, pad]
TRAIN = torch.tensor([[-0.2, -1.1, -0.7], [-2.0, -1.6, math.inf]])
ROLL = torch.tensor([[-1.1, -1.0, -0.7], [-1.0, -1.0, math.nan]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
E = math.exp


def _run(mode, train=TRAIN, roll=ROLL, mask=MASK, **kw):
    return importance_weights(train, roll, mask, CorrectionConfig(mode=mode, **kw))


def _close(w, expected):
    torch.testing.assert_close(w, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=1e-6)


def test_none():
    w, m = _run("none")
    _close(w, [[1, 1, 1], [1, 1, 0]])
    # all weights equal -> ESS = 25 / (5 * 5) = 1
    assert m == {
        "correction/num_tokens": 5.0,
        "correction/frac_clipped": 0.0,
        "correction/frac_masked": 0.0,
        "correction/ess": 1.0,
    }


def test_tis():
    w, m = _run("tis")  # C = 2: only rho = 2.459603 is clipped
    _close(w, [[2.0, E(-0.1), 1.0], [E(-1.0), E(-0.6), 0.0]])
    assert w.dtype == torch.float32
    # clipped: 1 of 5 = 0.2
    assert m["correction/frac_clipped"] == pytest.approx(0.2)
    assert m["correction/frac_masked"] == 0.0
    # w = 2, .904837, 1, .367879, .548812: sum = 4.821528, sum w^2 = 4 + .818731 + 1 + .135335 + .301194 = 6.255260
    # ESS = 4.821528^2 / (5 * 6.255260) = 23.247137 / 31.276301 = 0.743283
    assert m["correction/ess"] == pytest.approx(0.743283, abs=1e-6)


def test_tis_cap_changes_clipping():
    w, m = _run("tis", tis_cap=0.95)  # rho > .95: 2.459603 and 1.0 are clipped, .904837 is not
    _close(w, [[0.95, E(-0.1), 0.95], [E(-1.0), E(-0.6), 0.0]])
    assert m["correction/frac_clipped"] == pytest.approx(0.4)


def test_mis():
    w, m = _run("mis")  # band [.5, 2]: 2.459603 > 2 and .367879 < .5 are dropped
    _close(w, [[0, 1, 1], [0, 1, 0]])
    assert m["correction/frac_masked"] == pytest.approx(0.4)  # 2 of 5
    assert m["correction/frac_clipped"] == 0.0
    assert m["correction/ess"] == pytest.approx(0.6)  # sum w = 3, sum w^2 = 3 -> 9 / (5 * 3)


def test_seq_mis():
    w, m = _run("seq_mis")
    # row 0: mean d = 0.8 / 3 = .266667 -> exp = 1.305605 in [.5, 2]: kept (though token 0 alone is out)
    # row 1: mean d = -1.6 / 2 = -0.8 -> exp = .449329 < .5: whole row dropped (though token 1 alone is in)
    _close(w, [[1, 1, 1], [0, 0, 0]])
    assert m["correction/frac_masked"] == pytest.approx(0.4)  # 2 of 5
    assert m["correction/ess"] == pytest.approx(0.6)  # 3^2 / (5 * 3)


def test_seq_mis_row_with_no_valid_tokens():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    w, m = _run("seq_mis", mask=mask)
    _close(w, [[1, 1, 1], [0, 0, 0]])
    assert m["correction/frac_masked"] == 0.0 and m["correction/ess"] == 1.0


def test_int_mask_same_as_bool():
    for mode in VALID_MODES:
        wb, mb = _run(mode)
        wi, mi = _run(mode, mask=MASK.long())
        assert torch.equal(wb, wi) and mb == mi


def test_all_weights_zero_ess_is_zero_not_nan():
    # band [.99, 1.01] keeps only rho = 1.0 (row 0, token 2) under mis; make that token 0.5 too
    train = TRAIN.clone()
    train[0, 2] = -0.7 + math.log(0.5)
    w, m = _run("mis", train=train, low=0.99, high=1.01)
    assert torch.equal(w, torch.zeros(2, 3))
    assert m["correction/frac_masked"] == 1.0 and m["correction/ess"] == 0.0


@pytest.mark.parametrize("mode", VALID_MODES)
def test_empty_mask(mode):
    w, m = _run(mode, mask=torch.zeros(2, 3, dtype=torch.bool))
    assert torch.equal(w, torch.zeros(2, 3))
    assert m == {
        "correction/num_tokens": 0.0,
        "correction/frac_clipped": 0.0,
        "correction/frac_masked": 0.0,
        "correction/ess": 0.0,
    }


@pytest.mark.parametrize("mode", VALID_MODES)
def test_weights_carry_no_grad(mode):
    t = TRAIN.clone().requires_grad_(True)
    r = ROLL.clone().requires_grad_(True)
    w, _ = importance_weights(t, r, MASK, CorrectionConfig(mode=mode))
    assert not w.requires_grad and w.grad_fn is None
    # The loss's gradient flows only through its own log-prob term, scaled by the constant w.
    (w * torch.where(MASK, t, torch.zeros(()))).sum().backward()
    torch.testing.assert_close(t.grad, w)
    assert r.grad is None


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"mode": "ppo"}, "mode"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"tis_cap": -1.0}, "tis_cap"),
        ({"tis_cap": math.nan}, "tis_cap"),
        ({"low": 0.0}, "low"),
        ({"low": 1.0}, "low"),
        ({"low": math.nan}, "low"),
        ({"high": 1.0}, "high"),
        ({"high": 0.5}, "high"),
        ({"high": math.inf}, "high"),
    ],
)
def test_config_validation(kw, field):
    with pytest.raises(ValueError) as e:
        CorrectionConfig(**kw)
    msg = str(e.value)
    assert msg.startswith(f"{field}:") and repr(next(iter(kw.values()))) in msg


def test_mode_error_lists_valid_modes():
    with pytest.raises(ValueError, match="none.*tis.*mis.*seq_mis.*'ppo'"):
        CorrectionConfig(mode="ppo")


@pytest.mark.parametrize("side", ["train_logprobs", "rollout_logprobs"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_at_valid_position(side, bad):
    train, roll = TRAIN.clone(), ROLL.clone()
    (train if side == "train_logprobs" else roll)[0, 1] = bad
    with pytest.raises(ValueError, match=f"^{side}:"):
        importance_weights(train, roll, MASK, CorrectionConfig(mode="tis"))


def test_bad_shapes_and_mask():
    cfg = CorrectionConfig()
    with pytest.raises(ValueError, match="^rollout_logprobs:"):
        importance_weights(TRAIN, ROLL[:, :2], MASK, cfg)
    with pytest.raises(ValueError, match="^train_logprobs:"):
        importance_weights(TRAIN[0], ROLL[0], MASK[0], cfg)
    with pytest.raises(ValueError, match="^mask:"):
        importance_weights(TRAIN, ROLL, MASK.long() * 2, cfg)
    with pytest.raises(ValueError, match="^cfg:"):
        importance_weights(TRAIN, ROLL, MASK, "tis")
