"""The recipe's parity.correction section: rules and their options under their names, presets, and every problem
refused in the one validation pass, naming the key, the value and what was expected -- before any model loads."""
from pathlib import Path

import pytest

from parity.corrections import get_rule
from trainer.config import RecipeError, to_dict
from trainer.lifecycle.preflight import load_recipe

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"


def load(*sets, recipe=RECIPE):
    return load_recipe(recipe, list(sets), check_paths=False)


def test_default_is_no_rule():
    c = load().parity.correction
    assert c.rule == "none" and not c.plan and not c.shadow and not c.bypass and not c.unbiased_kl


def test_one_rule_with_its_options_under_its_name():
    c = load("parity.correction.rule=token_mis", "parity.correction.token_mis.high=3").parity.correction
    assert c.plan.rules == ("token_mis",)
    assert c.options == {"token_mis": get_rule("token_mis").options(low=0.5, high=3.0)}


def test_several_rules_and_defaults_from_each_rule():
    c = load("parity.correction.rule=[seq_tis, seq_max_k2, opsm]", "parity.correction.batch_normalize=true",
             "parity.correction.opsm={delta: 0.05}").parity.correction
    plan = c.plan
    assert plan.rules == ("seq_tis", "seq_max_k2", "opsm") and plan.batch_normalize
    assert plan.options["seq_tis"] == get_rule("seq_tis").options()
    assert plan.options["opsm"].delta == 0.05


def test_a_preset_expands_and_its_options_can_be_overridden():
    c = load("parity.correction.preset=decoupled_k3_rs_token_tis", "parity.correction.seq_mean_k3.max_kl=0.02"
             ).parity.correction
    assert c.plan.rules == ("token_tis", "seq_mean_k3") and c.preset is None
    assert c.options["token_tis"].cap == 2.0 and c.options["seq_mean_k3"].max_kl == 0.02
    assert load("parity.correction.preset=bypass_ppo_clip_k3_rs").parity.correction.bypass


def test_written_recipe_reads_back_to_the_same_section(tmp_path):
    import yaml

    cfg = load("parity.correction.preset=decoupled_geo_rs_token_tis", "parity.correction.token_tis={cap: 3}",
               "parity.correction.shadow=true")
    written = to_dict(cfg)
    assert written["parity"]["correction"]["token_tis"] == {"cap": 3.0}
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump(written, sort_keys=False))
    again = load_recipe(p, check_paths=False).parity.correction
    assert again.plan == cfg.parity.correction.plan and again.shadow


