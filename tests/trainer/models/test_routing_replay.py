"""Rollout routing replay on the Hugging Face MoE families (trainer/models/routing_replay.py) and the routing parity
metrics (parity/routing.py). Tiny random models at std 0.2, so routers have near-ties and a wrong gather shows."""
import copy
import math
from dataclasses import replace

import pytest
import torch
import transformers

from parity.routing import routing_metrics, routing_stats
from rollout.hf_routes import RouterTap
from rollout.routes import NO_ROUTE
from rollout.types import Rollouts
from trainer.measurement.scoring import forward, score_batch
from trainer.models.batch import batch_from_rollouts
from trainer.models.routing_replay import PAD, RoutingReplay, UnsupportedRouting, attached_replay, moe_routers

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
FAMILIES = {
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
                                         norm_topk_prob=False)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                         decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
}


def build(family: str):
    cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, cls)(**COMMON, **extra),
                                                          dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.2)
    return model


IDS = torch.tensor([[5, 9, 3, 17, 40, 2, 11], [8, 8, 1, 30, 6, 60, 12]])


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replaying_the_routers_own_choice_is_the_model_bit_for_bit(family):
    model = build(family)
    reference = model(IDS).logits
    replay = RoutingReplay(model)
    assert replay.num_layers == 2
    inert = model(IDS).logits  # installed, no routes: the model's own forward
    own = torch.stack(replay.own, 1).view(2, 7, 2, -1)  # [batch, positions, layers, top_k]
    replay.set_routes(own)
    replayed = model(IDS).logits
    assert torch.equal(inert, reference) and torch.equal(replayed, reference)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_engines_selection_is_used_and_the_router_still_learns(family):
    model = build(family)
    replay = RoutingReplay(model)
    reference = model(IDS).logits.detach()
    own = torch.stack(replay.own, 1).view(2, 7, 2, -1)
    engine = (own + 1) % replay.num_experts  # another selection for every token and layer
    taken = {}
    for layer, router in enumerate(replay.routers):
        router.register_forward_hook(lambda m, args, out, layer=layer: taken.__setitem__(layer, out[2]))
    replay.set_routes(engine)
    out = model(IDS).logits
    for layer in range(2):  # the selection the experts ran with is the engine's, on every token
        assert torch.equal(taken[layer].view(2, 7, -1), engine[:, :, layer])
    assert not torch.allclose(out.detach(), reference)  # and it changed the output
    out.float().pow(2).mean().backward()
    for router in replay.routers:  # the gate weights come from the live softmax: the router gets a gradient
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    assert replay.unrouted == 0


def test_replayed_indices_are_the_routes_and_missing_routes_use_the_router():
    model = build("qwen3_moe")
    replay = RoutingReplay(model)
    hidden = torch.randn(3, COMMON["hidden_size"])
    router = replay.routers[1]
    logits, _, own = router(hidden)
    routes = torch.full((1, 3, 2, 2), -1, dtype=torch.long)
    routes[0, 0, 1] = torch.tensor([6, 7])
    routes[0, 2, 1] = torch.tensor([0, 3])
    replay.set_routes(routes)
    _, weights, taken = router(hidden)
    assert taken[0].tolist() == [6, 7] and taken[2].tolist() == [0, 3] and torch.equal(taken[1], own[1])
    assert replay.unrouted == 1  # token 1 had no route in this layer: the router chose, and it is counted
    probs = torch.softmax(logits.float(), -1)
    expected = probs[0, [6, 7]] / probs[0, [6, 7]].sum()  # Qwen3-MoE's norm_topk_prob
    torch.testing.assert_close(weights[0].float(), expected)


def test_bad_routes_are_refused_by_shape_and_expert_id():
    replay = RoutingReplay(build("mixtral"))
    with pytest.raises(ValueError, match=r"expected \[batch, positions, 2 MoE layers, top_k 2\]"):
        replay.set_routes(torch.zeros(2, 7, 3, 2, dtype=torch.long))
    bad = torch.zeros(2, 7, 2, 2, dtype=torch.long)
    bad[1, 4, 1, 0] = 4
    with pytest.raises(ValueError, match=r"expert id 4 at \(row 1, position 4, MoE layer 1\) is out of range: the "
                                         r"model has 4 experts"):
        replay.set_routes(bad)
    with pytest.raises(ValueError, match="integer expert ids"):
        replay.set_routes(torch.zeros(2, 7, 2, 2))


def test_a_dense_model_has_no_routers_to_replay():
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**COMMON))
    assert moe_routers(model) == []
    with pytest.raises(UnsupportedRouting, match="no mixture-of-experts router"):
        RoutingReplay(model)


def test_routing_metrics_hand_computed():
    # 3 tokens x 2 layers x top-2; token 2 is padding. Token 0 agrees in both layers (order differs in layer 1),
    # token 1 differs in layer 0 only.
    engine = torch.tensor([[[0, 1], [2, 3]], [[0, 1], [1, 2]], [[3, 2], [0, 1]]])
    trainer = torch.tensor([[[0, 1], [3, 2]], [[0, 2], [1, 2]], [[0, 1], [0, 1]]])
    m = routing_metrics(routing_stats(engine, trainer, torch.tensor([True, True, False])))
    assert m["parity/routing_agree"] == 3 / 4
    assert m["parity/routing_agree/layer_0"] == 1 / 2 and m["parity/routing_agree/layer_1"] == 1.0
    assert m["parity/routing_tokens_any_diff"] == 1 / 2
    empty = routing_metrics(routing_stats(engine, trainer, torch.zeros(3, dtype=torch.bool)))
    assert math.isnan(empty["parity/routing_agree"])


