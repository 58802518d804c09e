"""rollout.types: the Rollouts container refuses inconsistent top-k fields and completion masks."""
from dataclasses import replace

import pytest

from rollout.types import Rollouts


def _rollouts(**kw):
    base = dict(prompt_ids=[[1], [1]], completion_ids=[[5, 6], [7]], rollout_logprobs=[[-1.0, -2.0], [-0.5]],
                finish_reasons=["length", "stop"], group_size=2)
    return Rollouts(**{**base, **kw})


def test_topk_fields_round_trip():
    r = _rollouts(topk_ids=[[[5, 9], [6, 3]], [[7, 8]]], topk_logprobs=[[[-0.1, -2.0], [-0.3, -1.0]], [[-0.2, -3.0]]])
    assert r.topk == 2
    assert _rollouts().topk == 0


@pytest.mark.parametrize("ids, lps, match", [
    ([[[5, 9], [6, 3]]], [[[-0.1, -2.0], [-0.3, -1.0]]], "expected 2"),  # one sample missing
    ([[[5, 9]], [[7, 8]]], [[[-0.1, -2.0]], [[-0.2, -3.0]]], "2 completion tokens but 1 top-k"),
    ([[[5, 9], [6]], [[7, 8]]], [[[-0.1, -2.0], [-0.3]], [[-0.2, -3.0]]], "k = 2"),
])
def test_inconsistent_topk_is_refused(ids, lps, match):
    with pytest.raises(ValueError, match=match):
        _rollouts(topk_ids=ids, topk_logprobs=lps)


def _episodes(mask):
    return Rollouts(prompt_ids=[[1], [1]], completion_ids=[[2, 3, 4], [5]], rollout_logprobs=[[-1.0, 0.0, -1.0], [-1.0]],
                    finish_reasons=["stop", "stop"], group_size=1, completion_mask=mask)


def test_completion_mask_is_checked_and_counts_sampled_tokens():
    r = _episodes([[1, 0, 1], [1]])
    assert r.num_sampled_tokens == 3 and r.num_completion_tokens == 4
    assert r.sampled_mask(0) == [1, 0, 1]
    for bad in ([[1, 0], [1]], [[1, 2, 1], [1]], [[1, 0, 1]]):
        with pytest.raises(ValueError, match="completion_mask"):
            _episodes(bad)


def test_completion_mask_follows_take_groups_and_concat():
    r = _episodes([[1, 0, 1], [1]])
    assert r.take_groups([1, 0]).completion_mask == [[1], [1, 0, 1]]
    single = Rollouts(prompt_ids=[[1]], completion_ids=[[6, 7]], rollout_logprobs=[[-1.0, -1.0]],
                      finish_reasons=["stop"], group_size=1)
    assert single.sampled_mask(0) == [1, 1] and single.num_sampled_tokens == 2
    joined = Rollouts.concat([single, r])
    assert joined.completion_mask == [[1, 1], [1, 0, 1], [1]]
    assert Rollouts.concat([single, single]).completion_mask == []


def test_images_follow_take_groups_and_concat_and_are_one_list_per_sample():
    from rollout.types import ImageInput

    a, b = ImageInput("aa", (3, 56, 56), "float32", 2, 7), ImageInput("bb", (3, 56, 56), "float32", 2, 7)
    r = _episodes(None)
    with_images = Rollouts(prompt_ids=[[1], [1]], completion_ids=[[2], [5]], rollout_logprobs=[[-1.0], [-1.0]],
                           finish_reasons=["stop", "stop"], group_size=1, images=[[a], [b, a]])
    assert with_images.take_groups([1]).images == [[b, a]]
    text_only = replace(with_images, images=[[], []])
    assert Rollouts.concat([with_images, text_only]).images == [[a], [b, a], [], []]
    with pytest.raises(ValueError, match="some parts carry images and others none"):
        Rollouts.concat([with_images, r])
    with pytest.raises(ValueError, match="Rollouts.images has 1 samples, expected 2"):
        replace(with_images, images=[[a]])
