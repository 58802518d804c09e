"""The shadow table (every rule on the same batch; the row in use equals the live metrics) and each rule's option
validation (thresholds in range, refused naming the rule, the key and the value)."""
import dataclasses
import math

import pytest
import torch
from correction_batch import inputs  # this folder is on sys.path

from parity.corrections import (
    PRESETS,
    CorrectionPlan,
    OptionError,
    correction_metrics,
    get_preset,
    get_rule,
    rule_names,
    shadow_rows,
)
from parity.corrections.shadow import COLUMNS


def _plan(name, **options):
    return CorrectionPlan((name,), {name: get_rule(name).options(**options)})


def test_one_row_per_rule_and_the_in_use_row_is_the_live_metrics():
    # non-default options, so a shadow that ran the rule on its defaults would not match
    live = _plan("token_mis", low=0.4, high=2.0)
    rows = shadow_rows(inputs(), live)
    assert [r["rule"] for r in rows] == rule_names()
    in_use = [r for r in rows if r["in_use"]]
    assert [r["rule"] for r in in_use] == ["token_mis"] and in_use[0]["options"] == "token_mis(low=0.4, high=2)"
    metrics, _ = correction_metrics(inputs(), live)
    for c in COLUMNS:
        assert in_use[0][c] == metrics[f"correction/{c}"], c
    # 0.367879 < 0.4 and 2.459603 > 2 dropped: 2 of 5
    assert in_use[0]["frac_masked"] == pytest.approx(0.4)
    # every other row runs its rule on its defaults: token_tis at cap 2 clips 1 of 5
    tis = next(r for r in rows if r["rule"] == "token_tis")
    assert not tis["in_use"] and tis["frac_clipped"] == pytest.approx(0.2) and tis["options"] == "token_tis(cap=2)"


def test_a_combination_gets_its_own_row():
    live = CorrectionPlan(("token_tis", "seq_max_k3"), {"seq_max_k3": get_rule("seq_max_k3").options(max_kl=0.4)},
                          batch_normalize=True)
    rows = shadow_rows(inputs(), live)
    assert len(rows) == len(rule_names()) + 1
    last = rows[-1]
    assert last["rule"] == "token_tis x seq_max_k3 (batch-normalised)" and last["in_use"]
    metrics, _ = correction_metrics(inputs(), live)
    assert all(last[c] == metrics[f"correction/{c}"] for c in COLUMNS)
    # the rule rows of a combination run each rule alone (with the run's options): not in use by themselves
    assert not any(r["in_use"] for r in rows[:-1])
    assert next(r for r in rows if r["rule"] == "seq_max_k3")["options"] == "seq_max_k3(max_kl=0.4)"


def test_shadow_without_advantages_leaves_opsm_out_and_pools_once():
    calls = []

    def pool(stats):
        calls.append(len(stats))
        return stats

    rows = shadow_rows(inputs(adv=None), CorrectionPlan(), pool=pool)
    assert "opsm" not in [r["rule"] for r in rows] and len(rows) == len(rule_names()) - 1
    assert len(calls) == 1  # one collective for the whole table
    assert all(math.isnan(r["loss_change"]) for r in rows)


def test_shadow_uses_no_weights_of_the_live_step():
    # the table is a function of (d, mask, advantages) only: the same for any live plan, bar the in-use flags
    a = shadow_rows(inputs(), CorrectionPlan())
    b = shadow_rows(inputs(), CorrectionPlan(("token_tis",)))
    assert [{k: v for k, v in r.items() if k != "in_use"} for r in a] == \
        [{k: v for k, v in r.items() if k != "in_use"} for r in b]


# ---------------------------------------------------------------- options


@pytest.mark.parametrize("name", rule_names())
def test_defaults_validate_and_are_frozen(name):
    options = get_rule(name).options()
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(options, dataclasses.fields(options)[0].name, 1.5)


@pytest.mark.parametrize("name, key, value, expected", [
    ("token_tis", "cap", 0.5, ">= 1"),
    ("token_tis", "cap", math.inf, ">= 1"),
    ("seq_tis", "cap", True, ">= 1"),
    ("token_mis", "low", 0.0, "0 < low < 1"),
    ("token_mis", "low", 1.0, "0 < low < 1"),
    ("token_mis", "high", 1.0, "> 1"),
    ("seq_mis", "high", math.nan, "> 1"),
    ("token_k1", "low", -0.5, "0 < low < 1"),
    ("seq_mean_k1", "high", 0.999, "> 1"),
    ("token_k2", "max_kl", 0.0, "> 0"),
    ("seq_sum_k3", "max_kl", -1.0, "> 0"),
    ("seq_max_k2", "max_kl", math.inf, "> 0"),
    ("seq_mean_k3", "max_kl", "0.01", "> 0"),
    ("opsm", "delta", -0.1, ">= 0"),
])
def test_thresholds_out_of_range_are_refused(name, key, value, expected):
    with pytest.raises(OptionError) as e:
        get_rule(name).options(**{key: value})
    assert (e.value.owner, e.value.key, e.value.value) == (name, key, value)
    assert str(e.value).startswith(f"{name}.{key} must be ") and expected in str(e.value) and repr(value) in str(e.value)


def test_every_band_holds_one_and_every_default_is_in_range():
    for name in rule_names():
        o = get_rule(name).options()
        if hasattr(o, "low"):
            assert o.low < 1 < o.high, name
        if hasattr(o, "cap"):
            assert o.cap >= 1, name


def test_unknown_rule_lists_the_names():
    with pytest.raises(ValueError, match="unknown correction rule 'icepop'; valid names: token_mis, token_tis"):
        get_rule("icepop")


def test_registry_refuses_a_duplicate_name():
    from parity.corrections import register_rule

    with pytest.raises(ValueError, match="'token_tis' is already registered"):
        register_rule(get_rule("token_tis"))
    with pytest.raises(ValueError, match="not a usable rule name"):
        register_rule(dataclasses.replace(get_rule("token_tis"), name="none"))


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_build(name):
    p = get_preset(name)
    plan = CorrectionPlan(p.rules, p.options)
    assert plan.rules == p.rules
    if p.bypass:  # bypass: PPO's own ratio is the importance weight, only rejections join it (verl)
        assert plan.weight_rule is None
    assert torch.isfinite(plan.apply(inputs()).weights).all()


def test_unknown_preset_lists_the_names():
    with pytest.raises(ValueError, match="unknown correction preset 'tis'; valid names: decoupled_token_is"):
        get_preset("tis")
