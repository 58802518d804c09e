"""The whole battery on the built-in tiny model (every check passes), and a model vLLM refuses: the doctor, train and
compare each name vLLM's reason with exit status 4, and the doctor's checks that need no engine still run."""
import json
import shutil
from pathlib import Path

import pytest

from trainer.doctor.battery import EXIT_ENGINE
from trainer.doctor.records import PASS, SKIP

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"


@pytest.mark.slow
def test_every_check_passes_on_the_tiny_model(tiny_engine, tmp_path, capsys):
    from trainer.commands.doctor import run_doctor

    status = run_doctor(str(RECIPE), [f"logging.run_dir={tmp_path / 'run'}"], out=tmp_path / "doc",
                        engine=tiny_engine, say=lambda _m: None)
    printed = capsys.readouterr().out
    print(printed)
    report = json.loads((tmp_path / "doc" / "doctor.json").read_text())
    assert status == 0 and report["exit_status"] == 0, printed
    assert {f["verdict"] for f in report["findings"]} == {PASS, SKIP}, printed
    # the only skips: routing (a dense model has no router), images (a text recipe) and a precision recipe that runs
    # in another dtype (fp16 in float16)
    assert [(f["check"], f["item"]) for f in report["findings"] if f["verdict"] == SKIP] == [
        ("routing", "-"), ("images", "-"), ("recipes", "fp16")], printed
    assert {f["check"] for f in report["findings"]} == {"layers", "images", "routing", "prefill_decode",
                                                        "batch_invariance", "prefix_cache", "weight_sync", "tokens",
                                                        "sampling", "recipes"}
    assert {f["check"] for f in report["findings"]} == set(report["seconds"])


def _sliding_window_on_some_layers(tmp_path) -> Path:
    """A Qwen2 with sliding-window attention on its second layer only: Transformers runs it, vLLM 0.32 asserts
    against it ("Sliding window for some but all layers is not supported")."""
    from trainer.builtin.zoo import ensure_arch_model

    model = tmp_path / "qwen2-sliding"
    shutil.copytree(ensure_arch_model("qwen2", dtype="float32"), model)
    config = json.loads((model / "config.json").read_text())
    n = config["num_hidden_layers"]
    config.update(use_sliding_window=True, sliding_window=16, max_window_layers=1,
                  layer_types=["full_attention"] + ["sliding_attention"] * (n - 1))
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.slow
def test_a_model_the_engine_cannot_load_is_named_with_its_reason_and_status_4(tmp_path, capsys):
    from trainer.cli import main

    model = _sliding_window_on_some_layers(tmp_path)
    reason = "Sliding window for some but all layers is not supported"
    status = main(["doctor", "--model", str(model), "--set", "model.dtype=float32", "--set",
                   f"logging.run_dir={tmp_path / 'run'}", "--out", str(tmp_path / "doc")])
    out = capsys.readouterr()
    report = json.loads((tmp_path / "doc" / "doctor.json").read_text())
    assert status == EXIT_ENGINE == report["exit_status"], out
    assert reason in report["engine_error"] and "Traceback" not in out.out + out.err
    skipped = [f for f in report["findings"] if f["verdict"] == SKIP]
    # every check that needed the engine names its reason; the routing and images checks say first that a dense model
    # has no experts to compare and a text recipe no images (true whatever the engine does)
    own = [f for f in skipped if f["check"] in ("routing", "images")]
    assert [f["check"] for f in own] == ["routing", "images"], own
    assert "not a mixture-of-experts model" in own[0]["cause"] and "hold no images" in own[1]["cause"]
    assert all(reason in f["cause"] for f in skipped if f not in own) and len(skipped) > len(own)
    # the checks that need no engine still ran
    assert any(f["check"] == "tokens" and f["verdict"] == PASS for f in report["findings"])

    assert main(["train", str(RECIPE), "--set", f"model.path={model}", "--set", "model.dtype=float32", "--set",
                 f"logging.run_dir={tmp_path / 'train'}", "--set", "logging.wandb.mode=disabled"]) == 4
    err = capsys.readouterr().err
    assert f"vLLM cannot load the model {model}: AssertionError: {reason}" in err and "Traceback" not in err

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is 2 + 3?\n")
    assert main(["compare", str(model), str(prompts), "--out", str(tmp_path / "cmp"), "--dtype", "float32"]) == 4
    err = capsys.readouterr().err
    assert reason in err and "Traceback" not in err
