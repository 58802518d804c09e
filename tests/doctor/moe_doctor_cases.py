"""The doctor on a mixture-of-experts model: the architecture zoo's random Qwen3-MoE (top-2 of 8 experts, weights at
std 0.2: routers with near-ties) in bf16, with the recipe's routing replay off and on, a router fault planted on either
side, and the sync legs that push an MoE model's weights (fused experts in Transformers 5, per expert in the engine).

Not collected by the suite itself: test_routing.py runs this file in a pytest process of its own (vLLM's parallel
groups are process-wide: an MoE engine cannot start beside the session's dense one). Run it directly with
``pytest tests/doctor/moe_doctor_cases.py``."""
import pytest
import torch

from rollout.weight_export import full_weights
from trainer.builtin.zoo import ensure_arch_model
from trainer.doctor.checks import layers, prefix_cache, routing, weight_sync
from trainer.doctor.records import FAIL, PASS, SKIP, WARN

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_dir():
    return str(ensure_arch_model("qwen3_moe", dtype="bfloat16"))


@pytest.fixture(scope="module")
def moe_engine(moe_dir):
    """The engine training starts for this model with replay (or measure): it returns its routes."""
    from rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(moe_dir, dtype="bfloat16", max_model_len=256, seed=0, kv_cache_memory_bytes=128 * 1024**2,
                        return_routes=True)
    yield engine
    engine.close()


def _print(found):
    for f in found:
        print(f"  {f.item:<48} {f.figure!s:<10} {f.expected:<16} {f.verdict}  {f.cause}")


def _seqs(doc):
    b = doc.batch()
    return [p + c for p, c in zip(b.prompt_ids[:routing.NUM_SEQUENCES], b.completion_ids[:routing.NUM_SEQUENCES])]


def test_replay_off_names_the_experts_chosen_as_the_cause(make_doctor, moe_engine, moe_dir):
    doc = make_doctor(f"model.path={moe_dir}", "parity.routing_replay=off", engine=moe_engine)
    assert doc.routing == "off"
    found = routing.run(doc)
    print("replay off:")
    _print(found)
    assert found[0].verdict == SKIP and "routing_replay is off" in found[0].cause
    rows = found[1:]
    assert [f.item for f in rows] == ["layer 0: experts agree", "layer 1: experts agree"]
    assert all(f.details["own"] >= routing.OWN_LEVEL for f in rows)  # near-ties only: no router differs
    differ = [f for f in rows if f.verdict == WARN]
    assert differ and all(f.verdict == PASS for f in rows if f not in differ)
    assert all("the experts chosen differ" in f.cause and "not the MLP's weights" in f.cause for f in differ)

    # the layers check names routing for a divergence at or after the first layer whose experts differ
    first = int(differ[0].item.split()[1].rstrip(":"))
    seqs = _seqs(doc)
    names = [p.name for p in layers.points(2, transformed=False)]
    with routing.trainer_routing(doc, seqs) as routes:
        layers.trainer_states(doc.model, seqs, names)
    mlp = next(p for p in layers.points(2, transformed=False) if p.name == f"layer {first}, mlp")
    assert f"at layer {first}" in routes.cause(mlp.depth) and "the experts chosen differ" in routes.cause(mlp.depth)
    assert routes.cause(mlp.depth - 1) is None  # nothing differs before that layer


def test_replay_on_the_trainer_uses_the_engines_experts_and_the_parity_shows_it(make_doctor, moe_engine, moe_dir):
    doc = make_doctor(f"model.path={moe_dir}", "parity.routing_replay=on", engine=moe_engine)
    assert doc.routing == "replay"
    found = routing.run(doc)
    print("replay on:")
    _print(found)
    assert [f.verdict for f in found] == [PASS, PASS, PASS]
    assert found[0].figure == 1.0 and all(f.figure == 1.0 for f in found[1:])
    own = [f.details["own"] for f in found[1:]]
    assert min(own) < 1.0  # the routers alone would still differ somewhere: replay is what made them agree

    # every check's trainer forward replays: the same batch scored without replay is further from the engine
    replayed = doc.parity(doc.batch())
    off = make_doctor(f"model.path={moe_dir}", "parity.routing_replay=off", engine=moe_engine)
    own_routers = off.parity(doc.batch())
    print(f"parity/mae with replay {replayed['parity/mae']:.4g}, without {own_routers['parity/mae']:.4g}")
    assert replayed["parity/mae"] < own_routers["parity/mae"]


