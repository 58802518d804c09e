"""The off-policy objectives (trainer/off_policy/): the decoupled weight by hand, and the decoupled loss
through GRPO's by hand in float64 (AReaL, arXiv 2505.24298); M2PO's mask by hand and through GRPO's loss
(arXiv 2510.01161)."""
import math

import pytest
import torch

from trainer.algorithms import GRPOConfig, LossInputs, LossNormalizer, grpo_loss
from trainer.off_policy import OFF_POLICY
from trainer.off_policy.decoupled import decoupled_weights
from trainer.off_policy.m2po import m2po_mask

F64 = torch.float64
LN2 = math.log(2.0)


def test_the_records_say_where_the_clip_is_anchored():
    assert OFF_POLICY["behaviour_clip"].anchor == "behaviour" and OFF_POLICY["behaviour_clip"].weight is None
    assert OFF_POLICY["decoupled"].anchor == "proximal" and OFF_POLICY["decoupled"].weight is decoupled_weights
    assert OFF_POLICY["m2po"].anchor == "behaviour" and OFF_POLICY["m2po"].weight is m2po_mask
    assert OFF_POLICY["m2po"].parameter == "m2_threshold" and OFF_POLICY["decoupled"].parameter == "behaviour_weight_cap"


def test_decoupled_weights_by_hand():
    # pi_prox / pi_behaviour per token: 2, 1/2, 8 (over the cap 5: left out), and a padded position
    prox = torch.tensor([[LN2, 0.0], [3 * LN2, 0.0]], dtype=F64)
    behaviour = torch.tensor([[0.0, LN2], [0.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    w, m = decoupled_weights(prox, behaviour, mask, 5.0)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5], [0.0, 0.0]]), rtol=1e-6, atol=0)
    assert w.dtype == torch.float32 and not w.requires_grad
    assert m["staleness/decoupled_weight_mean"] == pytest.approx(2.5 / 3, rel=1e-6)
    assert m["staleness/decoupled_filtered_frac"] == pytest.approx(1 / 3)
    w8, m8 = decoupled_weights(prox, behaviour, mask, 8.0)  # the cap is inclusive (AReaL keeps w <= cap)
    assert w8[1, 0] == pytest.approx(8.0) and m8["staleness/decoupled_filtered_frac"] == 0.0
    with pytest.raises(ValueError, match="shapes"):
        decoupled_weights(prox, behaviour[:, :1], mask, 5.0)


def test_the_decoupled_loss_through_grpo_by_hand():
    """One sequence of three tokens, A = +1, eps 0.2, ratios against pi_prox (not pi_behaviour):
    r = pi_theta / pi_prox = 1.1 (inside the clip), 1.5 (clipped at 1.2), 0.5 (A > 0: min takes r, unclipped);
    w = pi_prox / pi_behaviour = 2, 1, 0.5. Token mean: l = -(2 * 1.1 + 1 * 1.2 + 0.5 * 0.5) / 3;
    d l / d log pi_theta = -(w * r) / 3 where r is unclipped (tokens 1 and 3), 0 where clipped (token 2)."""
    prox = torch.log(torch.tensor([[0.4, 0.2, 0.6]], dtype=F64))
    behaviour = prox - torch.log(torch.tensor([[2.0, 1.0, 0.5]], dtype=F64))
    lp = (prox + torch.log(torch.tensor([[1.1, 1.5, 0.5]], dtype=F64))).requires_grad_(True)
    mask = torch.ones(1, 3, dtype=F64)
    w, _ = decoupled_weights(prox, behaviour, mask, 5.0)
    out = grpo_loss(LossInputs(logprobs=lp, old_logprobs=prox, advantages=torch.ones(1, 3, dtype=F64), mask=mask,
                               is_weights=w.to(F64), normalizer=LossNormalizer(num_tokens=3.0, num_seqs=1.0, max_len=3)),
                    GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.2, loss_agg="token_mean"))
    assert out.loss.item() == pytest.approx(-(2 * 1.1 + 1 * 1.2 + 0.5 * 0.5) / 3, rel=1e-6)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-2 * 1.1 / 3, 0.0, -0.5 * 0.5 / 3]], dtype=F64),
                               rtol=1e-6, atol=1e-9)


