"""rollout.hf_engine: layout, processed log-probs against a plain forward, EOS truncation, weights.

Fast tests use a float32 random Llama built in memory, where generate (KV cache,
left padding) and an unpadded forward agree to ~1e-5; the slow test checks the
BF16 session model.
"""
import pytest
import torch

from rollout.hf_engine import HFEngine
from rollout.types import SamplingSpec

transformers = pytest.importorskip("transformers")

VOCAB = 96


def abs_errors(a, b):
    """Flattened |a - b| over ragged [S][C_i] lists."""
    return torch.tensor([x - y for ra, rb in zip(a, b) for x, y in zip(ra, rb)]).abs()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a peakier distribution than the default init, so temperature matters
        m.lm_head.weight.mul_(20)
    return m


PROMPTS = [[1, 10, 11, 12], [1, 20], [1, 30, 31, 32, 33, 34, 35]]


def _masked_reference(model, r, temperature, top_k=0, top_p=1.0):
    """log_softmax of the top-k / top-p masked, temperature-scaled logits of an unpadded forward."""
    out = []
    with torch.no_grad():
        for p, c in zip(r.prompt_ids, r.completion_ids):
            ids = torch.tensor([p + c])
            z = model(ids).logits[0, len(p) - 1:-1].float() / temperature  # [C, V]
            if top_k:
                kth = z.topk(top_k, dim=-1).values[:, -1:]
                z = z.masked_fill(z < kth, float("-inf"))
            if top_p < 1.0:
                # HF's TopPLogitsWarper (and vLLM's apply_top_k_top_p): sort ascending and drop a token while
                # the cumulative mass up to and including it is <= 1 - top_p; the most likely token always stays.
                sorted_z, idx = z.sort(dim=-1, descending=False)
                drop_sorted = sorted_z.softmax(-1).cumsum(-1) <= 1 - top_p
                drop_sorted[:, -1] = False
                z = z.masked_fill(drop_sorted.scatter(-1, idx, drop_sorted), float("-inf"))
            out.append(torch.log_softmax(z, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1).tolist())
    return out


