"""trainer.rl.probe: the fixed-prompt parity probe, on an in-memory float32 model scored against itself."""
import pytest
import torch

from rollout.hf_engine import HFEngine
from trainer.config import RunConfig
from trainer.rl.probe import probe_spec, run_probe

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg).eval()


PROMPTS = [[1, 10, 11, 12], [1, 20], [1, 30, 31, 32, 33]]


def test_probe_of_a_model_against_itself_is_exact_to_float32(model):
    cfg = RunConfig()
    cfg.rollout.max_new_tokens = 8
    cfg.parity.topk = 3
    engine = HFEngine(model, eos_ids=[])  # (sets eval mode)
    model.train()
    m = run_probe(engine, model, PROMPTS, cfg, pad_id=0, device="cpu")
    assert model.training  # mode restored
    assert m["probe/num_tokens"] == 3 * 8
    # generate (KV cache, left padding) vs one padded forward of the same float32 model
    assert m["probe/mae"] < 1e-4 and m["probe/max_abs"] < 1e-3
    assert 0 <= m["probe/topk_kl"] < 1e-6
    assert not any(k.startswith("parity/") for k in m)


def test_probe_sees_a_different_model(model):
    import copy

    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    cfg = RunConfig()
    cfg.rollout.max_new_tokens = 8
    m = run_probe(HFEngine(other, eos_ids=[]), model, PROMPTS, cfg, pad_id=0, device="cpu")
    assert m["probe/mae"] > 1e-3


def test_probe_spec_is_fixed_and_follows_the_rollout_settings():
    cfg = RunConfig()
    cfg.rollout.temperature, cfg.parity.topk = 0.7, 4
    a, b = probe_spec(cfg), probe_spec(cfg)
    assert a == b and a.n == 1 and a.temperature == 0.7 and a.logprobs_topk == 4