def test_m2po_masks_the_largest_squared_log_weights_until_the_mean_is_below_the_threshold():
    # (log pi_prox - log pi_behaviour)^2 = 0.25, 0.09, 0.01, 0.0 and a padded position:
    # the mean of all four is 0.0875; without the 0.25 it is 0.10 / 3 = 0.0333 < 0.04: one token masked
    d = torch.tensor([[0.5, -0.3], [0.1, 0.0], [7.0, 0.0]], dtype=F64)
    behaviour = torch.log(torch.tensor([[0.3, 0.4], [0.2, 0.5], [0.1, 0.6]], dtype=F64))
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [0.0, 0.0]], dtype=F64)
    keep, m = m2po_mask(behaviour + d, behaviour, mask, 0.04)
    torch.testing.assert_close(keep, torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]), rtol=0, atol=0)
    assert keep.dtype == torch.float32 and not keep.requires_grad
    assert m["staleness/m2po_m2"] == pytest.approx(0.35 / 4)
    assert m["staleness/m2po_m2_kept"] == pytest.approx(0.10 / 3)
    assert m["staleness/m2po_masked_frac"] == pytest.approx(1 / 4)
    # tau 0.02: the 0.09 goes too (0.01 / 2 = 0.005); tau 0.1: nothing (0.0875 < 0.1); tau 1e-9: all but one kept
    assert m2po_mask(behaviour + d, behaviour, mask, 0.02)[0].sum() == 2
    assert m2po_mask(behaviour + d, behaviour, mask, 0.1)[0].sum() == 4
    keep_one, m_one = m2po_mask(behaviour + d, behaviour, mask, 1e-9)
    assert keep_one.sum() == 1 and keep_one[1, 1] == 1 and m_one["staleness/m2po_masked_frac"] == 0.75
    with pytest.raises(ValueError, match="shapes"):
        m2po_mask(behaviour, behaviour[:, :1], mask, 0.04)


def test_m2po_on_policy_keeps_every_token_and_ties_mask_in_order():
    lp = torch.log(torch.tensor([[0.3, 0.4, 0.5]], dtype=F64))
    keep, m = m2po_mask(lp, lp, torch.ones(1, 3, dtype=F64), 0.04)
    assert keep.sum() == 3 and m["staleness/m2po_m2"] == 0.0 and m["staleness/m2po_masked_frac"] == 0.0
    # three equal squares 0.0625 (exact in binary): no tail mean is below 0.04, so all but one are masked, in order
    b = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    keep, _ = m2po_mask(b + 0.25, b, torch.ones(1, 3, dtype=F64), 0.04)
    torch.testing.assert_close(keep, torch.tensor([[0.0, 0.0, 1.0]]), rtol=0, atol=0)


def test_the_m2po_loss_through_grpo_by_hand():
    """One sequence of three tokens, A = +1, eps 0.2, ratios against pi_behaviour:
    r = 1.1, 1.5 (clipped at 1.2), 0.9; the first token's (log pi_prox - log pi_behaviour)^2 = 1.0 is masked
    (mean of all three (1 + 0.0004 + 0.0001) / 3 > 0.04; of the last two 0.00025). The masked token still counts in the
    normaliser: l = -(0 * 1.1 + 1.2 + 0.9) / 3; d l / d log pi_theta = -r / 3 where kept and unclipped."""
    behaviour = torch.log(torch.tensor([[0.4, 0.2, 0.6]], dtype=F64))
    prox = behaviour + torch.tensor([[1.0, 0.02, -0.01]], dtype=F64)
    lp = (behaviour + torch.log(torch.tensor([[1.1, 1.5, 0.9]], dtype=F64))).requires_grad_(True)
    mask = torch.ones(1, 3, dtype=F64)
    keep, _ = m2po_mask(prox, behaviour, mask, 0.04)
    out = grpo_loss(LossInputs(logprobs=lp, old_logprobs=behaviour, advantages=torch.ones(1, 3, dtype=F64),
                               mask=mask, is_weights=keep.to(F64),
                               normalizer=LossNormalizer(num_tokens=3.0, num_seqs=1.0, max_len=3)),
                    GRPOConfig(clip_eps_low=0.2, clip_eps_high=0.2, loss_agg="token_mean"))
    assert out.loss.item() == pytest.approx(-(1.2 + 0.9) / 3, rel=1e-9)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0, -0.9 / 3]], dtype=F64), rtol=1e-9, atol=1e-12)
