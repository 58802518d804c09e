"""Every correction rule pinned to weights worked by hand on one small batch.

The batch (2 x 3; row 1's last position is padding holding garbage, +inf / NaN, never read):
    d = lp_t - lp_r:   row 0: [ 0.9, -0.1, 0.0]        row 1: [-1.0, -0.6, pad]
    rho = exp(d):      row 0: [2.459603, 0.904837, 1.0]  row 1: [0.367879, 0.548812, pad]
    S = sum d:         row 0: 0.8  -> prod rho = 2.225541     row 1: -1.6 -> 0.201897
    mean d:            row 0: 0.266667 -> exp = 1.305605     row 1: -0.8 -> 0.449329
    k2 = d^2/2:        row 0: [0.405, 0.005, 0]  (sum 0.41, mean 0.136667, max 0.405)
                       row 1: [0.5, 0.18]        (sum 0.68, mean 0.34,     max 0.5)
    k3 = rho-1-d:      row 0: [0.559603, 0.004837, 0]  (sum 0.564440, mean 0.188147, max 0.559603)
                       row 1: [0.367879, 0.148812]     (sum 0.516691, mean 0.258346, max 0.367879)
    advantages:        row 0: +1 on every token, row 1: -1
"""
import math

import pytest
import torch
from correction_batch import ADV, ALL, MASK, NONE, ROLL, ROW0, ROW1, TRAIN, inputs  # this folder is on sys.path

from parity.corrections import CorrectionInputs, CorrectionPlan, get_rule, rule_names
from parity.corrections.record import RuleOutput

E = math.exp

def run(name, **options) -> RuleOutput:
    rule = get_rule(name)
    return rule.run(inputs(), rule.options(**options))


def assert_weights(out: RuleOutput, expected, clipped=NONE, masked=NONE):
    torch.testing.assert_close(out.weights, torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=1e-6)
    assert out.clipped.tolist() == [[bool(x) for x in r] for r in clipped]
    assert out.masked.tolist() == [[bool(x) for x in r] for r in masked]


def test_registered_names_in_the_docs_order():
    assert rule_names() == ["token_mis", "token_tis", "seq_mis", "seq_tis", "token_k1", "token_k2", "token_k3",
                            "opsm", "seq_max_k2", "seq_max_k3", "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
                            "seq_sum_k1", "seq_sum_k2", "seq_sum_k3"]


# ---------------------------------------------------------------- importance weights


def test_token_tis():
    # cap 2: only rho = 2.459603 is above it
    assert_weights(run("token_tis"), [[2.0, E(-0.1), 1.0], [E(-1.0), E(-0.6), 0]], clipped=[[1, 0, 0], [0, 0, 0]])
    # cap 1: 2.459603 and nothing else (1.0 is not above 1)
    assert_weights(run("token_tis", cap=1.0), [[1.0, E(-0.1), 1.0], [E(-1.0), E(-0.6), 0]],
                   clipped=[[1, 0, 0], [0, 0, 0]])


def test_token_mis_is_icepop():
    # band [0.5, 5]: 0.367879 < 0.5 is dropped; the kept tokens keep their ratio (M(k) = k * 1[a <= k <= b])
    assert_weights(run("token_mis"), [[E(0.9), E(-0.1), 1.0], [0, E(-0.6), 0]], masked=[[0, 0, 0], [1, 0, 0]])
    # band [0.5, 2]: 2.459603 is dropped too
    assert_weights(run("token_mis", high=2.0), [[0, E(-0.1), 1.0], [0, E(-0.6), 0]], masked=[[1, 0, 0], [1, 0, 0]])


def test_seq_tis_is_the_product_truncated():
    # row 0: 2.225541 > 2 -> 2 on every token (all clipped); row 1: 0.201897
    assert_weights(run("seq_tis"), [[2, 2, 2], [E(-1.6), E(-1.6), 0]], clipped=ROW0)
    assert_weights(run("seq_tis", cap=3.0), [[E(0.8)] * 3, [E(-1.6), E(-1.6), 0]])


