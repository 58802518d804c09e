"""trainer.measurement.probe: the fixed-prompt parity probe, on an in-memory float32 model scored against itself."""
import pytest
import torch

from rollout.hf_engine import HFEngine
from trainer.config import RunConfig
from trainer.measurement.probe import Probe, probe_spec

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
    m = Probe(PROMPTS, cfg, pad_id=0, device="cpu")(engine, model)
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
    m = Probe(PROMPTS, cfg, pad_id=0, device="cpu")(HFEngine(other, eos_ids=[]), model)
    assert m["probe/mae"] > 1e-3


def test_probe_spec_is_fixed_and_follows_the_rollout_settings():
    cfg = RunConfig()
    cfg.rollout.temperature, cfg.parity.topk = 0.7, 4
    a, b = probe_spec(cfg), probe_spec(cfg)
    assert a == b and a.n == 1 and a.temperature == 0.7 and a.logprobs_topk == 4


class Counting(HFEngine):
    """The HF engine, counting decodes and prefills."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.generates = self.scores = 0

    def generate(self, prompt_ids, spec):
        self.generates += 1
        return super().generate(prompt_ids, spec)

    def score(self, sequences, topk=0):
        self.scores += 1
        return super().score(sequences, topk)


def test_probe_decodes_once_then_scores_the_fixed_sequences(model):
    cfg = RunConfig()
    cfg.rollout.max_new_tokens, cfg.parity.topk = 6, 2
    engine = Counting(model, eos_ids=[])
    probe = Probe(PROMPTS, cfg, pad_id=0, device="cpu")
    first, second = probe(engine, model), probe(engine, model)
    assert (engine.generates, engine.scores) == (1, 2)
    assert first == second and first["probe/num_tokens"] == 3 * 6 and first["probe/mae"] < 1e-4
    # the engine's prefill scores are log_softmax(logits) at T = 1 of exactly the fixed tokens
    f = probe.fixed
    seq = f.prompt_ids[0] + f.completion_ids[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=torch.tensor([seq])).logits[0, :-1].float(), -1)
    expect = ref.gather(-1, torch.tensor(seq[1:])[:, None])[len(PROMPTS[0]) - 1:, 0]
    torch.testing.assert_close(torch.tensor(probe._engine_scores(engine).rollout_logprobs[0]), expect)
    # a resumed run probes the same tokens: the sequences go through the checkpoint's state.json
    import json

    again = Probe(PROMPTS, cfg, pad_id=0, device="cpu")
    again.load_state_dict(json.loads(json.dumps(probe.state_dict())))
    assert again(engine, model) == first and engine.generates == 1


def test_probe_schedule_and_fit():
    from rollout.types import Rollouts
    from trainer.measurement.probe import _fit, due

    cfg = RunConfig()
    cfg.parity.probe_first, cfg.parity.probe_every = 2, 5
    assert [s for s in range(13) if due(cfg, s)] == [0, 1, 2, 5, 10]
    r = Rollouts(prompt_ids=[[1, 2, 3]], completion_ids=[[4, 5, 6, 7]], rollout_logprobs=[[-1.0] * 4],
                 finish_reasons=["stop"], group_size=1)
    cut = _fit(r, max_model_len=6)  # 3 prompt + 2 completion + the 1 token a scoring request samples
    assert cut.completion_ids == [[4, 5]] and cut.finish_reasons == ["length"] and _fit(r, None) is r
