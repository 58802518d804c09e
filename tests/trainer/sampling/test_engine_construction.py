"""Training and `parityrl compare` start their vLLM engine through one function (trainer.sampling.engines.start_vllm).

The decision under test is what the engine is started FROM and WITH for a precision recipe; the
engine itself is replaced by a recorder (starting vLLM is the integration tests' job). CUDA is
reported available so that the FP8 export branch — the one that used to differ — is taken; it
cannot run here, only the choice is checked.
"""
from pathlib import Path

import pytest
import torch

import trainer.sampling.engines
from trainer.lifecycle.preflight import load_recipe

REPO = Path(__file__).resolve().parents[3]


class Recorder:
    made: list = []

    def __init__(self, model_dir, **kwargs):
        Recorder.made.append((model_dir, kwargs))


@pytest.fixture
def recorded(monkeypatch, tmp_path):
    Recorder.made = []
    monkeypatch.setattr(trainer.sampling.engines, "VLLMEngine", Recorder)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    written = []

    def fake_export(model_dir, out):
        written.append((model_dir, Path(out)))
        return Path(out)

    monkeypatch.setattr(trainer.sampling.engines, "write_fp8_checkpoint", fake_export)
    return written


@pytest.mark.parametrize("precision", ["bf16", "fp8_rollout", "fp8_unified"])
def test_train_and_compare_ask_for_the_same_engine(tmp_path, recorded, precision):
    from trainer.diagnostics.compare import _start_engine
    from trainer.sampling.engines import make_engine

    cfg = load_recipe(REPO / "recipes" / "grpo_tiny.yaml",
                      [f"precision.recipe={precision}", f"logging.run_dir={tmp_path / 'run'}"], check_paths=False)
    make_engine(cfg, "/models/base", max_model_len=88)
    _start_engine("vllm", "/models/base", None, dtype="bfloat16", max_model_len=88, seed=0,
                  kv_cache_bytes=cfg.rollout.kv_cache_memory_bytes, work_dir=tmp_path / "report", precision=precision)
    (train_dir, train_kw), (cmp_dir, cmp_kw) = Recorder.made
    if precision.startswith("fp8"):
        # both start from the project's block-FP8 export of the same base, with vLLM's fp8 method
        assert [m for m, _ in recorded] == ["/models/base", "/models/base"]
        assert train_dir == str(tmp_path / "run" / "engine_fp8") and cmp_dir == str(tmp_path / "report" / "engine_fp8")
        assert train_kw["quantization"] == cmp_kw["quantization"] == "fp8"
    else:
        assert train_dir == cmp_dir == "/models/base" and "quantization" not in train_kw | cmp_kw
    for key in ("dtype", "max_model_len", "seed", "max_logprobs", "kv_cache_memory_bytes", "enforce_eager",
                "gpu_memory_utilization"):
        assert train_kw[key] == cmp_kw[key], key