def test_seq_mis():
    # band [0.5, 2]: 2.225541 and 0.201897 are both out
    assert_weights(run("seq_mis"), NONE, masked=ALL)
    # band [0.2, 3]: both in, each keeps its product ratio
    assert_weights(run("seq_mis", low=0.2, high=3.0), [[E(0.8)] * 3, [E(-1.6), E(-1.6), 0]])
    # band [0.21, 3]: 0.201897 < 0.21 -> row 1 out
    assert_weights(run("seq_mis", low=0.21, high=3.0), [[E(0.8)] * 3, [0, 0, 0]], masked=ROW1)


# ---------------------------------------------------------------- token rejection


def test_token_k1_is_a_band_on_the_ratio():
    # [0.5, 2]: 2.459603 and 0.367879 out
    assert_weights(run("token_k1"), [[0, 1, 1], [0, 1, 0]], masked=[[1, 0, 0], [1, 0, 0]])


def test_token_k2_and_k3_defaults_are_the_ratio_2_band():
    # k2 <= 0.2402: 0.405 and 0.5 out; k3 <= 0.3069: 0.559603 and 0.367879 out -> the same tokens as [0.5, 2]
    for name in ("token_k2", "token_k3"):
        assert_weights(run(name), [[0, 1, 1], [0, 1, 0]], masked=[[1, 0, 0], [1, 0, 0]])


def test_token_k3_is_asymmetric_where_k2_is_not():
    # max_kl 0.4: k2 drops 0.405 (rho 2.46) and 0.5 (rho 0.37); k3 drops only 0.559603 (rho 2.46): k3 of rho 0.37
    # is 0.367879, below 0.4
    assert_weights(run("token_k2", max_kl=0.4), [[0, 1, 1], [0, 1, 0]], masked=[[1, 0, 0], [1, 0, 0]])
    assert_weights(run("token_k3", max_kl=0.4), [[0, 1, 1], [1, 1, 0]], masked=[[1, 0, 0], [0, 0, 0]])


# ---------------------------------------------------------------- sequence rejection (trust region masking)


def test_seq_sum_k1():
    assert_weights(run("seq_sum_k1"), NONE, masked=ALL)  # 2.225541 > 2, 0.201897 < 0.5
    assert_weights(run("seq_sum_k1", low=0.1, high=3.0), ALL)


def test_seq_sum_k2_and_k3_order_the_rows_differently():
    assert_weights(run("seq_sum_k2"), ALL)  # 0.41 and 0.68 <= ln 2 = 0.693
    assert_weights(run("seq_sum_k3"), ALL)  # 0.564440 and 0.516691 <= ln 2
    assert_weights(run("seq_sum_k2", max_kl=0.5), ROW0, masked=ROW1)  # 0.68 > 0.5
    assert_weights(run("seq_sum_k3", max_kl=0.55), ROW1, masked=ROW0)  # 0.564440 > 0.55


def _kept_with_ratio(name, ratio, length=1):
    """Whether the rule on its defaults keeps a sequence of ``length`` tokens, each with the ratio ``ratio``."""
    d = torch.full((1, length), math.log(ratio), dtype=torch.float64)
    out = get_rule(name).run(CorrectionInputs.of(d, torch.zeros_like(d), torch.ones_like(d, dtype=torch.bool)))
    return bool(out.weights.all())


