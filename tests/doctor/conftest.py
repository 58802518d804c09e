"""Fixtures for the doctor's tests: the session's vLLM engine (tests/conftest.py) holding the tiny model's own
weights, and a ``Doctor`` on the demo recipe around it."""
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "grpo_tiny.yaml"


@pytest.fixture
def tiny_engine(vllm_engine, tiny_model_dir):
    """The shared engine with the tiny model's reference weights (a training test earlier in the session leaves its
    own), restored again afterwards."""
    from transformers import AutoModelForCausalLM

    from rollout.weight_export import full_weights

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16)
    vllm_engine.load_weights(full_weights(reference, dtype=torch.bfloat16))
    yield vllm_engine
    vllm_engine.load_weights(full_weights(reference, dtype=torch.bfloat16))


@pytest.fixture
def make_doctor(tmp_path):
    """``make_doctor(*sets, engine=None)``: a ``Doctor`` on the demo recipe with ``--set`` overrides."""
    from trainer.doctor.context import Doctor
    from trainer.lifecycle.preflight import load_recipe

    made = []

    def make(*sets, engine=None):
        cfg = load_recipe(RECIPE, [f"logging.run_dir={tmp_path / 'run'}", *sets])
        doc = Doctor(cfg, tmp_path / f"doctor{len(made)}", engine=engine, say=lambda _m: None)
        made.append(doc)
        return doc

    yield make
    for d in made:
        d.close()
