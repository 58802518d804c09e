"""Which policy each rule reads (``Rule.policy``) and a plan split along it: OPSM alone reads the policy being
updated; the two parts' weights multiply to the whole plan's; an importance weight cannot read the current policy."""
import dataclasses

import pytest
import torch
from correction_batch import ADV, MASK, ROLL, inputs  # this folder is on sys.path

from parity.corrections import CorrectionPlan, get_rule, rules


def test_only_opsm_reads_the_policy_being_updated():
    assert [r.name for r in rules() if r.policy == "current"] == ["opsm"]
    assert CorrectionPlan(("token_tis", "opsm")).reads_current_policy
    assert not CorrectionPlan(("token_tis", "seq_mean_k3")).reads_current_policy


def test_a_weight_rule_on_the_current_policy_is_refused():
    with pytest.raises(ValueError, match="a rule on the current policy must be a rejection"):
        dataclasses.replace(get_rule("token_tis"), policy="current")
    with pytest.raises(ValueError, match="policy must be old|current"):
        dataclasses.replace(get_rule("opsm"), policy="new")


def test_the_parts_multiply_to_the_whole_plan_and_keep_their_options():
    opsm = get_rule("opsm").options(delta=0.2)
    plan = CorrectionPlan(("token_tis", "seq_mean_k3", "opsm"), {"opsm": opsm}, batch_normalize=True)
    old, current = plan.part("old"), plan.part("current")
    assert old.rules == ("token_tis", "seq_mean_k3") and old.batch_normalize
    assert current.rules == ("opsm",) and current.options == {"opsm": opsm} and not current.batch_normalize
    x = inputs()
    whole = plan.apply(x).weights
    assert torch.equal(old.apply(x).weights * current.apply(x).weights, whole)
    assert not plan.part("current").part("old") and not CorrectionPlan().part("old")
    with pytest.raises(ValueError, match="expected 'old' or 'current'"):
        plan.part("theta")


def test_opsm_follows_the_log_probs_it_is_given():
    # row 1 (advantage -1): under pi_old d = [-2.0 - (-1.0), -1.6 - (-1.0)] = [-1.0, -0.6], mean(-d) = 0.8 > 0.1:
    # dropped; once the policy has moved to [-1.05, -0.95], mean(-d) = 0 <= 0.1: kept.
    opsm = CorrectionPlan(("opsm",))
    assert opsm.apply(inputs()).weights.tolist() == [[1, 1, 1], [0, 0, 0]]
    moved = torch.tensor([[-0.2, -1.1, -0.7], [-1.05, -0.95, 0.0]])
    assert opsm.apply(inputs(train=moved, roll=ROLL, mask=MASK, adv=ADV)).weights.tolist() == [[1, 1, 1], [1, 1, 0]]
