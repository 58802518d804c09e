from types import SimpleNamespace

import pytest
import torch

from trainer.algorithms import (
    ADVANTAGES,
    POLICY_LOSSES,
    AdvantageInputs,
    GRPOConfig,
    LossInputs,
    LossNormalizer,
    dr_grpo_advantages,
    dr_grpo_loss,
)

F64 = torch.float64
NAN = float("nan")


def test_registered():
    assert ADVANTAGES.get("dr_grpo") is dr_grpo_advantages and POLICY_LOSSES.get("dr_grpo") is dr_grpo_loss


def test_advantages_never_divide_by_the_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [1, 0], [0, 0]])
    # cfg asks for GRPO's std scaling; Dr. GRPO ignores it: r - mean only
    # [1,0,0] -> [2/3, -1/3, -1/3]; [3,1,2] -> [1, -1, 0]
    adv = dr_grpo_advantages(AdvantageInputs(rewards, mask, 3), GRPOConfig(scale_rewards=True, eps=1e-6))
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0])[:, None] * mask)


def test_loss_is_grpo_with_the_constant_length_normaliser():
    # rho = 1 (lp == old): per-token loss -A; rows [-1,-2,-3] and [-4,-5]; max_len 4, G = 2:
    # (-6/4 + -9/4) / 2 = -1.875 although cfg.loss_agg says token_mean (which would give -3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, NAN]], dtype=F64)
    lp = old.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]], dtype=F64)
    batch = LossInputs(lp, old, adv, mask, LossNormalizer.from_mask(mask, max_len=4))
    out = dr_grpo_loss(batch, GRPOConfig(loss_agg="token_mean"))
    assert out.loss.item() == pytest.approx(-1.875)
    assert out.metrics["train/pg_loss"] == pytest.approx(-1.875)
    out.loss.backward()
    # -A / (max_len 4 * 2 sequences): the same weight for every token of every length
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.125, -0.25, -0.375], [-0.5, -0.625, 0.0]], dtype=F64))


def test_reads_only_the_clip_and_kl_settings():
    # A cfg without scale_rewards / eps / loss_agg works: those are fixed by Dr. GRPO's definition.
    cfg = SimpleNamespace(clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.0)
    mask = torch.ones(2, 1)
    adv = dr_grpo_advantages(AdvantageInputs(torch.tensor([1.0, 0.0]), mask, 2), cfg)
    torch.testing.assert_close(adv, torch.tensor([[0.5], [-0.5]]))
    lp = torch.zeros(2, 1, requires_grad=True)
    out = dr_grpo_loss(LossInputs(lp, torch.zeros(2, 1), adv, mask, LossNormalizer.from_mask(mask, max_len=2)), cfg)
    # per-token -A = [-0.5, 0.5] -> (-0.5/2 + 0.5/2) / 2 = 0
    assert out.loss.item() == pytest.approx(0.0)
    with pytest.raises(AttributeError, match="clip_eps_low"):
        dr_grpo_loss(LossInputs(lp, torch.zeros(2, 1), adv, mask, LossNormalizer.from_mask(mask, max_len=2)),
                     SimpleNamespace(kl_coef=0.0))
