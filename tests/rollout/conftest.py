"""Fixtures for the engine tests: an HF reference of the session's tiny model, a scorer, weight restoring.

The tiny model and the one vLLM engine of the session come from tests/conftest.py
(``tiny_model_dir``, ``vllm_engine``).
"""
import pytest
import torch


def forward_logprobs(model, prompt_ids, completion_ids, temperature):
    """Log-prob of each completion token under log_softmax(logits / T) of a plain HF forward.

    prompt_ids, completion_ids: [S][P_i], [S][C_i]. Returns [S][C_i] float lists.
    One unpadded forward per sample: no padding or KV-cache effects in the reference.
    """
    out = []
    with torch.no_grad():
        for p, c in zip(prompt_ids, completion_ids):
            ids = torch.tensor([list(p) + list(c)], device=model.device)
            logits = model(ids).logits[0, len(p) - 1:len(p) + len(c) - 1].float() / temperature
            lp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, len(p):, None]).squeeze(-1)
            out.append(lp.cpu().tolist())
    return out


@pytest.fixture(scope="session")
def hf_logprobs():
    """``forward_logprobs`` as a fixture (test modules do not import conftest)."""
    return forward_logprobs


def check_score_is_a_prefill(engine, hf_reference, prompts, mae_bound: float) -> None:
    """``engine.score`` (the probe's engine side): log p(x_t | x_<t) of given sequences at T = 1, unscaled.

    Its completion part is compared with HF's forward at T = 1 (within ``mae_bound``) and at the
    sampling temperature 0.7 (10x further: the scores are not the processed log-probs); top-k
    rows are distinct, most likely first, and bound the actual token's log-prob.
    """
    from rollout.types import SamplingSpec

    r = engine.generate(prompts[:4], SamplingSpec(n=1, temperature=0.7, max_new_tokens=12, seed=5))
    seqs = [p + c for p, c in zip(r.prompt_ids, r.completion_ids)]
    scored = engine.score(seqs, topk=3)
    assert [len(x) for x in scored.logprobs] == [len(s) - 1 for s in seqs]
    completion = torch.tensor([x for lp, p in zip(scored.logprobs, r.prompt_ids) for x in lp[len(p) - 1:]])

    def err(t):
        return (completion - torch.tensor([x for lp in forward_logprobs(hf_reference, r.prompt_ids, r.completion_ids, t)
                                           for x in lp])).abs().mean()

    at_1, at_07 = err(1.0), err(0.7)
    print(f"{type(engine).__name__} prefill scores vs HF forward, T=1: MAE {at_1:.4g} (at T=0.7: {at_07:.4g}) "
          f"over {len(completion)} tokens")
    assert at_1 < mae_bound and at_07 > 10 * at_1
    for ids, lps, lp in zip(scored.topk_ids[0], scored.topk_logprobs[0], scored.logprobs[0]):
        assert len(ids) == 3 == len(set(ids)) and lps == sorted(lps, reverse=True) and lp <= lps[0] + 1e-6
    assert engine.score(seqs[:1]).topk_ids == [[]]
    with pytest.raises(ValueError, match="sequences\\[0\\] has 1 tokens"):
        engine.score([[1]])


@pytest.fixture(scope="session")
def score_check():
    """``check_score_is_a_prefill`` as a fixture (test modules do not import conftest)."""
    return check_score_is_a_prefill


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dir):
    """The session's tiny model in Transformers, BF16 like the engine. Tests must not modify it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()


@pytest.fixture(scope="session")
def perturbed_copy():
    """``f(model, names, scale, seed)``: a deep copy of ``model`` with the named parameters moved by seeded noise of
    ``scale`` times each one's std (a "trained" model the engine does not hold yet)."""
    import copy

    def make(model, names, scale, seed):
        g = torch.Generator().manual_seed(seed)
        out = copy.deepcopy(model)
        params = dict(out.named_parameters())
        with torch.no_grad():
            for n in names:
                p = params[n]
                p.add_((torch.randn(p.shape, generator=g) * scale * p.float().std()).to(p.dtype))
        return out

    return make


@pytest.fixture
def restored_engine(vllm_engine, hf_reference):
    """The shared engine holding the reference weights: reloaded before the test (a training test that ran
    earlier in the session leaves its trained weights: pytest's order must not matter) and afterwards."""
    from rollout.weight_export import full_weights

    vllm_engine.load_weights(full_weights(hf_reference, dtype=torch.bfloat16))
    yield vllm_engine
    vllm_engine.load_weights(full_weights(hf_reference, dtype=torch.bfloat16))


@pytest.fixture(scope="session")
def prompts():
    """Eight prompts of different lengths over the tiny vocabulary (ids 6..511, no special tokens)."""
    g = torch.Generator().manual_seed(123)
    return [[1] + torch.randint(6, 512, (4 + 3 * i,), generator=g).tolist() for i in range(8)]
