import pytest
import torch

from trainer.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    AdvantageInputs,
    LossInputs,
    LossNormalizer,
    Registry,
    grpo_advantages,
    grpo_loss,
)


def test_register_and_get():
    reg = Registry("thing")

    @reg.register("a")
    def a():
        return 1

    assert reg.get("a") is a and "a" in reg and "b" not in reg
    assert reg.names() == ["a"]


def test_duplicate_name_is_refused_and_first_registration_kept():
    reg = Registry("thing")

    @reg.register("a")
    def first():
        return 1

    with pytest.raises(ValueError, match="thing registry: name 'a' is already registered"):

        @reg.register("a")
        def second():
            return 2

    assert reg.get("a") is first


def test_unknown_name_lists_valid_names():
    reg = Registry("policy loss")
    reg.register("zeta")(lambda: None)
    reg.register("alpha")(lambda: None)
    with pytest.raises(ValueError, match="unknown policy loss 'gpro'; valid names: alpha, zeta"):
        reg.get("gpro")
    with pytest.raises(ValueError, match=r"valid names: \(none registered\)"):
        Registry("x").get("y")


def test_bad_registrations():
    reg = Registry("thing")
    with pytest.raises(ValueError, match="non-empty string"):
        reg.register("")
    with pytest.raises(ValueError, match="must register a callable"):
        reg.register("n")(42)


def test_builtin_registries_hold_grpo():
    assert ADVANTAGES.get("grpo") is grpo_advantages
    assert POLICY_LOSSES.get("grpo") is grpo_loss


def test_advantage_inputs_validation():
    mask = torch.ones(4, 3)
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\), expected \(4,\)"):
        AdvantageInputs(rewards=torch.zeros(3), mask=mask, group_size=2)
    with pytest.raises(ValueError, match="4 sequences is not a multiple of group_size=3"):
        AdvantageInputs(rewards=torch.zeros(4), mask=mask, group_size=3)
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        AdvantageInputs(rewards=torch.zeros(4), mask=mask, group_size=0)
    with pytest.raises(ValueError, match=r"values has shape \(4, 2\), expected \(4, 3\)"):
        AdvantageInputs(rewards=torch.zeros(4), mask=mask, group_size=2, values=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="mask must be 2-D"):
        AdvantageInputs(rewards=torch.zeros(4), mask=torch.ones(4), group_size=2)


def test_loss_inputs_validation():
    x = torch.zeros(2, 3)
    norm = LossNormalizer(num_tokens=6.0, num_seqs=2.0, max_len=3)
    with pytest.raises(ValueError, match=r"LossInputs.advantages has shape \(2, 2\), expected \(2, 3\)"):
        LossInputs(logprobs=x, old_logprobs=x, advantages=torch.zeros(2, 2), mask=x, normalizer=norm)
    with pytest.raises(ValueError, match=r"LossInputs.is_weights has shape \(3,\)"):
        LossInputs(logprobs=x, old_logprobs=x, advantages=x, mask=x, normalizer=norm, is_weights=torch.ones(3))
    with pytest.raises(TypeError, match="normalizer must be a LossNormalizer, got float"):
        LossInputs(logprobs=x, old_logprobs=x, advantages=x, mask=x, normalizer=6.0)
    with pytest.raises(TypeError, match="ref_logprobs must be a torch.Tensor, got list"):
        LossInputs(logprobs=x, old_logprobs=x, advantages=x, mask=x, normalizer=norm, ref_logprobs=[0.0])