@pytest.mark.parametrize("name, low, high, length", [
    # each bound rounded inwards to 4 digits: kept there, dropped 2e-4 further out
    ("seq_sum_k2", 0.3081, 3.2459, 1),  # d^2 / 2 <= ln 2: |d| <= sqrt(2 ln 2) = 1.17741, ratio in [0.30808, 3.24596]
    ("seq_sum_k3", 0.2320, 2.6783, 1),  # e^d - 1 - d = ln 2 at d = -1.46119 and 0.98520: [0.23196, 2.67835]
    ("seq_sum_k2", 0.8890, 1.1249, 100),  # 100 d^2 / 2 <= ln 2: |d| <= 0.117741, ratio in [0.888920, 1.124953]
])
def test_the_ln2_default_keeps_the_ratios_its_docstring_states(name, low, high, length):
    # the bounds parity/corrections/trust_region.py states for the ln 2 default (not seq_sum_k1's [0.5, 2] band)
    assert _kept_with_ratio(name, low, length) and _kept_with_ratio(name, high, length)
    assert not _kept_with_ratio(name, low - 2e-4, length) and not _kept_with_ratio(name, high + 2e-4, length)
    if length == 1:  # wider than seq_sum_k1's [0.5, 2]: ratios 0.4 and 2.5 are kept
        assert _kept_with_ratio(name, 0.4) and _kept_with_ratio(name, 2.5)


def test_seq_mean_k1_is_the_geometric_mean_not_the_product():
    # default [0.999, 1.001]: 1.305605 and 0.449329 both out
    assert_weights(run("seq_mean_k1"), NONE, masked=ALL)
    # [0.45, 1.4]: row 0's geometric mean 1.305605 is in although its product 2.225541 is not; row 1's 0.449329 out
    assert_weights(run("seq_mean_k1", low=0.45, high=1.4), ROW0, masked=ROW1)


def test_seq_mean_k2_k3():
    assert_weights(run("seq_mean_k3"), NONE, masked=ALL)  # 0.188147, 0.258346 > 0.01
    assert_weights(run("seq_mean_k2", max_kl=0.2), ROW0, masked=ROW1)  # 0.136667 <= 0.2 < 0.34
    assert_weights(run("seq_mean_k3", max_kl=0.2), ROW0, masked=ROW1)  # 0.188147 <= 0.2 < 0.258346


def test_seq_max_is_a_veto_by_one_token():
    assert_weights(run("seq_max_k2"), NONE, masked=ALL)  # max k2 0.405, 0.5 > 0.2402
    assert_weights(run("seq_max_k2", max_kl=0.45), ROW0, masked=ROW1)  # 0.405 <= 0.45 < 0.5
    assert_weights(run("seq_max_k3", max_kl=0.4), ROW1, masked=ROW0)  # 0.559603 > 0.4 >= 0.367879


# ---------------------------------------------------------------- DeepSeek-V3.2's off-policy sequence mask


def test_opsm_masks_a_negative_advantage_sequence_the_engine_drifted_from():
    # row 1: A < 0 and mean(-d) = 0.8 > 0.1 -> masked; row 0: A > 0 -> kept whatever its drift
    assert_weights(run("opsm"), ROW0, masked=ROW1)
    # delta 0.9: 0.8 is within it
    assert_weights(run("opsm", delta=0.9), ALL)


def test_opsm_keeps_a_negative_advantage_sequence_the_trainer_likes_more():
    # row 0 with A < 0: mean(-d) = -0.266667 <= 0.1 -> kept
    out = get_rule("opsm").run(inputs(adv=-ADV.abs()), get_rule("opsm").options())
    assert_weights(out, ROW0, masked=ROW1)


def test_opsm_with_per_token_advantages_follows_each_token():
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 2.0, 0.0]])  # PPO-like: row 1's second token has A > 0
    out = get_rule("opsm").run(inputs(adv=adv), get_rule("opsm").options())
    assert_weights(out, [[1, 1, 1], [0, 1, 0]], masked=[[0, 0, 0], [1, 0, 0]])


def test_opsm_needs_advantages():
    with pytest.raises(ValueError, match="opsm: needs the advantages"):
        get_rule("opsm").run(inputs(adv=None))


# ---------------------------------------------------------------- every rule


