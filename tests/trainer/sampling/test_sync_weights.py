"""trainer.sampling.engines.sync_weights: the engine gets the trainer's merged weights in the engine's dtype,
one decoder layer at a time when it keeps unsent names, one push per sync otherwise."""
import copy

import pytest
import torch

from rollout.hf_engine import HFEngine
from rollout.weight_export import layer_chunks, merged_lora_weights, payload_bytes
from trainer.config import LoraConfig
from trainer.models.policy import add_lora, load_base_model
from trainer.sampling.engines import sync_adapter, sync_weights


@pytest.fixture(scope="module")
def policy_and_base(tiny_model_dir):
    """A float32 tiny policy whose LoRA delta is non-zero, and an untouched copy of the base for an engine."""
    base = load_base_model(tiny_model_dir, "float32", "cpu")
    engine_model = copy.deepcopy(base)
    policy = add_lora(base, LoraConfig())
    with torch.no_grad():
        for i, (name, p) in enumerate(policy.named_parameters()):
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(i))
    return policy, engine_model


class _Recorder:
    """The engine protocol's load_weights, recorded (an engine that takes an update whole: no streaming)."""

    max_model_len = None
    pushes_weights = True
    streams_weights = False
    fp8_block_weights = False

    def __init__(self):
        self.calls = []

    def load_weights(self, named):
        self.calls.append([n for n, _ in named])


def test_layer_chunks_keep_layers_and_fused_groups_whole(policy_and_base):
    policy, _ = policy_and_base
    named = merged_lora_weights(policy)
    chunks = list(layer_chunks(named))
    assert [n for c in chunks for n, _ in c] == [n for n, _ in named]  # nothing lost or reordered
    layers = [{n.split(".layers.")[1].split(".")[0] for n, _ in c} for c in chunks]
    assert layers == [{str(i)} for i in range(policy.config.num_hidden_layers)]
    for c in chunks:
        names = {n.rsplit(".", 2)[-2] for n, _ in c}
        assert {"q_proj", "k_proj", "v_proj"} <= names and {"gate_proj", "up_proj"} <= names
    assert list(layer_chunks([("lm_head.weight", torch.ones(1)), ("model.norm.weight", torch.ones(1))])) == [
        [("lm_head.weight", torch.ones(1)), ("model.norm.weight", torch.ones(1))]]


def test_the_engine_gets_the_merge_in_its_own_dtype_one_layer_per_call(policy_and_base, monkeypatch):
    policy, engine_model = policy_and_base
    engine = HFEngine(engine_model, dtype="float32")
    calls = []
    real = engine.load_weights
    monkeypatch.setattr(engine, "load_weights", lambda named: (calls.append(len(named)), real(named)))
    out = sync_weights(engine, policy, dtype=torch.float32)
    exact = dict(merged_lora_weights(policy, dtype=torch.float32))
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in exact.items())
    # Sensitive: a BF16 rounding of the same merge (what the sync sent before) is not what the trainer holds.
    rounded = dict(merged_lora_weights(policy, dtype=torch.bfloat16))
    assert max(float((rounded[n].float() - t).abs().max()) for n, t in exact.items()) > 1e-4
    assert calls == [7] * policy.config.num_hidden_layers  # one call per layer, its 7 LoRA modules
    assert out == {"perf/sync_bytes": float(payload_bytes(list(exact.items()))), "perf/sync_tensors": 28.0,
                   "perf/sync_chunks": 4.0}


def test_layer_chunks_fill_a_byte_budget_with_whole_layers(policy_and_base):
    policy, _ = policy_and_base
    named = merged_lora_weights(policy)
    per_layer = [payload_bytes(c) for c in layer_chunks(named)]
    n = len(per_layer)
    assert [len(c) for c in layer_chunks(named, max_bytes=2 * per_layer[0])] == [14] * (n // 2) + [7] * (n % 2)
    assert [len(c) for c in layer_chunks(named, max_bytes=1)] == [7] * n  # a layer over budget is a chunk alone
    assert [len(c) for c in layer_chunks(named, max_bytes=1024**3)] == [7 * n]


def test_an_engine_without_partial_updates_gets_one_push(policy_and_base):
    policy, _ = policy_and_base
    engine = _Recorder()
    out = sync_weights(engine, policy)
    assert len(engine.calls) == 1 and len(engine.calls[0]) == 28 and out["perf/sync_tensors"] == 28.0
    assert out["perf/sync_chunks"] == 1.0


def test_a_server_gets_the_layers_as_a_stream_each_made_after_the_previous_was_sent(policy_and_base):
    """ServerEngine.load_weight_chunks protocol: one call (one weight version) consuming a generator; the
    export is lazy, so when a chunk arrives only its own layer's modules have been merged (ZeRO-3: gathered)."""
    import contextlib

    policy, _ = policy_and_base
    merged_modules = []

    def gather(params):  # called once per exported module, as zero3_gather is
        merged_modules.append(len(params))
        return contextlib.nullcontext()

    class _Server:
        max_model_len = None
        pushes_weights = True
        streams_weights = True
        fp8_block_weights = False

        def __init__(self):
            self.seen = []

        def load_weight_chunks(self, chunks):
            for chunk in chunks:
                self.seen.append((len(chunk), len(merged_modules)))

    engine = _Server()
    out = sync_weights(engine, policy, gather=gather, chunk_bytes=1)
    layers = policy.config.num_hidden_layers
    # a layer ends where the next begins: its first module is merged (looked at) before the chunk is sent
    assert engine.seen == [(7, min(7 * (i + 1) + 1, 7 * layers)) for i in range(layers)]
    assert out["perf/sync_chunks"] == layers and out["perf/sync_tensors"] == 7 * layers


def test_a_follower_rank_only_follows_the_push(policy_and_base):
    policy, _ = policy_and_base
    engine = _Recorder()
    engine.pushes_weights, engine.followed = False, 0

    def follow():
        engine.followed += 1

    engine.follow_push = follow
    assert sync_weights(engine, policy) == {}
    assert engine.calls == [] and engine.followed == 1


def test_a_follower_rank_follows_an_adapter_push_as_an_adapter(policy_and_base):
    """A data-parallel rank > 0 sharing rank 0's server: its requests must name the adapter version rank 0 loaded
    (rollout.server_engine), so it is told the push was an adapter's."""
    policy, _ = policy_and_base
    engine = _Recorder()
    engine.pushes_weights, engine.adapter_dtype, engine.followed = False, torch.bfloat16, []
    engine.follow_push = lambda adapter=False: engine.followed.append(adapter)
    assert sync_adapter(engine, policy, version=3) == {}
    assert engine.calls == [] and engine.followed == [True]
