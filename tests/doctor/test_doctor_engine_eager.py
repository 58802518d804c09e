"""The doctor's engine on CUDA runs eagerly when a check that hooks its modules (layers, routing) is asked, and as
training runs it (CUDA graphs) otherwise; checked without a GPU: the engine is started as the doctor starts it
(``Doctor.engine`` -> ``make_engine`` -> ``VLLMEngine``) on a stand-in CUDA platform whose ``vllm.LLM`` records the
options it is given (nothing of vLLM starts)."""
from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_on_cuda_standin import start_engines_as_on_cuda

from trainer.doctor.battery import hook_checks, select
from trainer.doctor.checks import layers

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_tiny.yaml"


class RecordingLLM:
    started: list = []

    def __init__(self, model, **kwargs):
        RecordingLLM.started.append(kwargs)
        self.model_config = SimpleNamespace(enforce_eager=kwargs["enforce_eager"])  # vLLM's ModelConfig keeps it

    def apply_model(self, fn):
        return [None]


@pytest.fixture
def on_cuda(monkeypatch):
    RecordingLLM.started = []
    start_engines_as_on_cuda(monkeypatch, RecordingLLM)
    return RecordingLLM.started


@pytest.fixture
def doctor_engine(tmp_path):
    """``doctor_engine(only, *sets)``: the engine ``parityrl doctor --only ...`` starts on the demo recipe."""
    from trainer.doctor.context import Doctor
    from trainer.lifecycle.preflight import load_recipe

    def start(only, *sets):
        cfg = load_recipe(RECIPE, [f"logging.run_dir={tmp_path / 'run'}", *sets])
        doc = Doctor(cfg, tmp_path / "doctor", say=lambda _m: None, hook_checks=hook_checks(select(only)))
        return doc.engine

    return start


@pytest.mark.parametrize("only", [["layers"], ["routing"], None, ["prefill_decode", "layers"]])
def test_a_battery_with_a_hooking_check_starts_an_eager_engine_on_cuda(only, on_cuda, doctor_engine, monkeypatch):
    engine = doctor_engine(only)
    assert [k["enforce_eager"] for k in on_cuda] == [True]  # was: False, and layers skipped ("runs CUDA graphs")
    # the layers check's own refusal (which reads the engine's config) accepts this engine
    monkeypatch.setattr(layers, "precision_refusal", lambda precision, dtype: None)
    layers._refuse(SimpleNamespace(precision=None, dtype="bfloat16", engine=engine))


def test_a_battery_without_one_keeps_the_recipes_graphs_on_cuda(on_cuda, doctor_engine):
    doctor_engine(["prefill_decode", "batch_invariance"])
    assert [k["enforce_eager"] for k in on_cuda] == [False]  # rollout.enforce_eager null: CUDA graphs, as training


def test_a_recipe_that_asks_graphs_gets_an_eager_engine_for_layers_only(on_cuda, doctor_engine):
    doctor_engine(["layers"], "rollout.enforce_eager=false")
    doctor_engine(["sampling"], "rollout.enforce_eager=false")
    assert [k["enforce_eager"] for k in on_cuda] == [True, False]
