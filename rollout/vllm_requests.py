"""The ``vllm.SamplingParams`` the colocated engine sends: one rollout sample's, and one scored sequence's.

An engine started with vLLM's ``return_sampling_mask`` (CUDA, Model Runner V2: ``rollout.vllm_engine``'s
``sampling_supports``) refuses every request whose ``top_k`` is 0 or whose temperature is 0 ("sampling distribution
replay requires top_k > 0", ``vllm/v1/engine/input_processor.py: _validate_params``), whether or not the request
truncates: a top-p or min-p recipe, ``score()`` and the doctor's untruncated legs would all be refused before step 1.
Such an engine is therefore sent ``top_k`` = the vocabulary size where a request leaves top-k off (``engine_top_k``).
That is vLLM's own identity truncation, with the same numerics and speed as top-k 0, read from vLLM 0.32's source
(not run on a GPU by this project):

- Model Runner V2 (CUDA): ``SamplingStates.add_request`` (``vllm/v1/worker/gpu/sample/states.py``) stores any
  ``top_k <= 0`` or ``> vocab`` as the vocabulary size, so 0 and the vocabulary size are one state: the same
  ``needs_logits_processing``, and ``get_top_k_top_p`` skips top-k for a batch whose every top-k is the vocabulary
  size (the same kernels run). The V1 runner (the CPU build) does the same (``gpu_input_batch.py``: only
  ``0 < top_k < vocab`` joins ``top_k_reqs``).
- What it costs is the mask itself: every position of an untruncated request keeps the whole vocabulary, and vLLM
  returns that set (``SamplingMaskTensors.tolists``, ``vllm/v1/worker/gpu/sample/output.py``: a support wider than
  its 2048-id compact row is unpacked from the bitmask), ``vocab`` int32 ids per sampled token, dropped by the
  engine when it did not ask for supports. ``score()`` samples one token per sequence (600 KiB for a 152k
  vocabulary); the doctor's untruncated legs sample 8 x 24 tokens (~110 MiB at 152k). A truncated request's set is
  what the trainer needs anyway.

Temperature 0 is refused by every engine already (``rollout.requests.validate_request``: greedy decoding is top-k 1
at temperature 1, which vLLM's check accepts).
"""
from __future__ import annotations

from typing import Sequence

from rollout.requests import sample_seed
from rollout.types import SamplingSpec


def engine_top_k(top_k: int, *, vocab_size: int, sampling_mask: bool) -> int:
    """vLLM's ``top_k`` for a request asking ``top_k`` (0: off): as asked, except 0 on an engine that returns
    sampling masks, which refuses it; there the vocabulary size (the identity truncation, module docstring)."""
    if top_k == 0 and sampling_mask:
        if not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size = {vocab_size!r}: expected the engine's vocabulary size (an integer >= 1)")
        return vocab_size
    return top_k


def rollout_params(spec: SamplingSpec, sample: int, *, eos_ids: Sequence[int], detokenize: bool, vocab_size: int,
                   sampling_mask: bool):
    """Sample ``sample``'s request (``spec.sample_index`` gives its seed): the spec's sampling, its log-probs after
    temperature and truncation, stopping at ``eos_ids``."""
    # late: vLLM is imported only once the engine's process settings are made (rollout.vllm_engine.require_in_process)
    from vllm import SamplingParams

    return SamplingParams(
        n=1, temperature=spec.temperature, top_p=spec.top_p,
        top_k=engine_top_k(spec.top_k, vocab_size=vocab_size, sampling_mask=sampling_mask), min_p=spec.min_p,
        max_tokens=spec.max_new_tokens, logprobs=spec.logprobs_topk, flat_logprobs=True,
        seed=sample_seed(spec.seed, spec.sample_index(sample)), stop_token_ids=list(eos_ids), detokenize=detokenize)


def score_params(k: int, topk: int, *, vocab_size: int, sampling_mask: bool):
    """Scored sequence ``k``'s request: its prompt log-probs (and ``topk`` best), one token sampled at temperature 1
    and discarded (vLLM samples at least one)."""
    # late: vLLM is imported only once the engine's process settings are made (rollout.vllm_engine.require_in_process)
    from vllm import SamplingParams

    return SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=topk, seed=sample_seed(0, k),
                          top_k=engine_top_k(0, vocab_size=vocab_size, sampling_mask=sampling_mask), detokenize=False)
