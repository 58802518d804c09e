"""rollout.support: a truncated sampler's kept sets per position, and how Rollouts carry them."""
import pytest
import torch

from rollout.support import Support, decode_supports, encode_supports
from rollout.types import Rollouts


def test_csr_round_trip_slices_and_concatenation():
    s = Support.from_lists([[3, 5], [], [1, 2, 7]])
    assert len(s) == 3 and s.sizes.tolist() == [2, 0, 3] and s.offsets.tolist() == [0, 2, 2, 5]
    assert s.to_lists() == [[3, 5], [], [1, 2, 7]]
    assert s.positions(1, 3).to_lists() == [[], [1, 2, 7]]
    both = Support.concat([s, Support.empty(2), Support.from_lists([[4]])])
    assert both.to_lists() == [[3, 5], [], [1, 2, 7], [], [], [4]]
    assert s.mask(8).nonzero().tolist() == [[0, 3], [0, 5], [2, 1], [2, 2], [2, 7]]
    again = decode_supports(encode_supports([s, Support.empty(0)]))
    assert again[0].to_lists() == s.to_lists() and len(again[1]) == 0


def test_holds_names_the_positions_whose_token_is_outside_its_set():
    s = Support.from_lists([[3, 5], [0], [1, 2, 7]])
    assert s.holds([5, 0, 7]) == [] and s.holds([4, 0, 2]) == [0]
    assert s.holds([5, 9, 6], sampled=[1, 0, 0]) == []  # context positions are not checked
    with pytest.raises(ValueError, match="offsets"):
        Support(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 3]))


def _rollouts(support):
    return Rollouts(prompt_ids=[[1], [1]], completion_ids=[[5, 0], [7]], rollout_logprobs=[[-0.1, -0.2], [-0.3]],
                    finish_reasons=["stop", "stop"], group_size=1, support=support)


def test_rollouts_refuse_a_token_outside_its_set_and_carry_sets_through_groups():
    ok = [Support.from_lists([[3, 5], [0, 1]]), Support.from_lists([[7]])]
    r = _rollouts(ok)
    assert r.take_groups([1]).support[0].to_lists() == [[7]]
    assert len(Rollouts.concat([r, r]).support) == 4
    with pytest.raises(ValueError, match="not in the set"):
        _rollouts([Support.from_lists([[3, 5], [1]]), Support.from_lists([[7]])])
    with pytest.raises(ValueError, match="kept sets"):
        _rollouts([Support.from_lists([[5]]), Support.from_lists([[7]])])
    plain = _rollouts([])
    with pytest.raises(ValueError, match="support"):
        Rollouts.concat([r, plain])
