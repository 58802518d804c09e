"""Every request the colocated engine sends passes vLLM's own admission check when the engine returns sampling masks
(CUDA: ``return_sampling_mask``), and top-k = the vocabulary size is vLLM's own identity truncation.

The requests are the ones the engine really builds: a ``VLLMEngine`` on a stand-in CUDA platform whose ``vllm.LLM``
records its requests (nothing of vLLM starts), then each recorded ``SamplingParams`` goes through vLLM's
``InputProcessor._validate_params`` (``vllm/v1/engine/input_processor.py``) built from the tiny model's real
``VllmConfig``. The CPU build cannot make a Model Runner V2 config (``_verify_sampling_replay_config`` needs it), so
the processor's model config gets ``return_sampling_mask = True`` set after it is built: the one field its check
reads, the one ``LLM(return_sampling_mask=True)`` sets on CUDA.
"""
import contextlib

import numpy as np
import pytest
import torch

import rollout.vllm_engine
import trainer.doctor.checks.prefix_cache as prefix_cache
from rollout.types import SamplingSpec
from rollout.vllm_engine import VLLMEngine
from rollout.vllm_requests import engine_top_k
from trainer.doctor.checks.sampling import PROBE_T

GENERATE = ("generate",)


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=tiny_model_dir, skip_tokenizer_init=True, max_model_len=128).create_engine_config()


@pytest.fixture(scope="module")
def admission(vllm_config):
    """vLLM's request check of an engine that returns sampling masks."""
    from vllm.v1.engine.input_processor import InputProcessor

    processor = InputProcessor(vllm_config)
    processor.model_config.return_sampling_mask = True
    return lambda params: processor._validate_params(params, GENERATE)


class Stop(Exception):
    pass


class RecordingLLM:
    """``vllm.LLM`` as the engine sees it: its options, its model config, and the requests it is sent."""

    def __init__(self, model, *, model_config, **kwargs):
        self.kwargs, self.model_config, self.requests = kwargs, model_config, []

    def apply_model(self, fn):
        return [None]

    def generate(self, prompts, params, use_tqdm=False, lora_request=None):
        self.requests += list(params)
        raise Stop


@pytest.fixture
def masked_engine(monkeypatch, tiny_model_dir, vllm_config):
    """The engine training starts for a truncated recipe on CUDA (``sampling_supports``), vLLM's LLM a recorder."""
    import vllm

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(rollout.vllm_engine, "check_engine_device", lambda llm, expected: None)
    monkeypatch.setattr(rollout.vllm_engine, "_preserve_rng", contextlib.nullcontext)
    monkeypatch.setattr(vllm, "LLM", lambda model, **k: RecordingLLM(model, model_config=vllm_config.model_config,
                                                                     **k))
    monkeypatch.setattr(VLLMEngine, "_live", VLLMEngine._live)
    engine = VLLMEngine(tiny_model_dir, max_model_len=64, gpu_memory_utilization=0.3, sampling_supports=True)
    assert engine.llm.kwargs["return_sampling_mask"] is True
    return engine


def _sent(engine, call) -> list:
    engine.llm.requests.clear()
    with pytest.raises(Stop):
        call()
    return list(engine.llm.requests)


# the specs the engine is sent: a top-p / min-p / top-k recipe's rollout (and the doctor's fixed batch and
# batch_invariance legs, which sample with the recipe's spec), the doctor's untruncated prefill_decode and sampling legs
SPECS = {
    "top_p only": dict(top_p=0.9),
    "min_p only": dict(min_p=0.05),
    "top_k": dict(top_k=20),
    "prefill_decode leg": dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0),
    "sampling leg": dict(temperature=PROBE_T, top_p=1.0, top_k=0, min_p=0.0),
}


@pytest.mark.parametrize("case", list(SPECS))
def test_every_rollout_request_passes_vllms_check_under_the_mask(case, masked_engine, admission):
    spec = SamplingSpec(n=2, max_new_tokens=4, seed=3, **SPECS[case])
    sent = _sent(masked_engine, lambda: masked_engine.generate([[1, 5, 9], [2, 4]], spec))
    assert len(sent) == 4
    for params in sent:
        admission(params)  # was: "sampling distribution replay requires top_k > 0" for every case but top_k
        assert (params.top_p, params.min_p, params.temperature) == (spec.top_p, spec.min_p, spec.temperature)
    assert {p.top_k for p in sent} == {spec.top_k or 512}  # the tiny model's vocabulary: top-k off


def test_score_requests_pass_vllms_check_under_the_mask(masked_engine, admission):
    """The probe before step 1, the layers check and batch_invariance's score legs all call ``score()``."""
    sent = _sent(masked_engine, lambda: masked_engine.score([[1, 5, 9, 2], [3, 4]], topk=2))
    assert len(sent) == 2
    for params in sent:
        admission(params)
        assert params.top_k == 512 and params.prompt_logprobs == 2 and params.temperature == 1.0


def test_the_prefix_cache_legs_pass_vllms_check_under_the_mask(masked_engine, admission):
    sent = _sent(masked_engine, lambda: prefix_cache._generate(masked_engine, [[1, 5, 9]], 0, read_cache=False))
    assert sent
    for params in sent:
        admission(params)


def test_the_check_refuses_top_k_off_under_the_mask(admission):
    """The refusal the engine's requests avoid is vLLM's, on this very check (it cannot pass by construction)."""
    from vllm import SamplingParams

    with pytest.raises(ValueError, match="requires top_k > 0"):
        admission(SamplingParams(temperature=1.0, top_p=0.9, max_tokens=1))
    with pytest.raises(ValueError, match="requires temperature > 0"):
        admission(SamplingParams(temperature=0.0, top_k=512, max_tokens=1))


def test_without_the_mask_requests_are_sent_as_asked(monkeypatch):
    assert engine_top_k(0, vocab_size=0, sampling_mask=False) == 0  # CPU, or no supports asked: unchanged
    assert engine_top_k(20, vocab_size=512, sampling_mask=True) == 20
    assert engine_top_k(0, vocab_size=512, sampling_mask=True) == 512
    with pytest.raises(ValueError, match="vocab_size = 0: expected the engine's vocabulary size"):
        engine_top_k(0, vocab_size=0, sampling_mask=True)


def test_top_k_vocab_is_model_runner_v2s_top_k_off(monkeypatch):
    """MRV2's sampling state (``vllm/v1/worker/gpu/sample/states.py``, CUDA's sampler) stores top-k = vocab as it
    stores top-k 0: the same per-request state, the same "needs processing" flag, and a batch of them applies no
    top-k at all. Its buffers are made without pinned memory here (the CPU has none), nothing else changed."""
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.states import SamplingStates

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    states = SamplingStates(max_num_reqs=4, vocab_size=512)
    flags = [states.add_request(i, SamplingParams(temperature=t, top_k=k))
             for i, (t, k) in enumerate([(1.0, 0), (1.0, 512), (0.7, 0), (0.7, 512)])]
    assert flags == [False, False, True, True]
    assert states.top_k.np.tolist() == [512] * 4
    top_k, top_p = states.get_top_k_top_p(torch.arange(4), np.arange(4))
    assert top_k is None and top_p is None
