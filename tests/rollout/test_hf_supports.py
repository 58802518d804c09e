"""The HF engine's kept sets under top-k / top-p / min-p, and the trainer normalising over exactly them: the two
sides' log-probs of the sampled tokens agree in float32; normalised over the whole vocabulary they would not."""
import pytest
import torch

from rollout.hf_engine import HFEngine
from rollout.types import SamplingSpec
from trainer.measurement.scoring import score_batch
from trainer.models.batch import batch_from_rollouts
from trainer.models.policy import in_sets, load_base_model

PROMPTS = [[1] + list(range(30 + 5 * i, 40 + 5 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_base_model(tiny_model_dir, "float32", "cpu")


@pytest.mark.parametrize("spec", [SamplingSpec(n=3, top_k=5, max_new_tokens=10, seed=1, temperature=1.3),
                                  SamplingSpec(n=3, top_p=0.7, max_new_tokens=10, seed=2),
                                  SamplingSpec(n=2, min_p=0.1, top_k=20, max_new_tokens=8, seed=3)])
def test_kept_sets_and_the_trainers_log_probs_over_them(model, spec):
    engine = HFEngine(model)
    r = engine.generate(PROMPTS, spec)
    assert len(r.support) == len(r) and all(len(s) == len(c) for s, c in zip(r.support, r.completion_ids))
    if spec.top_k:
        assert max(int(s.sizes.max()) for s in r.support if len(s)) <= spec.top_k
    batch = batch_from_rollouts(r, 0)
    lp = score_batch(model, batch, micro_batch_size=16, temperature=spec.temperature).logprobs
    m = batch.mask > 0
    assert float((lp - batch.rollout_logprobs)[m].abs().max()) < 1e-5
    batch.support = None  # the whole vocabulary instead: off by log(kept mass) wherever truncation removed any
    full = score_batch(model, batch, micro_batch_size=16, temperature=spec.temperature).logprobs
    assert float((full - batch.rollout_logprobs)[m].abs().max()) > 1e-3


def test_greedy_needs_no_kept_sets(model):
    r = HFEngine(model).generate(PROMPTS[:1], SamplingSpec(n=1, top_k=1, max_new_tokens=4))
    assert r.support == []


def test_in_sets_finds_each_id_in_its_positions_set():
    from rollout.support import Support

    s = Support.concat([Support.from_lists([[1, 4], [2]]), Support.from_lists([[0, 3, 9], []])])
    ids = torch.tensor([[[4, 2], [2, 1]], [[9, 3], [0, 0]]])
    assert in_sets(ids, (s.offsets, s.ids)).tolist() == [[[True, False], [True, False]],
                                                          [[True, True], [False, False]]]