@pytest.mark.parametrize("sets, needles", [
    (["parity.correction.rule=tis"], ["parity.correction.rule = 'tis'", "token_tis", "('tis' is none of them)"]),
    (["parity.correction.rule=[token_tis, none]"], ["parity.correction.rule", "('none' is none of them)"]),
    # options of another rule, named with the rules that have them
    (["parity.correction.rule=token_tis", "parity.correction.token_tis={low: 0.5}"],
     ["--set parity.correction.token_tis={low: 0.5}: parity.correction.token_tis.low = 0.5: not an option of "
      "token_tis; it belongs to token_mis, seq_mis", "(options of token_tis: cap)"]),
    (["parity.correction.rule=token_tis", "parity.correction.cap=3"],
     ["parity.correction.cap = 3: a rule's option goes under the rule's name", "token_tis, seq_tis"]),
    (["parity.correction.rule=token_tis", "parity.correction.token_mis.low=0.4"],
     ["--set parity.correction.token_mis.low=0.4: parity.correction.token_mis.low = 0.4: options of token_mis, "
      "which is not a chosen rule (parity.correction.rule: token_tis)"]),
    (["parity.correction.rule=token_tis", "parity.correction.token_tis=3"],
     ["parity.correction.token_tis = 3: expected a mapping of token_tis's options (cap)"]),
    (["parity.correction.rule=token_tis", "parity.correction.token_tis.capp=3"],
     ["unknown key 'parity.correction.token_tis.capp' (did you mean 'parity.correction.token_tis.cap'?)"]),
    (["parity.correction.mode=tis"], ["unknown key 'parity.correction.mode'", "valid keys here: rule, preset"]),
    # thresholds out of range
    (["parity.correction.rule=token_tis", "parity.correction.token_tis.cap=0.5"],
     ["parity.correction.token_tis.cap = 0.5: expected a finite number >= 1 (token_tis: w_t = min(rho_t, cap))"]),
    (["parity.correction.rule=token_mis", "parity.correction.token_mis.low=1.2"],
     ["parity.correction.token_mis.low = 1.2: expected a finite number with 0 < low < 1"]),
    (["parity.correction.rule=seq_mean_k3", "parity.correction.seq_mean_k3.max_kl=0"],
     ["parity.correction.seq_mean_k3.max_kl = 0.0: expected a finite number > 0"]),
    (["parity.correction.rule=opsm", "parity.correction.opsm.delta=-1"],
     ["parity.correction.opsm.delta = -1.0: expected a finite number >= 0"]),
    (["parity.correction.rule=token_k2", "parity.correction.token_k2.max_kl=.nan"],
     ["parity.correction.token_k2.max_kl = nan: expected a finite number"]),
    # combinations
    (["parity.correction.rule=[token_tis, seq_tis]"],
     ["parity.correction.rule = ['token_tis', 'seq_tis']: expected at most one importance-weight rule"]),
    (["parity.correction.rule=seq_mean_k3", "parity.correction.batch_normalize=true"],
     ["parity.correction.batch_normalize = True: expected false without an importance-weight rule"]),
    (["parity.correction.preset=tis"], ["parity.correction.preset = 'tis': expected one of: decoupled_token_is"]),
    (["parity.correction.preset=decoupled_k3_rs", "parity.correction.rule=token_tis"],
     ["parity.correction.rule = 'token_tis': expected none with parity.correction.preset set"]),
    (["parity.correction.preset=bypass_ppo_clip", "parity.correction.bypass=false"],
     ["parity.correction.bypass = False: expected true or unset with preset bypass_ppo_clip"]),
    # against the algorithm's record and the loop
    (["parity.correction.rule=token_tis", "algorithm.name=rloo"],
     ["parity.correction.rule = 'token_tis': expected rules with one weight per sequence for rloo", "seq_tis"]),
    (["parity.correction.rule=token_k1", "algorithm.name=pmd_mean"], ["for pmd_mean, whose loss weighs whole"]),
    (["parity.correction.bypass=true", "algorithm.epochs=2"],
     ["parity.correction.bypass = True: expected false with algorithm.epochs x mini_batches = 2 updates per batch"]),
    (["parity.correction.bypass=true", "algorithm.mini_batches=2"], ["= 2 updates per batch"]),
    (["parity.correction.preset=bypass_ppo_clip", "algorithm.name=ppo", "algorithm.group_size=1"],
     ["parity.correction.bypass = True: expected false for ppo: its critic's values and pi_old come from"]),
    (["parity.correction.bypass=true", "rollout.max_staleness=1"],
     ["parity.correction.bypass = True: expected false with rollout.max_staleness 1"]),
    (["parity.correction.bypass=true", "parity.correction.rule=token_tis"],
     ["parity.correction.rule = 'token_tis': expected rejection rules only with parity.correction.bypass"]),
    (["parity.correction.unbiased_kl=true"],
     ["parity.correction.unbiased_kl = True: expected false with algorithm.kl_coef 0 (grpo)"]),
])
def test_refusals_name_key_value_and_expectation(sets, needles):
    with pytest.raises(RecipeError) as e:
        load(*sets)
    msg = e.value.lines()
    for needle in needles:
        assert needle in msg, f"{needle!r} not in\n{msg}"


def test_every_problem_in_one_pass():
    with pytest.raises(RecipeError) as e:
        load("parity.correction.rule=[token_tis, opsm]", "parity.correction.token_tis.cap=0.5",
             "parity.correction.opsm.low=0.5", "train.steps=0")
    assert len(e.value.problems) == 3, e.value.problems
    msg = e.value.lines()
    assert "token_tis.cap = 0.5" in msg and "opsm.low = 0.5: not an option of opsm" in msg and "train.steps = 0" in msg


def test_allowed_combinations_with_the_algorithms():
    assert load("parity.correction.rule=[seq_tis, opsm]", "algorithm.name=rloo").parity.correction.plan
    assert load("parity.correction.preset=bypass_ppo_clip_geo_rs").parity.correction.bypass
    assert load("parity.correction.unbiased_kl=true", "algorithm.kl_coef=0.04").parity.correction.unbiased_kl
    assert load("parity.correction.rule=token_tis", "algorithm.name=ppo", "algorithm.group_size=1",
                "algorithm.epochs=2").parity.correction.plan
