"""The kept-set recorder of ``rollout.vllm_plugins.support_capture``, fed by hand: which rows it keeps (a server keeps
only truncated requests'), and how ``take`` assembles each request's sets in order."""
from types import SimpleNamespace

import pytest
import torch

from rollout.vllm_plugins.support_capture import SupportRecorder, truncates

NEG = float("-inf")


def _row(*finite: int, vocab: int = 6) -> list[float]:
    return [-1.0 if i in finite else NEG for i in range(vocab)]


def test_a_server_records_only_the_rows_of_truncated_requests_and_takes_them_by_id():
    rec = SupportRecorder()
    truncated = {"generate-tokens-a-1234abcd", "generate-tokens-c-5678efgh"}
    rec.select, rec.active = truncated.__contains__, True
    # step 1: a (truncated), b (not: all finite), c (truncated); step 2: a and b (c finished)
    rec.capture(["generate-tokens-a-1234abcd", "generate-tokens-b-00000000", "generate-tokens-c-5678efgh"],
                torch.tensor([_row(1, 2), [-1.0] * 6, _row(4)]))
    rec.capture(["generate-tokens-a-1234abcd", "generate-tokens-b-00000000"], torch.tensor([_row(0, 3, 5), [-1.0] * 6]))
    rec.capture(["generate-tokens-b-00000000"], None)  # a step of untruncated requests alone: nothing asked
    with pytest.raises(RuntimeError, match="none captured for request 'b'"):  # b was never recorded
        rec.take([("b", 2)])
    c, a = rec.take([("c", 1), ("a", 2)])
    assert a.ids.tolist() == [1, 2, 0, 3, 5] and a.offsets.tolist() == [0, 2, 5]
    assert c.ids.tolist() == [4] and c.offsets.tolist() == [0, 1]
    with pytest.raises(RuntimeError, match="no processed log-probs"):  # a truncated request without them
        rec.capture(["generate-tokens-c-5678efgh"], None)


def test_a_request_with_another_number_of_steps_than_its_length_is_refused():
    rec = SupportRecorder()
    rec.active = True
    rec.capture(["x-1"], torch.tensor([_row(2)]))
    with pytest.raises(RuntimeError, match="sampled 2 tokens but 1 steps were captured"):
        rec.take([("x", 2)])


def test_which_sampling_parameters_truncate():
    def p(top_p=1.0, top_k=0, min_p=0.0):
        return SimpleNamespace(top_p=top_p, top_k=top_k, min_p=min_p)

    assert not truncates(p(), 100) and not truncates(None, 100)
    assert not truncates(p(top_k=100), 100) and not truncates(p(top_k=-1), 100)  # k >= vocab, -1: off in vLLM
    assert truncates(p(top_p=0.9), 100) and truncates(p(top_k=20), 100) and truncates(p(min_p=0.05), 100)