# ---- the scoring forward (trainer.measurement.scoring.forward): routes laid out with the batch ---------------------
PROMPTS = [[5, 9, 3, 17], [8, 1], [40, 2, 11, 12, 13]]
COMPLETIONS = [[20, 21, 22], [30, 31, 32, 33, 34], [41]]


def own_routes(model, seq):
    """The model's own routes of one whole sequence [len, L, k] (int16, rollout.routes' layout)."""
    with RouterTap(model) as tap, torch.no_grad():
        model(torch.tensor([seq]))
    return torch.stack([c[0] for c in tap.calls], 1)


def routed_batch(model, shift: int):
    """The three samples with routes = each token's own selection shifted by ``shift`` experts (0: its own)."""
    routes = [(own_routes(model, p + c) + shift) % model.config.num_experts for p, c in zip(PROMPTS, COMPLETIONS)]
    for r in routes:
        r[-1] = NO_ROUTE  # as an engine returns them: the last sampled token is never fed back
    rollouts = Rollouts(prompt_ids=PROMPTS, completion_ids=COMPLETIONS,
                        rollout_logprobs=[[0.0] * len(c) for c in COMPLETIONS], finish_reasons=["stop"] * 3,
                        group_size=1, routes=routes)
    return batch_from_rollouts(rollouts, pad_id=0)


def test_routes_are_aligned_with_the_padded_inputs_and_pad_where_nothing_is_predicted():
    model = build("qwen3_moe")
    batch = routed_batch(model, 0)
    assert batch.routes.shape == (3, 5 + 5, 2, 2)
    # row 1: prompt of 2 left-padded to 5, completion of 5: its tokens' routes at columns 3..8, the last
    # sampled token (column 9) and the padding PAD
    assert (batch.routes[1, :3] == PAD).all() and (batch.routes[1, 3:9] >= 0).all() and (batch.routes[1, 9] == PAD).all()
    # row 2: one completion token: the prompt's routes only (its last position predicts that token)
    assert (batch.routes[2, :5] >= 0).all() and (batch.routes[2, 5:] == PAD).all()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_scoring_forward_replays_the_same_way_padded_packed_and_in_micro_batches(family):
    model = build(family)
    own, other = routed_batch(model, 0), routed_batch(model, 1)
    plain = forward(model, replace(own, routes=None), temperature=1.0)[0]  # no replay installed
    RoutingReplay(model)
    lp, _, _, _, stats, _ = forward(model, own, temperature=1.0)
    assert torch.equal(lp, plain)  # replaying the model's own choice is the model
    assert float(stats["agree_by_layer"].sum()) == 2 * float(stats["tokens"]) and stats["unrouted"] == 0

    padded, _, _, _, s_padded, _ = forward(model, other, temperature=1.0)
    packed, _, _, _, s_packed, _ = forward(model, other, temperature=1.0, pack_sequences=True)
    micro = score_batch(model, other, micro_batch_size=1, temperature=1.0, entropy=False)
    assert not torch.allclose(padded, plain, atol=1e-3)  # the engine's selection was used
    torch.testing.assert_close(packed, padded, atol=2e-5, rtol=0)
    torch.testing.assert_close(micro.logprobs, padded, atol=2e-5, rtol=0)
    for k in ("agree_by_layer", "tokens", "tokens_any_diff"):
        assert torch.equal(s_packed[k], s_padded[k]) and torch.equal(micro.routing[k], s_padded[k])
    # layer 0 sees the same inputs in both and was given another expert set everywhere: it never agrees
    assert float(s_padded["agree_by_layer"][0]) == 0 and float(s_padded["tokens"]) == (4 + 3 - 1) + (2 + 5 - 1) + 5

    # a batch without routes afterwards: the routers choose again (the last routes are not left behind)
    again = forward(model, replace(other, routes=None), temperature=1.0)[0]
    assert torch.equal(again, plain)


def test_gradient_checkpointings_recompute_replays_the_same_routes():
    grads = []
    for checkpointing in (False, True):
        model = build("qwen3_moe")
        batch = routed_batch(model, 1)
        RoutingReplay(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        lp = forward(model, batch, temperature=1.0)[0]
        (lp * batch.mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("gate" in n for n in grads[0])
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], atol=1e-5, rtol=1e-4, msg=n)


def test_a_deep_copy_of_a_replayed_model_routes_with_its_own_weights_and_routes():
    """copy.deepcopy (the doctor's noise floor: the same weights in a wider dtype) gives a model whose routers read
    the copy's weights and the copy's RoutingReplay, not the original's."""

    model = build("qwen3_moe").to(torch.bfloat16)
    replay = RoutingReplay(model)
    reference = model(IDS).logits
    wide = copy.deepcopy(model).to(torch.float32)
    assert attached_replay(wide) is not replay and attached_replay(model) is replay
    assert wide(IDS).logits.dtype == torch.float32  # the router's GEMM ran in the copy's float32 weights
    attached_replay(wide).set_routes(torch.zeros(2, 7, 2, 2, dtype=torch.long) + torch.tensor([0, 1]))
    assert replay.routes is None
    with RouterTap(wide) as tap:
        wide(IDS)
    assert all((c[0].sort(-1).values == torch.tensor([0, 1])).all() for c in tap.calls)  # the copy replays its routes
    with RouterTap(model) as tap:
        assert torch.equal(model(IDS).logits, reference)  # the original neither replays them nor changed
    assert not all((c[0].sort(-1).values == torch.tensor([0, 1])).all() for c in tap.calls)
