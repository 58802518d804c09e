"""The layers check: engine vs trainer hidden states point by point, each judged against the model's own noise floor
there; the healthy tiny model and a healthy 48-layer random Qwen3 pass, and a difference planted at one known place (on
either side, on two architectures, shallow and deep) fails naming that place first."""
import math

import pytest
import torch

from trainer.doctor.checks.layers import CAUSES, first_divergence, points, run
from trainer.doctor.records import FAIL, PASS


def _print(findings):
    for r in findings[0].details["points"]:
        print(f"  {r['point']:<22} rel {r['rel_error']:.3e}  floor {r['floor']:.3e}  "
              f"worst position {r['max_position_error']:.3e}")


def _theta_1e6(model):
    """The trainer's RoPE frequencies those of theta 1e6, where the engine reads the config's theta (a rope field the
    two libraries read differently): inv_freq = theta^(-2i/d), so the same frequencies raised to log 1e6 / log theta."""
    rope = model.model.rotary_emb
    theta = float(model.config.rope_parameters["rope_theta"])
    with torch.no_grad():
        rope.inv_freq.copy_(rope.inv_freq.double().pow(math.log(1e6) / math.log(theta)).to(rope.inv_freq.dtype))


def test_points_are_in_forward_order_and_first_divergence_is_the_first_out_of_band():
    pts = points(2, transformed=True)
    assert [p.name for p in pts] == ["embedding", "layer 0, attention", "layer 0, mlp", "layer 0, output",
                                     "layer 1, attention", "layer 1, mlp", "layer 1, output", "final norm",
                                     "logits (raw)", "logits"]
    assert all(a.depth < b.depth for a, b in zip(pts, pts[1:]))
    assert all(p.kind in CAUSES for p in pts)
    rows = [{"point": p.name, "rel_error": e, "band": 1e-2}
            for p, e in zip(pts, [0, 1e-3, 0.5, 0.4, math.nan, 0, 0, 0, 0, 0])]
    assert first_divergence(rows)["point"] == "layer 0, mlp"
    assert first_divergence([{**r, "band": 1.0} for r in rows[3:]])["point"] == "layer 1, attention"  # NaN: out
    assert first_divergence(rows[5:]) is None


@pytest.mark.slow
def test_healthy_tiny_model_passes_and_a_planted_fault_is_named_on_either_side(tiny_engine, make_doctor):
    doc = make_doctor(engine=tiny_engine)
    found = run(doc)
    print(f"healthy tiny model, {doc.dtype}:")
    _print(found)
    assert [f.verdict for f in found] == [PASS, PASS], found
    rows = found[0].details["points"]
    assert rows[0]["rel_error"] == 0.0  # the same ids and embedding weights: bit for bit
    assert all(0 < r["rel_error"] <= r["band"] for r in rows[1:])  # bf16 rounding, inside the band
    assert all(r["band"] == 4 * max(r["floor"], 2.0 ** -8) for r in rows) and rows[-1]["floor"] > 0
    assert (doc.out_dir / "layers.png").is_file()

    # (1) the trainer's layer 2 MLP: down_proj weights perturbed by 25% of their spread, on the trainer side only
    w = doc.model.model.layers[2].mlp.down_proj.weight
    original = w.detach().clone()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w.add_(0.25 * float(w.float().std()) * torch.randn(w.shape, generator=gen).to(w.dtype))
    found = run(doc)
    _print(found)
    assert found[0].verdict == FAIL and found[0].item == "first divergence: layer 2, mlp", found[0]
    assert "MLP" in found[0].cause and "down" in found[0].cause
    with torch.no_grad():
        w.copy_(original)

    # (2) the engine's layer 1 attention: an o_proj the sync delivered wrong (scaled by 1.1), on the engine only
    o = doc.model.model.layers[1].self_attn.o_proj.weight.detach()
    tiny_engine.load_weights([("model.layers.1.self_attn.o_proj.weight", o.float() * 1.1)])
    found = run(doc)  # the fixture restores the engine's weights afterwards
    _print(found)
    assert found[0].verdict == FAIL and found[0].item == "first divergence: layer 1, attention", found[0]
    assert "attention" in found[0].cause
    assert all(r["rel_error"] <= r["band"] for r in found[0].details["points"][:4])  # layer 0 still agrees


