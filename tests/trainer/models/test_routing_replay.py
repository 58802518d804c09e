"""Rollout routing replay on the Hugging Face MoE families (trainer/models/routing_replay.py) and the routing parity
metrics (parity/routing.py). Tiny random models at std 0.2, so routers have near-ties and a wrong gather shows."""
import math

import pytest
import torch
import transformers

from parity.routing import routing_metrics, routing_stats
from trainer.models.routing_replay import RoutingReplay, UnsupportedRouting, moe_routers

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