@pytest.mark.parametrize("name", rule_names())
def test_padding_is_never_read_and_weights_carry_no_grad(name):
    train = TRAIN.clone().requires_grad_(True)
    out = get_rule(name).run(CorrectionInputs.of(train, ROLL, MASK, ADV))
    assert out.weights.shape == (2, 3) and out.weights.dtype == torch.float64
    assert not out.weights.requires_grad and out.weights.grad_fn is None
    assert torch.isfinite(out.weights).all() and out.weights[1, 2] == 0
    assert not out.clipped[1, 2] and not out.masked[1, 2]
    assert not (out.clipped & out.masked).any()
    # a masked token weighs 0 and an unmasked one does not
    assert (out.weights[out.masked] == 0).all() and (out.weights[MASK & ~out.masked] > 0).all()


@pytest.mark.parametrize("name", rule_names())
def test_matched_policies_are_left_alone(name):
    # d = 0 everywhere: every rule keeps every token at weight 1 (each band holds 1, each cap is >= 1)
    same = TRAIN.clone()
    same[1, 2] = 0.0
    out = get_rule(name).run(CorrectionInputs.of(same, same, MASK, ADV))
    assert_weights(out, ALL)


@pytest.mark.parametrize("name", rule_names())
def test_int_mask_same_as_bool(name):
    a = get_rule(name).run(inputs())
    b = get_rule(name).run(inputs(mask=MASK.long()))
    assert torch.equal(a.weights, b.weights) and torch.equal(a.masked, b.masked)


@pytest.mark.parametrize("name", rule_names())
def test_rows_are_independent(name):
    # each rule is local to its sequence: a micro-batch of rows gets the weights the whole batch gives those rows
    # (the loop computes them per micro-batch)
    whole = get_rule(name).run(inputs()).weights
    for r in (0, 1):
        part = get_rule(name).run(CorrectionInputs.of(TRAIN[r:r + 1], ROLL[r:r + 1], MASK[r:r + 1],
                                                      ADV[r:r + 1])).weights
        torch.testing.assert_close(part, whole[r:r + 1])


def test_a_row_without_valid_tokens():
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    for name in rule_names():
        out = get_rule(name).run(inputs(mask=mask))
        assert (out.weights[1] == 0).all() and not out.masked[1].any(), name


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="^rollout_logprobs:"):
        CorrectionInputs.of(TRAIN, ROLL[:, :2], MASK)
    with pytest.raises(ValueError, match="^train_logprobs:"):
        CorrectionInputs.of(TRAIN[0], ROLL[0], MASK[0])
    with pytest.raises(ValueError, match="^mask:"):
        CorrectionInputs.of(TRAIN, ROLL, MASK.long() * 2)
    with pytest.raises(ValueError, match="^advantages:"):
        CorrectionInputs.of(TRAIN, ROLL, MASK, ADV[:, :1])
    bad = TRAIN.clone()
    bad[0, 1] = math.nan
    with pytest.raises(ValueError, match="^train_logprobs:"):
        CorrectionInputs.of(bad, ROLL, MASK)


# ---------------------------------------------------------------- combined as verl does, batch normalisation


def test_is_times_rejection():
    # token_tis x seq_max_k3(0.4): row 0 vetoed (max k3 0.559603), row 1 keeps its TIS weights; the clipped
    # token (0, 0) is also rejected, so it counts as masked, not clipped
    plan = CorrectionPlan(("token_tis", "seq_max_k3"), {"seq_max_k3": get_rule("seq_max_k3").options(max_kl=0.4)})
    out = plan.apply(inputs())
    assert_weights(out, [[0, 0, 0], [E(-1.0), E(-0.6), 0]], masked=ROW0)
    assert set(out.per_rule) == {"token_tis", "seq_max_k3"} and out.per_rule["token_tis"].clipped[0, 0]
    # several rejections: all must keep a token (AND)
    two = CorrectionPlan(("token_k1", "opsm")).apply(inputs())
    assert_weights(two, [[0, 1, 1], [0, 0, 0]], masked=[[1, 0, 0], [1, 1, 0]])


