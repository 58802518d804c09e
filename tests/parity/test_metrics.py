"""parity.metrics: every key pinned to a hand-computed value; masking, merging, edge cases."""

import math

import pytest
import torch

from parity import metrics as M
from parity.metrics import compare, finalize, merge_stats, sufficient_stats, topk_kl

# Tiny example: two sequences, the second padded after 2 tokens.
#   d = lp_t - lp_r:   seq 0: [0.1, -0.2, 0.0]   seq 1: [0.3, -0.1]
TRAIN = torch.tensor([[-1.0, -0.5, -2.0, 0.0], [-0.2, -1.1, 0.0, 0.0]])
ROLL = torch.tensor([[-1.1, -0.3, -2.0, 0.0], [-0.5, -1.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
D = [0.1, -0.2, 0.0, 0.3, -0.1]
LT = [-1.0, -0.5, -2.0, -0.2, -1.1]
LR = [-1.1, -0.3, -2.0, -0.5, -1.0]


def _pearson(x, y):
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))


def test_every_key_hand_computed():
    out = compare(TRAIN, ROLL, MASK)
    expected = {
        "parity/num_tokens": 5.0,
        # |d| = .1 .2 0 .3 .1 -> sum .7 -> /5
        "parity/mae": 0.14,
        # d^2 = .01 .04 0 .09 .01 = .15 -> mean .03 -> sqrt = 0.17320508
        "parity/rmse": math.sqrt(0.03),
        # lp_t mean = -4.8/5 = -0.96, lp_r mean = -4.9/5 = -0.98
        # dev_t = -.04 .46 -1.04 .76 -.14 ; dev_r = -.12 .68 -1.02 .48 -.02
        # cov = .0048 + .3128 + 1.0608 + .3648 + .0028 = 1.746
        # var_t = .0016+.2116+1.0816+.5776+.0196 = 1.892 ; var_r = .0144+.4624+1.0404+.2304+.0004 = 1.748
        # r = 1.746 / sqrt(1.892 * 1.748) = 1.746 / 1.818583 = 0.960088
        "parity/pearson": 1.746 / math.sqrt(1.892 * 1.748),
        "parity/max_abs": 0.3,
        # nearest rank ceil(.99*5) = 5 -> the max, 0.3 (the histogram bin edge is capped at the max)
        "parity/p99_abs": 0.3,
        # mean(-d) = -(0.1)/5 = -0.02
        "parity/kl_k1": -0.02,
        # mean(d^2/2) = .15/2/5 = 0.015
        "parity/kl_k2": 0.015,
        # rho-1-d: e^.1-1.1 = .00517092, e^-.2-.8 = .01873075, 0, e^.3-1.3 = .04985881, e^-.1-.9 = .00483742
        # sum = .07859790 -> /5 = .01571958
        "parity/kl_k3": (math.exp(0.1) - 1.1 + math.exp(-0.2) - 0.8 + math.exp(0.3) - 1.3 + math.exp(-0.1) - 0.9) / 5,
        # |e^lt - e^lr|: |.367879-.332871|=.035008, |.606531-.740818|=.134288, 0,
        #                |.818731-.606531|=.212200, |.332871-.367879|=.035008 -> sum .416504 / 5 = .0833008
        "parity/prob_mae": sum(abs(math.exp(a) - math.exp(b)) for a, b in zip(LT, LR)) / 5,
        # p_t = .367879 .606531 .135335 .818731 .332871 (mean .452269)
        # p_r = .332871 .740818 .135335 .606531 .367879 (mean .436687)
        # dev_t = -.084390 .154261 -.316934 .366461 -.119398 ; dev_r = -.103816 .304131 -.301352 .169844 -.068807
        # cov = .221642, var_t = .279915, var_r = .227668 -> r = .221642 / sqrt(.279915 * .227668) = .877987
        "parity/pearson_prob": 0.877987,
        # e^|d|: 1.105171 + 1.221403 + 1 + 1.349859 + 1.105171 = 5.781604 -> /5 = 1.156321
        "parity/token_mult_prob_error": (2 * math.exp(0.1) + math.exp(0.2) + 1 + math.exp(0.3)) / 5,
        # rho = 1.105 (out), 0.819 (out), 1 (in), 1.350 (out), 0.905 (in) -> 3/5
        "parity/frac_rho_outside_0.9_1.1": 0.6,
        # rho^2 = e^.2 + e^-.4 + 1 + e^.6 + e^-.2 = 1.221403 + .670320 + 1 + 1.822119 + .818731 = 5.532573
        # -> /5 - 1 = .1065146
        "parity/chi2": (math.exp(0.2) + math.exp(-0.4) + 1 + math.exp(0.6) + math.exp(-0.2)) / 5 - 1,
        # min d = -0.2, max d = 0.3
        "parity/rho_min": math.exp(-0.2),
        "parity/rho_max": math.exp(0.3),
        # S = [0.1 - 0.2 + 0, 0.3 - 0.1] = [-0.1, 0.2]; mean .05; max|S| .2
        "parity/seq_log_ratio_mean": 0.05,
        "parity/seq_log_ratio_abs_max": 0.2,
        # S/L = [-0.1/3, 0.2/2] = [-.033333, .1]; mean .0333333; max .1
        "parity/seq_log_ratio_norm_mean": (-0.1 / 3 + 0.1) / 2,
        "parity/seq_log_ratio_norm_abs_max": 0.1,
    }
    assert set(out) == set(expected)
    for k, v in expected.items():
        # Inputs are float32 (0.1 is not exact): 1e-6 covers their rounding.
        assert out[k] == pytest.approx(v, abs=1e-6), k
    assert out["parity/pearson_prob"] == pytest.approx(
        _pearson([math.exp(a) for a in LT], [math.exp(b) for b in LR]), abs=1e-6
    )


def test_p99_from_histogram_bounds_exact_value():
    # |d| = 0.01 * k for k = 1..200: nearest rank ceil(.99 * 200) = 198 -> exact p99 = 1.98.
    # The estimate is the upper edge of its log bin: exact <= est <= exact * 10**0.01 (+2.3%).
    d = torch.arange(1, 201, dtype=torch.float64) * 0.01
    train = d.view(2, 100)
    out = compare(train, torch.zeros_like(train), torch.ones_like(train, dtype=torch.bool))
    assert 1.98 <= out["parity/p99_abs"] <= 1.98 * 10**0.01
    assert out["parity/max_abs"] == pytest.approx(2.0)


def test_p99_tiny_and_zero_differences():
    # |d| below the histogram floor 1e-7 -> reported as min(1e-7, max); all zero -> exactly 0.
    z = torch.zeros(1, 4)
    assert compare(z, z, torch.ones(1, 4))["parity/p99_abs"] == 0.0
    tiny = torch.full((1, 4), 1e-9, dtype=torch.float64)
    assert compare(tiny, z.double(), torch.ones(1, 4))["parity/p99_abs"] == pytest.approx(1e-9)


def test_masked_positions_are_never_read():
    garbage_t, garbage_r = TRAIN.clone(), ROLL.clone()
    garbage_t[~MASK] = torch.tensor([float("nan"), float("-inf"), 1e30])
    garbage_r[~MASK] = torch.tensor([float("-inf"), float("inf"), -7.0])
    assert compare(garbage_t, garbage_r, MASK) == compare(TRAIN, ROLL, MASK)


def test_mask_as_float_01():
    assert compare(TRAIN, ROLL, MASK.float()) == compare(TRAIN, ROLL, MASK)
    with pytest.raises(ValueError, match="mask: expected bool or 0/1"):
        compare(TRAIN, ROLL, MASK.float() * 0.5)


def test_empty_mask_gives_only_token_count():
    out = compare(TRAIN, ROLL, torch.zeros_like(MASK))
    assert out == {"parity/num_tokens": 0.0}


@pytest.mark.parametrize("side", ["train_logprobs", "rollout_logprobs"])
def test_non_finite_valid_tokens_raise_naming_side_and_count(side):
    bad = (TRAIN if side == "train_logprobs" else ROLL).clone()
    bad[0, 1] = float("-inf")
    bad[1, 0] = float("-inf")
    args = (bad, ROLL) if side == "train_logprobs" else (TRAIN, bad)
    with pytest.raises(ValueError, match=rf"{side}: 2 of 5 valid .* \(2 -inf, 0 \+inf, 0 nan\)"):
        compare(*args, MASK)


def test_the_error_names_only_the_causes_its_values_point_at():
    """A NaN is a forward that computed no number (NaN weights after an update did this on a GPU), not a filtered
    distribution: the message says which, by the values it found."""
    nan = TRAIN.clone()
    nan[0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"\(0 -inf, 0 \+inf, 1 nan\); a NaN \(or \+inf\) log-prob means") as e:
        compare(nan, ROLL, MASK)
    assert "top-k" not in str(e.value)
    nan[0, 0] = float("-inf")
    with pytest.raises(ValueError, match=r"zero probability .*; a NaN"):
        compare(nan, ROLL, MASK)


def test_merge_of_halves_equals_whole():
    g = torch.Generator().manual_seed(0)
    train = -torch.rand(6, 9, generator=g) * 3
    roll = train + torch.randn(6, 9, generator=g) * 0.05
    mask = torch.rand(6, 9, generator=g) > 0.3
    whole = compare(train, roll, mask)
    merged = finalize(merge_stats([sufficient_stats(train[:2], roll[:2], mask[:2]), sufficient_stats(train[2:], roll[2:], mask[2:])]))
    assert set(whole) == set(merged)
    for k in whole:
        assert merged[k] == pytest.approx(whole[k], rel=1e-12, abs=1e-12), k
    # ...which the mean of per-half Pearsons is not:
    halves = [compare(train[:2], roll[:2], mask[:2]), compare(train[2:], roll[2:], mask[2:])]
    assert abs((halves[0]["parity/pearson"] + halves[1]["parity/pearson"]) / 2 - whole["parity/pearson"]) > 1e-6


def test_merge_with_an_empty_shard():
    full = sufficient_stats(TRAIN, ROLL, MASK)
    empty = sufficient_stats(TRAIN, ROLL, torch.zeros_like(MASK))
    assert finalize(merge_stats([empty, full])) == finalize(full)


def test_reduction_rule():
    stats = sufficient_stats(TRAIN, ROLL, MASK)
    assert {k for k in stats if M.reduction(k) == "max"} == {"abs_d_max", "seq_abs_max", "seq_norm_abs_max", "d_max", "neg_d_max"}


def test_pearson_zero_variance():
    # Constant and identical sides -> 1.0; constant but different -> 0.0; one token -> same rule.
    c = torch.full((2, 3), -0.7)
    mask = torch.ones(2, 3, dtype=torch.bool)
    out = compare(c, c, mask)
    assert out["parity/pearson"] == 1.0 and out["parity/pearson_prob"] == 1.0
    out = compare(c, c - 0.1, mask)
    assert out["parity/pearson"] == 0.0 and out["parity/pearson_prob"] == 0.0
    varying = torch.tensor([[-0.1, -0.5, -0.9]])
    assert compare(varying, torch.full((1, 3), -0.4), torch.ones(1, 3))["parity/pearson"] == 0.0
    assert compare(varying[:, :1], varying[:, :1], torch.ones(1, 1))["parity/pearson"] == 1.0
    assert all(math.isfinite(v) for v in out.values())


def test_shape_errors():
    with pytest.raises(ValueError, match="rollout_logprobs: expected shape"):
        compare(TRAIN, ROLL[:, :3], MASK)
    with pytest.raises(ValueError, match="mask: expected shape"):
        compare(TRAIN, ROLL, MASK[:, :3])
    with pytest.raises(ValueError, match=r"train_logprobs: expected a \[B, T\]"):
        compare(TRAIN[0], ROLL[0], MASK[0])


# ---------------------------------------------------------------- top-k KL


def test_topk_kl_hand_value():
    # k = 2. Rollout buckets q = [0.5, 0.3, rest 0.2]; train p = [0.4, 0.4, rest 0.2]:
    #   KL = .5 ln(.5/.4) + .3 ln(.3/.4) + .2 ln(.2/.2)
    #      = .5 * .2231436 + .3 * -.2876821 + 0 = .1115718 - .0863046 = .0252672
    # Second position masked out (garbage there).
    roll = torch.log(torch.tensor([[[0.5, 0.3], [0.9, 0.9]]]))
    train = torch.log(torch.tensor([[[0.4, 0.4], [0.1, 0.1]]]))
    train[0, 1, 0] = float("nan")
    mask = torch.tensor([[True, False]])
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)
    assert topk_kl(train, roll, mask) == pytest.approx(expected, abs=1e-6)
    assert compare(
        torch.zeros(1, 2), torch.zeros(1, 2), mask, train_topk_logprobs=train, rollout_topk_logprobs=roll
    )["parity/topk_kl"] == pytest.approx(expected, abs=1e-6)


