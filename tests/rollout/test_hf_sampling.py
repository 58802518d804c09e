"""rollout.hf_sampling: the HF engine truncates in vLLM's order (temperature, min-p, then top-k and top-p), not in
Transformers' (temperature, top-k, top-p, min-p): against a distribution worked by hand where the two orders keep
different sets, against vLLM's own top-k/top-p function, and through ``HFEngine.generate`` (its log-probs and the
kept sets it reports)."""
import math

import pytest
import torch

from rollout.hf_engine import HFEngine
from rollout.hf_sampling import truncate_like_vllm
from rollout.types import SamplingSpec

transformers = pytest.importorskip("transformers")
from transformers.generation.logits_process import (  # noqa: E402  (after the importorskip)
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

VOCAB = 96


def transformers_order(logits, *, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """What ``generate`` computes with its own warpers: temperature, top-k, top-p, min-p
    (transformers/generation/utils.py ``_get_logits_processor``)."""
    x = TemperatureLogitsWarper(temperature)(None, logits.float())
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(None, x)
    if min_p:
        x = MinPLogitsWarper(min_p)(None, x)
    return x


def test_min_p_before_top_p_keeps_the_set_worked_by_hand():
    # p = [0.45, 0.30, 0.15, 0.10], min_p 0.25 (threshold 0.25 * 0.45 = 0.1125), top_p 0.8.
    # vLLM: min-p drops 0.10; renormalised [0.5, 1/3, 1/6], ascending cumulative [1/6, 1/2, 1]: 1/6 <= 0.2 drops
    #   0.15 -> kept {0, 1}, log-probs log(0.45 / 0.75), log(0.30 / 0.75).
    # Transformers: top-p over the whole distribution, ascending cumulative [0.10, 0.25, 0.55, 1]: only 0.10 <= 0.2
    #   drops -> {0, 1, 2}; min-p keeps all three (0.15 >= 0.1125).
    p = torch.tensor([[0.45, 0.30, 0.15, 0.10]], dtype=torch.float64)
    logits = p.log().float()
    got = truncate_like_vllm(logits, temperature=1.0, top_p=0.8, min_p=0.25)
    assert torch.isfinite(got).tolist() == [[True, True, False, False]]
    lp = torch.log_softmax(got.double(), -1)[0, :2]
    torch.testing.assert_close(lp, torch.tensor([math.log(0.6), math.log(0.4)], dtype=torch.float64),
                               rtol=0, atol=1e-6)
    hf = transformers_order(logits, temperature=1.0, top_p=0.8, min_p=0.25)
    assert torch.isfinite(hf).tolist() == [[True, True, True, False]]


def test_temperature_comes_before_min_p():
    # at T = 2 the probabilities of [0.45, 0.30, 0.15, 0.10] become prop. to sqrt(p): [0.6708, 0.5477, 0.3873,
    # 0.3162] / 1.9221; min_p 0.5 keeps p_i >= 0.5 * p_max, i.e. sqrt(p_i) >= 0.3354: the first three (at T = 1
    # the threshold 0.225 would keep only the first two)
    logits = torch.tensor([[0.45, 0.30, 0.15, 0.10]]).log()
    assert torch.isfinite(truncate_like_vllm(logits, temperature=2.0, min_p=0.5)).tolist() == [[1, 1, 1, 0]]
    assert torch.isfinite(truncate_like_vllm(logits, temperature=1.0, min_p=0.5)).tolist() == [[1, 1, 0, 0]]


def test_top_k_and_top_p_are_vllms_own():
    sampling = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, VOCAB, generator=g)
    for top_k, top_p in ((5, 1.0), (0, 0.7), (20, 0.5), (VOCAB, 0.9)):
        k = torch.full((6,), top_k if top_k else VOCAB, dtype=torch.int32)
        p = torch.full((6,), top_p) if top_p < 1 else None
        theirs = sampling.apply_top_k_top_p_pytorch(logits.clone(), k if top_k else None, p)
        assert torch.equal(truncate_like_vllm(logits, temperature=1.0, top_k=top_k, top_p=top_p), theirs)


def test_off_is_temperature_only():
    logits = torch.randn(3, VOCAB)
    assert torch.equal(truncate_like_vllm(logits, temperature=0.5), logits / torch.tensor(0.5))
    with pytest.raises(ValueError, match="expected \\[B, V\\]"):
        truncate_like_vllm(logits[0], temperature=1.0)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    m = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # a peakier distribution than the default init, so the truncation keeps a few tokens
        m.lm_head.weight.mul_(8)
    return m


def test_the_engine_samples_and_reports_vllms_kept_sets(model):
    spec = SamplingSpec(n=4, temperature=0.9, top_p=0.8, min_p=0.1, max_new_tokens=12, seed=3)
    r = HFEngine(model, eos_ids=[]).generate([[1, 10, 11, 12], [1, 20], [1, 30, 31, 32, 33]], spec)
    differ = 0
    with torch.no_grad():
        for prompt, completion, support, lps in zip(r.prompt_ids, r.completion_ids, r.support, r.rollout_logprobs):
            z = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1:-1]  # [C, V], unpadded
            ours = truncate_like_vllm(z, temperature=spec.temperature, top_p=spec.top_p, min_p=spec.min_p)
            hf = transformers_order(z, temperature=spec.temperature, top_p=spec.top_p, min_p=spec.min_p)
            assert support.to_lists() == [torch.isfinite(row).nonzero().squeeze(1).tolist() for row in ours]
            want = torch.log_softmax(ours, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
            assert float((torch.tensor(lps) - want).abs().max()) < 1e-4
            differ += int((torch.isfinite(ours) != torch.isfinite(hf)).any(-1).sum())
    assert differ > 0  # the recipe's settings keep another set in Transformers' order at some of these positions