def test_batch_normalised_token_weights():
    # TIS weights 2, .904837, 1, .367879, .548812: mean over the 5 tokens 4.821528 / 5 = 0.964306
    out = CorrectionPlan(("token_tis",), batch_normalize=True).apply(inputs())
    m = (2 + E(-0.1) + 1 + E(-1.0) + E(-0.6)) / 5
    assert out.norm_factor == pytest.approx(m)
    assert_weights(out, [[2 / m, E(-0.1) / m, 1 / m], [E(-1.0) / m, E(-0.6) / m, 0]], clipped=[[1, 0, 0], [0, 0, 0]])
    assert float(out.weights.sum()) == pytest.approx(5.0)  # mean 1 over the valid tokens


def test_batch_normalised_sequence_weights_average_sequences_not_tokens():
    # seq TIS weights: row 0: 2 (3 tokens), row 1: 0.201897 (2 tokens); mean over sequences (2 + .201897) / 2
    out = CorrectionPlan(("seq_tis",), batch_normalize=True).apply(inputs())
    m = (2 + E(-1.6)) / 2
    assert out.norm_factor == pytest.approx(m)
    assert_weights(out, [[2 / m] * 3, [E(-1.6) / m, E(-1.6) / m, 0]], clipped=ROW0)


def test_batch_normalisation_pools_over_ranks():
    # each "rank" holds one row; all_sum adds the other rank's (sum, count): the same weights as one process
    whole = CorrectionPlan(("token_tis",), batch_normalize=True).apply(inputs())
    parts = [CorrectionInputs.of(TRAIN[r:r + 1], ROLL[r:r + 1], MASK[r:r + 1], ADV[r:r + 1]) for r in (0, 1)]

    def totals(p):
        w = get_rule("token_tis").run(p).weights
        return torch.stack([w.sum(), p.mask.double().sum()])

    for r in (0, 1):
        other = totals(parts[1 - r])
        out = CorrectionPlan(("token_tis",), batch_normalize=True).apply(parts[r], all_sum=lambda t, o=other: t + o)
        torch.testing.assert_close(out.weights, whole.weights[r:r + 1])


def test_all_masked_batch_is_not_normalised():
    # verl's guard: a mean of 0 would blow the weights up; they stay 0 and the factor reads 1
    out = CorrectionPlan(("token_mis",), {"token_mis": get_rule("token_mis").options(low=0.99, high=1.001)},
                         batch_normalize=True).apply(inputs(train=ROLL.nan_to_num(0.0) + 0.5))
    assert (out.weights == 0).all() and out.norm_factor == 1.0


def test_plan_refusals():
    from parity.corrections import PlanError

    with pytest.raises(PlanError, match=r"rule = 'tis': expected a correction rule: one of token_mis, token_tis, seq_mis"):
        CorrectionPlan(("tis",))
    with pytest.raises(PlanError, match="at most one importance-weight rule .got token_tis, seq_tis"):
        CorrectionPlan(("token_tis", "seq_tis"))
    with pytest.raises(PlanError, match="each rule at most once"):
        CorrectionPlan(("token_k1", "token_k1"))
    with pytest.raises(PlanError, match="batch_normalize = True: expected false without an importance-weight rule"):
        CorrectionPlan(("seq_mean_k3",), batch_normalize=True)
    with pytest.raises(TypeError, match="not among the rules"):
        CorrectionPlan(("token_tis",), {"token_mis": get_rule("token_mis").options()})
    with pytest.raises(TypeError, match="expected a TokenTISOptions"):
        CorrectionPlan(("token_tis",), {"token_tis": get_rule("token_mis").options()})


def test_plan_properties():
    plan = CorrectionPlan(("seq_tis", "opsm"), batch_normalize=True)
    assert plan.level == "sequence" and plan.needs_advantages and plan.batch_level
    assert plan.weight_rule.name == "seq_tis"
    assert plan.describe() == "seq_tis(cap=2) x opsm(delta=0.1), batch-normalised"
    assert CorrectionPlan(("seq_mean_k3", "token_k2")).level == "token"
    assert not CorrectionPlan() and CorrectionPlan().describe() == "none"
    assert_weights(CorrectionPlan().apply(inputs()), ALL)