def test_topk_kl_rest_floor_and_rollout_zero_prob():
    # Rollout top-2 = [1.0, 0.0 (-inf)] -> rest 1 - 1 = 0 -> floor 1e-12; train [0.5, 0.25], rest .25:
    #   KL = 1 * ln(1/.5) + 0 + 1e-12 * ln(1e-12/.25) = ln 2 - 2.6e-11
    roll = torch.tensor([[[0.0, float("-inf")]]], dtype=torch.float64)
    train = torch.log(torch.tensor([[[0.5, 0.25]]], dtype=torch.float64))
    assert topk_kl(train, roll, torch.ones(1, 1)) == pytest.approx(math.log(2), abs=1e-9)
    with pytest.raises(ValueError, match="train_topk_logprobs: 1 top-k entries have probability 0 on the trainer"):
        topk_kl(roll, train, torch.ones(1, 1))  # -inf on the train side where the engine's is positive: an error
    # -inf on both sides (outside a truncated sampler's kept set): that bucket contributes 0
    both = torch.tensor([[[0.0, float("-inf")]]], dtype=torch.float64)
    assert topk_kl(both, both, torch.ones(1, 1)) == pytest.approx(0.0, abs=1e-9)


def test_topk_kl_is_a_lower_bound_of_full_kl():
    g = torch.Generator().manual_seed(0)
    b, t, v, k = 4, 16, 50, 5
    lr = torch.log_softmax(torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2, -1)
    lt = torch.log_softmax(lr + torch.randn(b, t, v, generator=g, dtype=torch.float64) * 0.5, -1)
    full = (lr.exp() * (lr - lt)).sum(-1)  # [b, t] per-position KL(rollout || train)
    ids = lr.topk(k, dim=-1).indices
    mask = torch.ones(b, t, dtype=torch.bool)
    for i in range(b):
        for j in range(t):
            m = torch.zeros(b, t, dtype=torch.bool)
            m[i, j] = True
            bound = topk_kl(lt.gather(-1, ids), lr.gather(-1, ids), m)
            assert 0 <= bound <= full[i, j] + 1e-12
    avg = topk_kl(lt.gather(-1, ids), lr.gather(-1, ids), mask)
    assert 0 < avg <= float(full.mean())
    # k = V buckets everything: the bound becomes the full KL.
    ids_all = lr.topk(v, dim=-1).indices
    assert topk_kl(lt.gather(-1, ids_all), lr.gather(-1, ids_all), mask) == pytest.approx(float(full.mean()), rel=1e-6)


