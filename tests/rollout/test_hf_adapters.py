"""The HF engine serving the trainer's LoRA adapter: a PEFT model of its own, the adapter in float32 as the
trainer's, so both sides compute one function."""
import pytest
import torch

from parity.metrics import compare
from rollout.adapters import export_lora_adapter
from rollout.hf_engine import HFEngine
from rollout.types import SamplingSpec
from trainer.config import LoraConfig
from trainer.measurement.scoring import score_batch
from trainer.models.batch import batch_from_rollouts
from trainer.models.policy import add_lora, load_base_model

PROMPTS = [[1] + list(range(30 + 5 * i, 40 + 5 * i)) for i in range(4)]
SPEC = SamplingSpec(n=2, temperature=1.0, max_new_tokens=8, seed=5)


def _policy(model_dir, seed):
    p = add_lora(load_base_model(model_dir, "float32", "cpu"), LoraConfig())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in p.named_parameters():
            if "lora_B" in name:
                t.normal_(0, 0.05, generator=g)
    return p


def _mae(policy, rollouts):
    batch = batch_from_rollouts(rollouts, 0, "cpu")
    s = score_batch(policy, batch, micro_batch_size=16, temperature=1.0)
    return compare(s.logprobs, batch.rollout_logprobs, batch.mask)["parity/mae"]


def test_the_hf_engine_runs_each_adapter_version_as_the_trainer_does(tiny_model_dir):
    engine = HFEngine(tiny_model_dir, dtype="float32", serve_adapters=True)
    assert engine.adapter_dtype == torch.float32 and engine.adapter_version is None
    first, second = _policy(tiny_model_dir, 0), _policy(tiny_model_dir, 1)
    for version, policy in ((1, first), (2, second)):
        engine.load_adapter(export_lora_adapter(policy, version=version, dtype=engine.adapter_dtype))
        assert engine.adapter_version == version
        assert _mae(policy, engine.generate(PROMPTS, SPEC)) < 1e-5  # one function, float32
    assert _mae(first, engine.generate(PROMPTS, SPEC)) > 1e-3  # version 2 replaced version 1
    with pytest.raises(RuntimeError, match="would add the update a second time"):
        engine.load_weights([])


def test_an_engine_started_without_adapters_refuses_one(tiny_model_dir):
    engine = HFEngine(tiny_model_dir, dtype="float32")
    with pytest.raises(RuntimeError, match="serve_adapters=True"):
        engine.load_adapter(export_lora_adapter(_policy(tiny_model_dir, 0), version=1, dtype=torch.float32))