@pytest.mark.parametrize("side", ["trainer", "engine"])
def test_a_router_fault_on_either_side_fails_naming_its_layer(make_doctor, moe_engine, moe_dir, side):
    """Layer 1's router weights (mlp.gate) perturbed by half their spread on one side only: its own top-k leaves
    the near-tie level, with replay on (the experts used still agree: replayed) and off."""
    for mode in ("on", "off"):
        doc = make_doctor(f"model.path={moe_dir}", f"parity.routing_replay={mode}", engine=moe_engine)
        doc.batch()  # sampled by the healthy engine: the same tokens as the cases above
        gate = doc.model.model.layers[1].mlp.gate.weight
        original = gate.detach().clone()
        g = torch.Generator().manual_seed(0)
        wrong = original.float() + 0.5 * float(original.float().std()) * torch.randn(original.shape, generator=g)
        try:
            if side == "trainer":
                with torch.no_grad():
                    gate.copy_(wrong.to(gate.dtype))
            else:
                moe_engine.load_weights([("model.layers.1.mlp.gate.weight", wrong)])
            found = routing.run(doc)
        finally:
            with torch.no_grad():
                gate.copy_(original)
            moe_engine.load_weights([("model.layers.1.mlp.gate.weight", original)])
        print(f"layer 1's router perturbed on the {side}'s side, replay {mode}:")
        _print(found)
        by = {f.item: f for f in found}
        bad = by["layer 1: router's own top-k agree"]
        assert bad.verdict == FAIL and bad.figure < routing.OWN_LEVEL and "layer 1's router" in bad.cause
        assert "mlp.gate" in bad.cause
        assert by["layer 0: experts agree"].verdict == PASS


@pytest.fixture(scope="module")
def plain_engine(moe_dir):
    """The engine training starts for this model with replay off: no routes, prefix caching on."""
    from rollout.vllm_engine import VLLMEngine

    with VLLMEngine(moe_dir, dtype="bfloat16", max_model_len=256, seed=0, kv_cache_memory_bytes=64 * 1024**2) as e:
        yield e


def _engine_vs_model(engine, model, seq):
    """Mean |engine log-prob - model log-prob| over a sequence's tokens (the engine's prefill)."""
    got = torch.tensor(engine.score([seq]).logprobs[0])  # log p(x_t | x_<t), t >= 1
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0, :-1].float(), -1)
    return float((got - lp.gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]).abs().mean())


@pytest.mark.xfail(strict=True, reason="vLLM 0.32 CPU: after an in-place reload of its experts (reload_weights with "
                                       "them, or from the checkpoint) this MoE engine computes other log-probs, even "
                                       "when the weights reloaded are its own checkpoint's; the push itself is "
                                       "accepted (a reload of attention weights alone is not affected)")
def test_an_moe_engine_computes_with_the_weights_pushed_to_it(plain_engine, moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16)
    seq = [1, 3, 40, 77, 301, 4, 9, 500, 12]
    healthy = _engine_vs_model(plain_engine, model, seq)
    plain_engine.load_weights(full_weights(model, dtype=torch.bfloat16))  # the same weights, experts per expert
    pushed = _engine_vs_model(plain_engine, model, seq)
    print(f"|engine - model| before the push {healthy:.3g}, after pushing the same weights {pushed:.3g}")
    assert pushed <= 2 * healthy


def test_the_sync_legs_push_an_moe_models_fused_experts(make_doctor, moe_dir, plain_engine):
    """prefix_cache's push of every weight (experts included) and weight_sync's merged sync (training's own) are
    accepted by the engine on an MoE model whose experts Transformers 5 holds fused, and complete."""
    doc = make_doctor(f"model.path={moe_dir}", "parity.routing_replay=off", engine=plain_engine)
    found = prefix_cache.run(doc) + weight_sync.run(doc)
    print("prefix_cache and weight_sync on the MoE model:")
    _print(found)
    assert {f.check for f in found} == {"prefix_cache", "weight_sync"}
    assert all(f.verdict == PASS for f in found if not f.item.startswith("engine's log-probs")), found


def test_weight_sync_says_whether_the_engine_computes_as_before_after_its_restore(make_doctor, moe_dir, moe_engine):
    """Last (it may leave the engine changed): the weight_sync check's restore row FAILs exactly when the engine's
    log-probs, measured against the Transformers model on its own, moved through the check's sync and restore."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.bfloat16)
    seq = [1, 3, 40, 77, 301, 4, 9, 500, 12]
    healthy = _engine_vs_model(moe_engine, model, seq)
    doc = make_doctor(f"model.path={moe_dir}", "parity.routing_replay=on", engine=moe_engine)
    found = {f.item: f for f in weight_sync.run(doc)}
    after = _engine_vs_model(moe_engine, model, seq)
    row = found["engine's log-probs after the check vs before: max |dlp|"]
    print(f"|engine - model| before the check {healthy:.3g}, after {after:.3g}; the row: {row.figure:.3g} "
          f"{row.verdict}")
    assert (row.verdict == FAIL) == (after > 2 * healthy), row
    assert row.verdict == PASS or "in-place reload of an MoE model" in row.cause
