"""The colocated vLLM engine serving the trainer's LoRA adapter (slow: the session's engine, started to serve
rank-16 adapters on every linear of the tiny model, tests/conftest.py)."""
import copy
from pathlib import Path

import pytest
import torch

from parity.lora import merged_lora_weight
from parity.merge_cost import merge_cost_metrics, merge_cost_sums
from parity.metrics import compare
from rollout.adapters import export_lora_adapter
from rollout.types import SamplingSpec
from rollout.weight_export import iter_merged_lora_weights
from trainer.config import LoraConfig
from trainer.measurement.scoring import score_batch
from trainer.models.batch import batch_from_rollouts
from trainer.models.policy import add_lora, load_base_model

pytestmark = pytest.mark.slow

PROMPTS = [[1] + list(range(40 + 7 * i, 64 + 7 * i)) for i in range(8)]
SPEC = SamplingSpec(n=4, temperature=1.0, max_new_tokens=20, seed=11)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    p = add_lora(load_base_model(tiny_model_dir, "bfloat16", "cpu"), LoraConfig())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in p.named_parameters():
            if "lora_B" in name:
                t.normal_(0, 0.02, generator=g)
    return p


def _trainer_lp(model, rollouts):
    batch = batch_from_rollouts(rollouts, 0, "cpu")
    return score_batch(model, batch, micro_batch_size=32, temperature=1.0).logprobs, batch


def test_the_served_adapter_is_the_trainers_and_survives_a_merged_update(vllm_engine, policy):
    e = vllm_engine
    e.load_adapter(export_lora_adapter(policy, version=1, dtype=e.adapter_dtype))
    served = e.generate(PROMPTS, SPEC)
    lp_t, batch = _trainer_lp(policy, served)
    with_adapter = compare(lp_t, batch.rollout_logprobs, batch.mask)
    with policy.disable_adapter():
        without = compare(_trainer_lp(policy, served)[0], batch.rollout_logprobs, batch.mask)
    # the engine ran the adapter: against the trainer with it, the BF16 floor; without it, the adapter's whole effect
    assert with_adapter["parity/mae"] < 0.02 and without["parity/mae"] > 5 * with_adapter["parity/mae"]
    first = served.completion_ids
    old_dir = Path(e._adapter.request.lora_path)
    # a merged update replaces the base weights; the next adapter is served over the restored base
    e.load_weights(iter_merged_lora_weights(policy, dtype=torch.bfloat16))
    assert e.adapter_version is None
    e.load_adapter(export_lora_adapter(policy, version=2, dtype=e.adapter_dtype))
    assert e.adapter_version == 2 and not old_dir.exists()  # the previous version's files are gone
    assert e.generate(PROMPTS, SPEC).completion_ids == first
    # the probe's prompt log-probs under an adapter (vLLM's LoRA logits wrapper would break them: lora_options)
    scored = e.score([served.prompt_ids[0] + served.completion_ids[0]])
    assert len(scored.logprobs[0]) == len(served.prompt_ids[0]) + len(served.completion_ids[0]) - 1


def _engine_q_delta(model):
    """Layer 0's q_proj LoRA update as vLLM's LoRA layer holds it (slot 0; scaling folded into B at load)."""
    qkv = model.model.layers[0].self_attn.qkv_proj
    return (qkv.lora_b_stacked[0][0, 0].float() @ qkv.lora_a_stacked[0][0, 0].float()).clone()


def test_a_small_update_reaches_the_engine_as_an_adapter_and_is_mostly_lost_merged(vllm_engine, policy):
    """An update of the size a 5e-5 learning rate makes (lora_B ~ 2e-5): the engine's adapter holds it to BF16's
    relative precision; a BF16 merge of the same update moves few weights (sync/merge_* on the same module)."""
    e = vllm_engine
    small = copy.deepcopy(policy)
    with torch.no_grad():
        for name, t in small.named_parameters():
            if "lora_B" in name:
                t.mul_(1e-3)
    e.load_adapter(export_lora_adapter(small, version=3, dtype=e.adapter_dtype))
    e.generate(PROMPTS[:1], SPEC)  # vLLM copies an adapter into its layers when a request first uses it
    q = small.base_model.model.model.layers[0].self_attn.q_proj
    want = q.scaling["default"] * (q.lora_B["default"].weight.float() @ q.lora_A["default"].weight.float())
    got = e.llm.apply_model(_engine_q_delta)[0][: want.shape[0], : want.shape[1]]
    adapter_err = float((got - want).norm() / want.norm())
    merged = merge_cost_metrics(merge_cost_sums(q.get_base_layer().weight, merged_lora_weight(q), torch.bfloat16))
    assert adapter_err < 2e-2, adapter_err  # B and A rounded to BF16: ~2**-8 each
    assert merged["sync/merge_update_error"] > 0.3 and merged["sync/merge_unchanged_frac"] > 0.5, merged


def test_an_adapter_above_the_engines_rank_is_refused(vllm_engine, tiny_model_dir):
    big = add_lora(load_base_model(tiny_model_dir, "bfloat16", "cpu"), LoraConfig(r=32))
    with pytest.raises(ValueError, match="max_lora_rank 16"):
        vllm_engine.load_adapter(export_lora_adapter(big, version=9, dtype=torch.bfloat16))