# ---------------------------------------------------------------- breakdowns


def test_error_by_position_counts_completion_positions():
    # Left-aligned prompt in the mask: row 0 valid at columns 1,2,3 -> positions 0,1,2;
    # row 1 valid at columns 0,1 -> positions 0,1. d: row0 [_, .1, -.3, .5], row1 [.2, -.2, _, _].
    train = torch.tensor([[9.0, -1.0, -1.3, -0.5], [-0.8, -1.2, 9.0, 9.0]])
    roll = torch.tensor([[0.0, -1.1, -1.0, -1.0], [-1.0, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    rows = M.error_by_position(train, roll, mask)
    # default edges [0, 1, 2, 4]: pos 0 -> {.1, .2}: mean|d| .15, mean d .15
    #                             pos 1 -> {-.3, -.2}: .25, -.25 ; pos 2 -> {.5}: .5, .5
    assert [(r["position_start"], r["position_end"], r["num_tokens"]) for r in rows] == [(0, 1, 2), (1, 2, 2), (2, 4, 1)]
    assert [r["mean_abs_d"] for r in rows] == pytest.approx([0.15, 0.25, 0.5], abs=1e-6)
    assert [r["mean_d"] for r in rows] == pytest.approx([0.15, -0.25, 0.5], abs=1e-6)


def test_error_by_rollout_prob_bins():
    # exp(lr): .332871 (bin .3-.4), .740818 (.7-.8), .135335 (.1-.2), .606531 (.6-.7), .367879 (.3-.4)
    # with lr = [-1.1, -0.3, -2.0, -0.5, -1.0] and d = [.1, -.2, 0, .3, -.1] (the module's example)
    rows = M.error_by_rollout_prob(TRAIN, ROLL, MASK)
    got = {(round(r["prob_start"], 1), r["num_tokens"]): r["mean_abs_d"] for r in rows}
    assert got == pytest.approx({(0.1, 1): 0.0, (0.3, 2): 0.1, (0.6, 1): 0.3, (0.7, 1): 0.2}, abs=1e-6)
    # p = 1 exactly lands in the last (closed) bin.
    one = M.error_by_rollout_prob(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    assert one[0]["prob_end"] == 1.0 and one[0]["num_tokens"] == 1


def test_error_by_entropy_bins():
    entropy = torch.tensor([[0.005, 0.3, 3.0, 99.0], [0.3, 1.5, 99.0, 99.0]])
    rows = M.error_by_entropy(TRAIN, ROLL, MASK, entropy, edges=(0.0, 0.01, 1.0, 10.0))
    # [0, .01): d=.1 ; [.01, 1): d=-.2, .3 -> mean|d| .25, mean d .05 ; [1, 10]: d=0, -.1 -> .05, -.05
    assert [(r["entropy_start"], r["num_tokens"]) for r in rows] == [(0.0, 1), (0.01, 2), (1.0, 2)]
    assert [r["mean_abs_d"] for r in rows] == pytest.approx([0.1, 0.25, 0.05], abs=1e-6)
    assert [r["mean_d"] for r in rows] == pytest.approx([0.1, 0.05, -0.05], abs=1e-6)
    with pytest.raises(ValueError, match="edges"):
        M.error_by_entropy(TRAIN, ROLL, MASK, entropy, edges=(1.0, 0.5))


def test_worst_tokens():
    rows = M.worst_tokens(TRAIN, ROLL, MASK, k=3)
    # |d| ranking: .3 (1,0), .2 (0,1), then a tie .1 at (0,0) and (1,1) -> earlier sample first.
    assert [(r.sample, r.position) for r in rows] == [(1, 0), (0, 1), (0, 0)]
    assert rows[0].lp_t == pytest.approx(-0.2) and rows[0].lp_r == pytest.approx(-0.5)
    assert rows[0].d == pytest.approx(0.3, abs=1e-6)
    assert len(M.worst_tokens(TRAIN, ROLL, MASK, k=50)) == 5
    assert M.worst_tokens(TRAIN, ROLL, torch.zeros_like(MASK)) == []


def test_breakdowns_on_empty_mask():
    empty = torch.zeros_like(MASK)
    assert M.error_by_position(TRAIN, ROLL, empty) == []
    assert M.error_by_rollout_prob(TRAIN, ROLL, empty) == []


def test_log10_histogram_coarsens_and_trims_to_the_data():
    """|d| = 0, 2e-7 (decade [1e-7, 1e-6)), 0.05 and 0.07 (bin [0.05, 0.063) and [0.063, 0.079) at 10 per decade),
    hand-placed; empty bins outside the data are dropped; 1e4 lands in the overflow bin [3, 4)."""
    from parity.metrics import log10_abs_histogram, sufficient_stats

    d = torch.tensor([[0.0, 2e-7, 0.05, 0.07]], dtype=torch.float64)
    stats = sufficient_stats(d, torch.zeros_like(d), torch.ones_like(d, dtype=torch.bool))
    counts, edges = log10_abs_histogram(stats["abs_d_hist"])
    assert len(edges) == len(counts) + 1 and sum(counts) == 4
    # log10: 2e-7 -> -6.699 in [-6.7, -6.6); 0.05 -> -1.301 in [-1.4, -1.3); 0.07 -> -1.155 in [-1.2, -1.1)
    assert {edges[i]: c for i, c in enumerate(counts) if c} == {-8.0: 1, -6.7: 1, -1.4: 1, -1.2: 1}
    assert edges[0] == -8.0 and edges[1] == -7.0 and edges[-1] == -1.1  # trimmed after the last count
    assert all(e2 - e1 == pytest.approx(0.1) for e1, e2 in zip(edges[1:], edges[2:]))
    d = torch.tensor([[1e4]], dtype=torch.float64)
    counts, edges = log10_abs_histogram(sufficient_stats(d, torch.zeros_like(d), torch.ones_like(d) > 0)["abs_d_hist"])
    assert counts == [1.0] and edges == [3.0, 4.0]
    empty = sufficient_stats(d, d.clone(), torch.zeros_like(d) > 0)["abs_d_hist"]
    assert log10_abs_histogram(empty) == ([0.0], [-8.0, -7.0])
    with pytest.raises(ValueError, match="must divide 100"):
        log10_abs_histogram(empty, per_decade=7)


# ---- per-turn parity (multi-turn episodes: sampled runs separated by context tokens) -----------------


def test_turn_index_counts_runs_of_sampled_tokens():
    import torch

    from parity.metrics import turn_index

    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1],
                         [1, 1, 1, 1, 0, 0, 0, 0],
                         [0, 1, 0, 1, 0, 1, 0, 0]])
    assert turn_index(mask).tolist() == [[1, 1, 0, 0, 2, 0, 3, 3],
                                         [1, 1, 1, 1, 0, 0, 0, 0],
                                         [0, 1, 0, 2, 0, 3, 0, 0]]


def test_compare_by_turn_hand_computed():
    import math

    import torch

    from parity.metrics import compare_by_turn

    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]])
    rollout = torch.tensor([[-1.0, -2.0, 0.0, -0.5], [-3.0, 0.0, 0.0, 0.0]])
    # d per token: turn 1 gets 0.1, -0.3 (row 0) and 0.2 (row 1); turn 2 gets 0.4 (row 0); the context token's 9.0
    # must not count anywhere.
    train = rollout + torch.tensor([[0.1, -0.3, 9.0, 0.4], [0.2, 0.0, 0.0, 0.0]])
    got = compare_by_turn(train, rollout, mask)
    assert set(got) == {"parity/turn_1/mae", "parity/turn_1/kl_k3", "parity/turn_2/mae", "parity/turn_2/kl_k3"}
    assert math.isclose(got["parity/turn_1/mae"], (0.1 + 0.3 + 0.2) / 3, rel_tol=1e-6)
    assert math.isclose(got["parity/turn_2/mae"], 0.4, rel_tol=1e-6)
    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731
    assert math.isclose(got["parity/turn_1/kl_k3"], (k3(0.1) + k3(-0.3) + k3(0.2)) / 3, rel_tol=1e-5)
    assert math.isclose(got["parity/turn_2/kl_k3"], k3(0.4), rel_tol=1e-5)
    # Asking for more turns than any row reached: NaN, not an error (ranks agree on one count).
    assert math.isnan(compare_by_turn(train, rollout, mask, num_turns=3)["parity/turn_3/mae"])


def test_error_by_turn_rows_hand_computed():
    import torch

    from parity.metrics import error_by_turn

    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 0, 0]])
    rollout = torch.tensor([[-1.0, -2.0, 0.0, -0.5], [-3.0, 0.0, 0.0, 0.0]])
    train = rollout + torch.tensor([[0.1, -0.3, 9.0, 0.4], [0.2, 0.0, 0.0, 0.0]])  # the context token's 9.0: nowhere
    rows = error_by_turn(train, rollout, mask)
    assert [(r["turn"], r["num_tokens"]) for r in rows] == [(1, 3), (2, 1)]
    assert abs(rows[0]["mean_abs_d"] - 0.2) < 1e-6 and abs(rows[0]["mean_d"] - 0.0) < 1e-6
    assert abs(rows[1]["mean_abs_d"] - 0.4) < 1e-6