def test_layout_and_logprobs_match_forward(model):
    engine = HFEngine(model, eos_ids=[])  # no stop: every sample runs to max_new_tokens
    r = engine.generate(PROMPTS, SamplingSpec(n=3, temperature=0.7, max_new_tokens=10, seed=1))
    assert len(r) == 9 and r.group_size == 3
    assert r.prompt_ids == [PROMPTS[i // 3] for i in range(9)]
    assert r.finish_reasons == ["length"] * 9 and all(len(c) == 10 for c in r.completion_ids)
    err = abs_errors(r.rollout_logprobs, _masked_reference(model, r, 0.7))
    assert err.max() < 1e-4
    # Scored at T=1 instead, the log-probs are clearly different: the engine's are temperature-scaled.
    assert abs_errors(r.rollout_logprobs, _masked_reference(model, r, 1.0)).mean() > 0.1


def test_top_k_and_top_p_logprobs_are_renormalised(model):
    engine = HFEngine(model, eos_ids=[])
    greedy = engine.generate(PROMPTS, SamplingSpec(n=2, temperature=0.7, top_k=1, max_new_tokens=6, seed=0))
    # top_k=1 keeps one token; renormalised, its probability is 1 -> log-prob exactly 0.
    assert all(x == 0.0 for lp in greedy.rollout_logprobs for x in lp)
    r = engine.generate(PROMPTS, SamplingSpec(n=2, temperature=0.9, top_k=5, max_new_tokens=8, seed=0))
    assert abs_errors(r.rollout_logprobs, _masked_reference(model, r, 0.9, top_k=5)).max() < 1e-4
    r = engine.generate(PROMPTS, SamplingSpec(n=2, temperature=0.9, top_p=0.8, max_new_tokens=8, seed=0))
    assert abs_errors(r.rollout_logprobs, _masked_reference(model, r, 0.9, top_p=0.8)).max() < 1e-4
    # Renormalisation is real: the unmasked log-probs are lower.
    assert abs_errors(r.rollout_logprobs, _masked_reference(model, r, 0.9)).max() > 1e-3


def test_truncates_after_the_first_eos(model):
    eos = list(range(3, VOCAB, 2))  # half the vocabulary stops: nearly every sample stops early
    engine = HFEngine(model, eos_ids=eos)
    r = engine.generate(PROMPTS, SamplingSpec(n=4, temperature=1.0, max_new_tokens=12, seed=2))
    assert "stop" in r.finish_reasons
    for c, lp, f in zip(r.completion_ids, r.rollout_logprobs, r.finish_reasons):
        assert len(lp) == len(c) and not set(c[:-1]) & set(eos)
        assert (f == "stop") == (c[-1] in eos)
        if f == "length":
            assert len(c) == 12
    # Padding written after a finished row is not returned; the log-probs still match a forward.
    assert abs_errors(r.rollout_logprobs, _masked_reference(model, r, 1.0)).max() < 1e-4


def test_reproducible_and_leaves_the_callers_rng_alone(model):
    engine = HFEngine(model, eos_ids=[2])
    spec = SamplingSpec(n=2, temperature=1.0, max_new_tokens=8, seed=4)
    torch.manual_seed(99)
    expected = torch.rand(2)
    torch.manual_seed(99)
    a = engine.generate(PROMPTS, spec)
    assert torch.equal(torch.rand(2), expected)
    b = engine.generate(PROMPTS, spec)
    assert a.completion_ids == b.completion_ids and a.rollout_logprobs == b.rollout_logprobs
    c = engine.generate(PROMPTS, SamplingSpec(n=2, temperature=1.0, max_new_tokens=8, seed=5))
    assert c.completion_ids != a.completion_ids
    chunked = HFEngine(model, eos_ids=[2], max_batch_size=4).generate(PROMPTS, spec)
    assert len(chunked) == 6 and chunked.prompt_ids == a.prompt_ids


def test_model_generation_config_defaults_do_not_leak(model):
    saved = model.generation_config
    model.generation_config = transformers.GenerationConfig(repetition_penalty=5.0, top_k=3, eos_token_id=2)
    try:
        engine = HFEngine(model, eos_ids=[])
        r = engine.generate(PROMPTS, SamplingSpec(n=1, temperature=0.7, max_new_tokens=8, seed=0))
        assert abs_errors(r.rollout_logprobs, _masked_reference(model, r, 0.7)).max() < 1e-4
        assert model.generation_config.repetition_penalty == 5.0  # restored
    finally:
        model.generation_config = saved


def test_load_weights(model):
    import copy

    m = copy.deepcopy(model)
    engine = HFEngine(m, eos_ids=[])
    new = torch.full_like(m.model.layers[0].self_attn.q_proj.weight, 0.5, dtype=torch.bfloat16)
    engine.load_weights([("model.layers.0.self_attn.q_proj.weight", new)])
    assert torch.equal(m.model.layers[0].self_attn.q_proj.weight, torch.full_like(new, 0.5, dtype=torch.float32))
    assert torch.equal(m.model.layers[0].self_attn.k_proj.weight, model.model.layers[0].self_attn.k_proj.weight)
    with pytest.raises(ValueError, match="unknown parameter names"):
        engine.load_weights([("model.layers.0.self_attn.qkv_proj.weight", new)])
    with pytest.raises(ValueError, match="shape mismatch"):
        engine.load_weights([("lm_head.weight", new)])


def test_rejects_bad_requests(model):
    engine = HFEngine(model)
    with pytest.raises(ValueError, match="spec.temperature"):
        engine.generate(PROMPTS, SamplingSpec(temperature=0.0))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([[1] * 125], SamplingSpec(max_new_tokens=8))  # 125 + 8 > 128 positions
    with pytest.raises(TypeError, match="model"):
        HFEngine(object())


@pytest.mark.slow
def test_bf16_session_model_matches_forward(tiny_model_dir, hf_reference, prompts, hf_logprobs):
    engine = HFEngine(tiny_model_dir, dtype="bfloat16")
    r = engine.generate(prompts, SamplingSpec(n=4, temperature=0.7, max_new_tokens=32, seed=3))
    err = abs_errors(r.rollout_logprobs, hf_logprobs(hf_reference, r.prompt_ids, r.completion_ids, 0.7))
    print(f"HF engine (BF16, left-padded, KV cache) vs HF forward, T=0.7: MAE {err.mean():.4g}, max {err.max():.4g}")
    assert err.mean() < 0.02  # same bound as vLLM's (tests/rollout/test_vllm_engine.py)


def _full_logprobs(model, r, temperature):
    """[S][C_i, V] log_softmax(logits / T) of an unpadded forward at every completion position."""
    out = []
    with torch.no_grad():
        for p, c in zip(r.prompt_ids, r.completion_ids):
            z = model(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float() / temperature
            out.append(torch.log_softmax(z, -1))
    return out


def test_topk_logprobs_are_the_distributions_top_k(model):
    engine = HFEngine(model, eos_ids=[])
    r = engine.generate(PROMPTS, SamplingSpec(n=2, temperature=0.8, max_new_tokens=6, seed=2, logprobs_topk=4))
    assert r.topk == 4 and len(r.topk_ids) == len(r)
    for full, ids, lps, sampled in zip(_full_logprobs(model, r, 0.8), r.topk_ids, r.topk_logprobs, r.rollout_logprobs):
        ids, lps = torch.tensor(ids), torch.tensor(lps)  # [C, 4]
        ref_v, ref_i = full.topk(4, dim=-1)
        assert torch.equal(ids, ref_i)
        torch.testing.assert_close(lps, ref_v, atol=1e-4, rtol=0)
        assert bool((lps[:, :-1] >= lps[:, 1:]).all())  # most likely first
        assert bool((torch.tensor(sampled) <= lps[:, 0] + 1e-6).all())
    plain = engine.generate(PROMPTS, SamplingSpec(n=2, temperature=0.8, max_new_tokens=6, seed=2))
    assert plain.topk == 0 and plain.topk_ids == [] and plain.completion_ids == r.completion_ids