@pytest.mark.slow
def test_qwen3_rope_theta_read_differently_is_named_at_layer_0_attention(make_doctor):
    """Qwen3 (per-head q/k norms, std-0.2 weights): healthy first, then the trainer's RoPE computed with theta 1e6
    where the engine reads 1e4 from config.json (a rope field the two libraries read differently)."""
    from rollout.vllm_engine import VLLMEngine
    from trainer.builtin.zoo import ensure_arch_model

    model_dir = ensure_arch_model("qwen3", dtype="float32")
    with VLLMEngine(str(model_dir), dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 * 1024**2) as eng:
        doc = make_doctor(f"model.path={model_dir}", engine=eng)
        found = run(doc)
        print("healthy qwen3, bfloat16:")
        _print(found)
        assert [f.verdict for f in found] == [PASS, PASS], found

        _theta_1e6(doc.model)
        found = run(doc)
        print("qwen3, the trainer's RoPE theta 1e6:")
        _print(found)
    assert found[0].verdict == FAIL and found[0].item == "first divergence: layer 0, attention", found[0]
    assert "RoPE" in found[0].cause
    assert found[0].details["points"][0]["rel_error"] == 0.0


def test_the_hf_engine_is_skipped_with_its_reason(make_doctor, tiny_model_dir):
    from rollout.hf_engine import HFEngine
    from trainer.doctor.records import CheckCannotRun

    doc = make_doctor(engine=HFEngine(tiny_model_dir, dtype="bfloat16"))
    with pytest.raises(CheckCannotRun, match="compare the trainer with itself"):
        run(doc)


@pytest.fixture(scope="module")
def qwen3_48(tmp_path_factory):
    """The zoo's Qwen3 (hidden 64, std-0.2 weights, as ``trainer.builtin.zoo`` builds every test architecture) with 48
    decoder layers: deep enough that its healthy bf16 gap grows past any one band fit for 2 to 30 layers (layer 9's
    MLP read 4.0e-2, the logits 7.4e-2)."""
    from trainer.builtin.zoo import build_arch_model

    path = tmp_path_factory.mktemp("qwen3-48")
    model, tok = build_arch_model("qwen3", overrides={"num_hidden_layers": 48})
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.slow
def test_a_healthy_48_layer_qwen3_passes_and_each_planted_fault_fails_where_it_is(qwen3_48, make_doctor):
    from rollout.vllm_engine import VLLMEngine
    from trainer.diagnostics.noise_floor import FACTOR

    with VLLMEngine(str(qwen3_48), dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 * 1024**2) as eng:
        doc = make_doctor(f"model.path={qwen3_48}", engine=eng)
        found = run(doc)
        print("healthy 48-layer qwen3, bfloat16:")
        _print(found)
        assert [f.verdict for f in found] == [PASS, PASS], found
        rows = found[0].details["points"]
        assert len(rows) == 1 + 3 * 48 + 2
        assert max(r["rel_error"] / r["floor"] for r in rows[1:]) < FACTOR
        assert rows[-1]["floor"] > 2 * rows[3]["floor"]  # the floor grows with depth: logits against layer 0

        # the trainer's layer 2 MLP (down_proj by 25% of its spread), as on the tiny model
        w = doc.model.model.layers[2].mlp.down_proj.weight
        original = w.detach().clone()
        with torch.no_grad():
            w.add_(0.25 * float(w.float().std()) * torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
                   .to(w.dtype))
        found = run(doc)
        with torch.no_grad():
            w.copy_(original)
        assert found[0].verdict == FAIL and found[0].item == "first divergence: layer 2, mlp", found[0]

        # the engine's layer 1 o_proj delivered x1.1
        o = doc.model.model.layers[1].self_attn.o_proj.weight.detach()
        eng.load_weights([("model.layers.1.self_attn.o_proj.weight", o.float() * 1.1)])
        found = run(doc)
        eng.load_weights([("model.layers.1.self_attn.o_proj.weight", o.float())])
        assert found[0].verdict == FAIL and found[0].item == "first divergence: layer 1, attention", found[0]

        _theta_1e6(doc.model)
        found = run(doc)
    assert found[0].verdict == FAIL and found[0].item == "first divergence: layer 0, attention", found[0]
    assert "RoPE" in found[0].cause
