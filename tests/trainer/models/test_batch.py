import torch

from rollout.types import Rollouts
from trainer.models.batch import IGNORE, batch_from_rollouts, build_token_batch


def test_layout_left_pads_prompts_right_pads_completions():
    r = Rollouts(prompt_ids=[[5, 6, 7], [8]], completion_ids=[[1, 2], [3, 4, 9]],
                 rollout_logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5]], finish_reasons=["stop", "length"], group_size=1)
    b = batch_from_rollouts(r, pad_id=0)
    assert b.prompt_len == 3
    assert b.input_ids.tolist() == [[5, 6, 7, 1, 2, 0], [0, 0, 8, 3, 4, 9]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    # positions restart at each prompt's first real token, as in the engine
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 0, 0, 1, 2, 3]]
    assert b.targets.tolist() == [[1, 2, IGNORE], [3, 4, 9]]
    assert b.mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert torch.allclose(b.rollout_logprobs, torch.tensor([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]]))
    # hidden[:, P-1 : P-1+C] predicts the targets: the token at column P-1+j+1 is targets[:, j]
    for i in range(2):
        for j in range(3):
            if b.mask[i, j]:
                assert b.input_ids[i, b.prompt_len + j] == b.targets[i, j]


def test_select_trims_columns_and_keeps_alignment():
    b = build_token_batch([[5, 6, 7], [8], [9, 9]], [[1], [2, 3], [4, 4, 4, 4]], pad_id=0)
    m = b.select(slice(1, 2))  # only the short prompt with a 2-token completion
    assert m.input_ids.tolist() == [[8, 2, 3]]
    assert m.prompt_len == 1 and m.targets.tolist() == [[2, 3]] and m.position_ids.tolist() == [[0, 1, 2]]
    m2 = b.select(slice(0, 2))
    assert m2.input_ids.tolist() == [[5, 6, 7, 1, 0], [0, 0, 8, 2, 3]]
    assert m2.targets.tolist() == [[1, IGNORE], [2, 3]]


def test_empty_completion_is_all_masked():
    b = build_token_batch([[5, 6]], [[]], pad_id=0)
    assert b.mask.sum() == 0 and b.targets.tolist() == [[IGNORE]]


def test_topk_fields_are_padded_and_follow_select():
    r = Rollouts(prompt_ids=[[1, 2], [3]], completion_ids=[[5, 6, 7], [8]],
                 rollout_logprobs=[[-1.0, -2.0, -3.0], [-0.5]], finish_reasons=["length", "stop"], group_size=1,
                 topk_ids=[[[5, 9], [6, 4], [7, 3]], [[8, 2]]],
                 topk_logprobs=[[[-0.1, -2.0], [-0.2, -2.1], [-0.3, -2.2]], [[-0.4, -2.3]]])
    b = batch_from_rollouts(r, pad_id=0)
    assert b.topk_ids.shape == (2, 3, 2) and b.topk_logprobs.shape == (2, 3, 2)
    assert b.topk_ids[0].tolist() == [[5, 9], [6, 4], [7, 3]]
    assert b.topk_ids[1].tolist() == [[8, 2], [0, 0], [0, 0]]  # padding: id 0, log-prob 0, masked
    assert b.topk_logprobs[1, 1:].abs().sum() == 0
    sub = b.select(slice(1, 2))
    assert sub.topk_ids.shape == (1, 1, 2) and sub.topk_ids[0, 0].tolist() == [8, 2]
    assert batch_from_rollouts(Rollouts(prompt_ids=[[1]], completion_ids=[[5]], rollout_logprobs=[[-1.0]],
                                        finish_reasons=["stop"], group_size=1), 0).topk_ids is None


def test_context_tokens_inside_a_completion_are_read_but_not_trained():
    # A two-turn episode: sampled [1, 2], the environment's reply [7, 7] (context), sampled [3].
    r = Rollouts(prompt_ids=[[5, 6], [8]], completion_ids=[[1, 2, 7, 7, 3], [4]],
                 rollout_logprobs=[[-0.1, -0.2, 0.0, 0.0, -0.3], [-0.4]], finish_reasons=["stop", "stop"],
                 group_size=1, completion_mask=[[1, 1, 0, 0, 1], [1]])
    b = batch_from_rollouts(r, pad_id=0)
    assert b.input_ids.tolist() == [[5, 6, 1, 2, 7, 7, 3], [0, 8, 4, 0, 0, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0]]
    assert b.targets.tolist() == [[1, 2, IGNORE, IGNORE, 3], [4, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert b.mask.tolist() == [[1, 1, 0, 0, 1], [1, 0, 0, 0, 0]]
    assert torch.allclose(b.rollout_logprobs, torch.tensor([[-0.1, -0.2, 0, 0, -0.3], [-0.4, 0, 0, 0, 0]]))


def test_select_keeps_columns_up_to_the_last_sampled_token():
    # 3 sampled tokens, the last at column 4: a trim to the count of sampled tokens would cut turn 2 off.
    b = build_token_batch([[5]], [[1, 2, 7, 7, 3, 9]], pad_id=0, completion_mask=[[1, 1, 0, 0, 1, 0]])
    m = b.select(slice(0, 1))
    assert m.targets.tolist() == [[1, 2, IGNORE, IGNORE, 3]]
    assert m.input_ids.tolist() == [[5, 1, 2, 7, 7, 3]]


def test_kept_sets_follow_rows_and_columns_into_the_kernels_layout():
    from rollout.support import Support
    from rollout.types import Rollouts
    from trainer.models.batch import batch_from_rollouts

    r = Rollouts(prompt_ids=[[1, 2], [3]], completion_ids=[[5, 0, 4], [7]],
                 rollout_logprobs=[[-0.1, -0.2, -0.3], [-0.4]], finish_reasons=["length", "stop"], group_size=1,
                 support=[Support.from_lists([[5, 6], [0], [4, 8, 9]]), Support.from_lists([[7, 1]])])
    batch = batch_from_rollouts(r, 0)
    offsets, ids = batch.kernel_support()
    assert offsets.tolist() == [0, 2, 3, 6, 8, 8, 8]  # [2 rows x 3 columns]; row 1 past its one token: empty
    assert ids.tolist() == [5, 6, 0, 4, 8, 9, 7, 1]
    micro = batch.select(torch.tensor([1]))
    assert micro.targets.shape == (1, 1) and [s.to_lists() for s in micro.support] == [[[7, 1]]]
    assert micro.kernel_support()[1].tolist() == [7, 1]
    assert batch_from_rollouts(Rollouts(prompt_ids=[[1]], completion_ids=[[5]], rollout_logprobs=[[-0.1]],
                                        finish_reasons=["stop"], group_size=1), 0).kernel_support() is None
