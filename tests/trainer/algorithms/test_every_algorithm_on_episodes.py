"""Every registered algorithm trains on a multi-turn episode exactly as on its sampled tokens alone.

An episode's completion stream holds the environment's replies between the turns (mask 0, trainer/sampling/episodes.py).
Advantages (GRPO family and PMD per episode; PPO's GAE, which skips masked positions, so a reply is no step of the
MDP: the value after a turn's last token is the next turn's first) and losses must see only the sampled tokens: the
same episode with its replies cut out gives the same advantages, the same loss and the same gradients, and the
reply positions -- filled with NaN here -- get no gradient.
"""
import pytest
import torch

from trainer.algorithms import ALGORITHMS, AdvantageInputs
from trainer.algorithms.aggregation import LossNormalizer
from trainer.algorithms.registry import LossInputs

GROUP = 2
# 1 sampled, 0 a reply (context) or padding after the end; rows have 2 or 3 turns, different lengths
GAPPED = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0, 0],
                       [1, 0, 0, 1, 0, 1, 1, 0, 0],
                       [1, 1, 1, 0, 1, 0, 0, 0, 0],
                       [1, 0, 1, 1, 1, 1, 0, 1, 1]])
MAX_LEN = 12


def compact(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sampled positions of each row moved to its front (what the episode would be without replies)."""
    out = torch.zeros(mask.shape[0], int(mask.sum(1).max()), dtype=x.dtype)
    for i in range(mask.shape[0]):
        kept = x[i][mask[i].bool()]
        out[i, :kept.numel()] = kept
    return out


def spread(x: torch.Tensor, mask: torch.Tensor, fill: float) -> torch.Tensor:
    """Inverse of ``compact``: the row's values at the sampled positions, ``fill`` everywhere else."""
    out = torch.full(mask.shape, fill, dtype=x.dtype)
    for i in range(mask.shape[0]):
        n = int(mask[i].sum())
        out[i][mask[i].bool()] = x[i, :n]
    return out


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_an_episode_trains_as_its_sampled_tokens_alone(name):
    record = ALGORITHMS.get(name)
    options = record.options()
    g = torch.Generator().manual_seed(0)
    c_mask = compact(GAPPED, GAPPED)
    s, c = c_mask.shape

    def rand(scale=1.0):
        return (torch.randn(s, c, generator=g, dtype=torch.float64) * scale) * c_mask

    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0], dtype=torch.float64)
    values, token_rewards = rand(), rand(0.1)
    old_lp, ref_lp = -rand().abs() - 0.5, -rand().abs() - 0.5
    old_values, returns, entropy = rand(), rand(), rand().abs()

    def advantages(mask, lay):
        return record.advantage(AdvantageInputs(rewards=rewards, mask=mask, group_size=GROUP, values=lay(values),
                                                token_rewards=lay(token_rewards)), options)

    adv_c = advantages(c_mask, lambda x: x)
    adv_g = advantages(GAPPED, lambda x: spread(x, GAPPED, float("nan")))
    torch.testing.assert_close(compact(adv_g, GAPPED), adv_c, rtol=0, atol=1e-12)

    new_lp = old_lp + rand(0.1)  # ratios away from 1, inside and outside the clip range

    def loss(mask, lay, adv):
        lp = lay(new_lp).clone().requires_grad_(True)
        ent = lay(entropy).clone().requires_grad_(True)
        val = lay(values).clone().requires_grad_(True)
        out = record.loss(LossInputs(logprobs=lp, old_logprobs=lay(old_lp), advantages=adv, mask=mask,
                                     normalizer=LossNormalizer.from_mask(mask, MAX_LEN), ref_logprobs=lay(ref_lp),
                                     values=val, old_values=lay(old_values), returns=lay(returns), entropy=ent),
                          options)
        out.loss.backward()
        return out.loss, lp.grad, val.grad

    loss_c, grad_c, vgrad_c = loss(c_mask, lambda x: x, adv_c)
    # replies and padding hold NaN: a loss that read them would be NaN
    loss_g, grad_g, vgrad_g = loss(GAPPED, lambda x: spread(x, GAPPED, float("nan")), adv_g)
    assert torch.isfinite(loss_g)
    torch.testing.assert_close(loss_g, loss_c, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(compact(grad_g, GAPPED), grad_c, rtol=1e-12, atol=1e-12)
    assert not grad_g[GAPPED == 0].any(), "a reply or padding position got a gradient"
    if record.critic:
        torch.testing.assert_close(compact(vgrad_g, GAPPED), vgrad_c, rtol=1e-12, atol=1e-12)
        assert not vgrad_g[GAPPED == 0].any()
