"""rollout.engine_forward.EngineForward: the engine's CPU forward rerun outside it, compared bit for bit."""
import pytest
import torch

from rollout.engine_forward import EngineForward, check_supported
from rollout.types import SamplingSpec

PROMPTS = [[1, 5, 9, 13, 20, 30], [2, 7, 8], [3, 4, 11, 12, 14, 15, 16, 17, 18, 19, 21]]


@pytest.fixture(scope="module")
def engine_forward(vllm_engine, hf_reference):
    ef = EngineForward(vllm_engine, hf_reference.config)
    state = {k: v.detach() for k, v in hf_reference.state_dict().items()}
    if hf_reference.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    ef.set_weights(state)
    return ef


@pytest.mark.slow
def test_decoded_logprobs_topk_and_entropy_are_the_engines_bit_for_bit(restored_engine, engine_forward):
    # restored_engine: the reference weights engine_forward holds, whatever ran before on the session's engine
    r = restored_engine.generate(PROMPTS, SamplingSpec(n=3, temperature=0.8, max_new_tokens=12, seed=7, logprobs_topk=4))
    seqs = [p + c for p, c in zip(r.prompt_ids, r.completion_ids)]
    tops = [torch.tensor(t, dtype=torch.long) for t in r.topk_ids]
    lps, ents, top = engine_forward.logprobs(seqs, [len(p) for p in r.prompt_ids], temperature=0.8, topk_ids=tops)
    for k in range(len(seqs)):
        assert torch.equal(lps[k], torch.tensor(r.rollout_logprobs[k], dtype=torch.float32)), k
        assert torch.equal(top[k], torch.tensor(r.topk_logprobs[k], dtype=torch.float32)), k
        assert torch.isfinite(ents[k]).all() and (ents[k] >= 0).all()


@pytest.mark.slow
def test_prefill_scores_equal_and_batch_composition_does_not_matter(restored_engine, engine_forward):
    seqs = [PROMPTS[0] + [40, 41, 42, 43], PROMPTS[2] + [50, 51], PROMPTS[1] + [60, 61, 62, 63, 64, 65, 66]]
    scored = restored_engine.score(seqs)
    together = engine_forward.logprobs(seqs, [1] * len(seqs))
    for k, seq in enumerate(seqs):
        assert torch.equal(together[k], torch.tensor(scored.logprobs[k], dtype=torch.float32)), k
        alone = engine_forward.logprobs([seq], [1])[0]
        assert torch.equal(alone, together[k]), k
    # the same row at another place among other rows
    again = engine_forward.logprobs(seqs[::-1] + seqs[:1], [1] * 4)
    assert torch.equal(again[0], together[2]) and torch.equal(again[3], together[0])


def test_uncovered_architectures_are_refused_naming_what_is_missing():
    from transformers import Gemma2Config, LlamaConfig

    with pytest.raises(ValueError, match="model_type 'gemma2'"):
        check_supported(Gemma2Config())
    with pytest.raises(ValueError, match="rope_parameters.*plain RoPE"):
        check_supported(LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="hidden_act"):
        check_supported(LlamaConfig(hidden_act="gelu"))
    check_supported(LlamaConfig())


def test_mistral_with_a_sliding_window_is_refused_and_qwen2s_unused_window_is_not():
    from transformers import MistralConfig, Qwen2Config

    with pytest.raises(ValueError, match="sliding_window"):
        check_supported(MistralConfig(sliding_window=4096))
    check_supported(MistralConfig(sliding_window=None))
    check_supported(Qwen2Config(use_sliding_window=False, sliding_window=4096))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_invariant_linear_gives_a_row_the_same_bits_alone_and_anywhere_in_any_batch(dtype):
    """vLLM's CPU GEMM dispatch (oneDNN here) at SmolLM2's down_proj shape (K = 1536, where a lone row
    reduced differently on the development CPU), through the function both sides call."""
    from rollout.engine_forward import _prepared
    from rollout.vllm_plugins.exact_quant import invariant_linear

    g = torch.Generator().manual_seed(0)
    lin = _prepared((torch.randn(576, 1536, generator=g) * 0.05).to(dtype), None)
    x = torch.randn(300, 1536, generator=g).to(dtype)
    alone = [invariant_linear(lin.cpu_linear_fn, x[i:i + 1])[0] for i in (0, 5, 299)]
    for m in (2, 7, 64, 300):
        batch = invariant_linear(lin.cpu_linear_fn, x[:m])
        assert torch.equal(batch[0], alone[0]), m
        if m > 5:
            assert torch.equal(batch[5], alone[1]), m
    assert torch.equal(invariant_linear(lin.cpu_linear_fn, x)[299], alone[2])
    # a 3-D input keeps its shape
    assert invariant_linear(lin.cpu_linear_fn, x[:1].reshape(1, 1, 1536)).shape == (1, 1, 576)
    for m in (1, 2, 3, 4):  # the products of 1-4 rows a decode step has: each row as in a large batch
        assert torch.equal(invariant_linear(lin.cpu_linear_fn, x[:m]), invariant_linear(lin.cpu_linear_fn, x)[:m]), m


def test_invariant_linear_computes_fewer_than_min_rows_as_min_rows():
    """A GEMM whose kernel depends on the row count, as SGLang's on an AMX CPU (another kernel for M <= 4;
    rollout/vllm_plugins/exact_quant.py): through ``invariant_linear`` every product of 1-4 rows gets each row the
    bits of a large batch, and its own rows only, in its shape."""
    from rollout.vllm_plugins.exact_quant import MIN_ROWS, invariant_linear

    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    seen = []

    def by_count(rows):  # the small-M kernel rounds differently: a row's value depends on M
        seen.append(rows.shape[0])
        out = rows @ w.T
        return out if rows.shape[0] > 4 else out + 1e-3

    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    big = by_count(x)
    assert MIN_ROWS == 5
    for m in (1, 2, 3, 4):
        seen.clear()
        got = invariant_linear(by_count, x[:m].reshape(m, 1, 16))
        assert seen == [MIN_ROWS] and got.shape == (m, 1, 8) and torch.equal(got.reshape(m, 8), big[:m]), m
    seen.clear()
    assert torch.equal(invariant_linear(by_count, x), big) and seen == [9]
