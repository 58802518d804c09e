"""Routes as the rollout containers carry them (rollout/routes.py), and the V1-runner capture's bookkeeping
(rollout/vllm_plugins/route_capture.py's RouteRecorder) without an engine."""
import pytest
import torch

from rollout.routes import NO_ROUTE, decode_routes, encode_routes, extend_routes
from rollout.types import Rollouts
from rollout.vllm_plugins.route_capture import RouteRecorder


def r(rows):
    return torch.tensor(rows, dtype=torch.int16).view(len(rows), 1, -1)


def test_a_later_turn_fills_only_the_positions_the_earlier_ones_did_not_route():
    earlier = r([[0, 1], [2, 3], [NO_ROUTE, NO_ROUTE]])  # its last sampled token was never fed back
    later = r([[7, 7], [7, 7], [4, 5], [6, 0], [NO_ROUTE, NO_ROUTE]])
    assert extend_routes(earlier, later).view(5, 2).tolist() == [[0, 1], [2, 3], [4, 5], [6, 0], [-1, -1]]
    assert torch.equal(extend_routes(None, later), later)
    with pytest.raises(ValueError, match="do not extend"):
        extend_routes(later, earlier)


def test_routes_cross_the_wire_unchanged_and_garbage_is_refused_by_name():
    routes = torch.randint(-1, 200, (9, 3, 4), dtype=torch.int16)
    assert torch.equal(decode_routes(encode_routes(routes), "x"), routes)
    with pytest.raises(ValueError, match="server answer 3: routes are not"):
        decode_routes({"shape": [2, 2, 2], "int16": "not base64!"}, "server answer 3")
    with pytest.raises(ValueError, match=r"expected \[tokens, MoE layers, top_k\]"):
        decode_routes(encode_routes(routes.view(27, 4)), "x")


def rollouts(routes):
    return Rollouts(prompt_ids=[[1, 2], [3]], completion_ids=[[4], [5, 6]], rollout_logprobs=[[0.0], [0.0, 0.0]],
                    finish_reasons=["stop", "stop"], group_size=1, routes=routes)


def test_rollouts_check_every_samples_routes_against_its_tokens():
    ok = [torch.zeros(3, 2, 2, dtype=torch.int16), torch.zeros(3, 2, 2, dtype=torch.int16)]
    both = rollouts(ok)
    assert [len(x) for x in both.take_groups([1]).routes] == [3]
    assert len(Rollouts.concat([both, both]).routes) == 4
    with pytest.raises(ValueError, match=r"sample 1's routes have shape \(2, 2, 2\), expected \[3 tokens"):
        rollouts([ok[0], torch.zeros(2, 2, 2, dtype=torch.int16)])
    with pytest.raises(ValueError, match="sample 0's routes must be an int16 tensor"):
        rollouts([ok[0].long(), ok[1]])
    with pytest.raises(ValueError, match="some parts carry routes and others none"):
        Rollouts.concat([both, rollouts([])])


def test_the_recorder_files_each_rows_ids_under_its_request_and_position():
    rec = RouteRecorder(layer_ids=[3, 1], top_k=2, num_experts=8)  # vLLM layer ids: MoE layers 1 and 3
    # step 1: request a prefills 3 tokens, request b 2; step 2: both decode one token
    rec.begin(["a-1234abcd", "b-5678abcd"], [0, 3, 5], torch.tensor([0, 1, 2, 0, 1, 99]))  # a padded row
    rec.capture(1, torch.tensor([[0, 1], [1, 2], [2, 3], [3, 4], [4, 5], [7, 7]], dtype=torch.int32))
    rec.capture(3, torch.tensor([[5, 6], [6, 7], [7, 0], [0, 1], [1, 2], [7, 7]], dtype=torch.int32))
    rec.end()
    rec.begin(["b-5678abcd", "a-1234abcd"], [0, 1, 2], torch.tensor([2, 3]))  # the batch order may change
    rec.capture(1, torch.tensor([[6, 6], [5, 5]], dtype=torch.int32))
    rec.capture(3, torch.tensor([[1, 1], [2, 2]], dtype=torch.int32))
    rec.end()
    rec.capture(1, torch.tensor([[0, 0]]))  # a forward outside any step (warm-up): ignored
    a, b, none = rec.take([("a", 5), ("b", 3), ("c", 2)])  # the caller's ids; vLLM suffixed them
    assert a[:, 0].tolist() == [[0, 1], [1, 2], [2, 3], [5, 5], [-1, -1]]
    assert a[:, 1].tolist() == [[5, 6], [6, 7], [7, 0], [2, 2], [-1, -1]]
    assert b[:, 0].tolist() == [[3, 4], [4, 5], [6, 6]] and b.dtype == torch.int16
    assert none.eq(NO_ROUTE).all()  # a request the engine never saw
    assert rec.take([("a", 2)])[0].eq(NO_ROUTE).all() and rec.records == []  # taken once, then forgotten


def test_a_servers_route_prefix_and_the_engines_suffix_name_the_same_request():
    rec = RouteRecorder(layer_ids=[0], top_k=1, num_experts=4)
    rec.begin(["generate-tokens-parityrl-ab12-1-0f0f0f0f", "generate-tokens-parityrl-ab12-11-1e1e1e1e"], [0, 1, 2],
              torch.tensor([0, 0]))
    rec.capture(0, torch.tensor([[1], [2]]))
    rec.end()
    one, eleven = rec.take([("parityrl-ab12-1", 1), ("parityrl-ab12-11", 1)])
    assert one.item() == 1 and eleven.item() == 2
