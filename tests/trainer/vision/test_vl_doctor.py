"""``parityrl doctor`` on a vision-language recipe (slow tier): the images check runs the recipe's prompts with their
images, and on the healthy random tiny Idefics3 (std 0.2 weights, float32) the inputs agree, the prompts with images
score at the numerics' level and the vision tower stays in its band at every point; each planted fault fails naming
what it planted (tests/trainer/vision/vl_doctor_worker.py, one engine, in a process of its own). The layers check
runs the language model on the recipe's text prompts."""
from pathlib import Path

import pytest
from worker_results import worker_results

pytestmark = pytest.mark.slow
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def batteries(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl_doctor")
    out = worker_results(HERE / "vl_doctor_worker.py", root, timeout=900)
    return out, root


def _rows(battery, check="images"):
    return {f["item"]: f for f in battery["findings"] if f["check"] == check}


def test_a_healthy_vision_language_model_passes_every_row(batteries):
    out, root = batteries
    healthy = out["healthy"]
    assert healthy["status"] == 0, healthy
    assert [f["verdict"] for f in healthy["findings"]] == ["PASS"] * 5, healthy["findings"]
    layers = _rows(healthy, "layers")["first divergence"]
    assert layers["details"]["points"][0]["point"] == "embedding"  # the language model's decoder, hooked
    rows = _rows(healthy)
    assert rows["inputs: samples whose ids, images or pixels differ"]["details"]["samples"] == 8
    assert rows["prompts with images: mae"]["figure"] < 5e-6  # float32: 1.4e-6 measured (CPU)
    tower = rows["vision tower: first divergence"]["details"]
    assert [p["point"] for p in tower["points"]] == [
        "vision embedding", "vision layer 0, attention", "vision layer 0, mlp", "vision layer 0, output",
        "vision layer 1, attention", "vision layer 1, mlp", "vision layer 1, output", "vision post-norm",
        "projector"]
    assert all(0 < p["rel_error"] <= p["band"] for p in tower["points"]), tower["points"]
    assert tower["images"] == 4 and (root / "healthy" / "vision_tower.png").is_file()


@pytest.mark.parametrize("run, item, cause", [
    ("processor_42px", "inputs: samples whose ids, images or pixels differ",
     "sample 0 (prompt 0), image 0: pixel tensors differ (engine float32 [1, 3, 56, 56]"),
    ("image_dropped", "inputs: samples whose ids, images or pixels differ",
     "sample 1 (prompt 1): the engine consumed 0 image(s), the trainer's prompt holds 1"),
    ("engine_tower_weight", "vision tower: first divergence: vision layer 1, mlp", "fc1 / fc2 weights"),
    ("trainer_tower_attention", "vision tower: first divergence: vision layer 0, attention", "q/k/v/out weights"),
])
def test_each_planted_fault_fails_naming_it(batteries, run, item, cause):
    battery = batteries[0][run]
    assert battery["status"] == 8, battery
    rows = _rows(battery)
    assert rows[item]["verdict"] == "FAIL" and cause in rows[item]["cause"], rows
    assert [f["verdict"] for f in battery["findings"] if f["check"] == "layers"] == ["PASS", "PASS"]
    if run in ("processor_42px", "image_dropped"):  # other inputs: no score of them is compared
        assert [f["verdict"] for f in rows.values()] == ["FAIL", "SKIP", "SKIP"], rows
    if run == "engine_tower_weight":  # the engine's image features are wrong: so are its prompts' log-probs
        assert rows["prompts with images: mae"]["verdict"] == "FAIL"
        points = rows[item]["details"]["points"]
        assert all(p["rel_error"] <= p["band"] for p in points[:5]), points  # up to layer 1's attention: agree


def test_compare_runs_a_vision_language_models_prompts_as_text_and_says_so(batteries):
    r = batteries[0]["compare"]
    assert r["vision_language"] == "prompts run as text, without images", r
    assert r["mae"] < 5e-6, r  # float32: 1.3e-6 measured (CPU)
