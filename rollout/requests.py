"""The rules of a request to any rollout engine: what ``generate`` and ``score`` accept, and each sample's seed.

Shared by every engine (``rollout.vllm_engine``, ``rollout.hf_engine``, ``rollout.server_engine``), so a
malformed batch is refused the same way whichever engine a recipe picks, and the same (seed, index)
gives the same per-request seed everywhere.
"""
from __future__ import annotations

from typing import Sequence

from rollout.types import SamplingSpec

_MASK64 = (1 << 64) - 1


def sample_seed(base: int, index: int) -> int:
    """A 31-bit per-sample seed from (base seed, sample index): SplitMix64 of the pair.

    Distinct indices give unrelated streams (no correlated noise between the
    samples of one batch), and a different ``base`` (the trainer uses one per
    step) gives a fresh set. Reference: Steele et al. 2014, "Fast splittable
    pseudorandom number generators" (SplitMix64 finaliser).
    """
    z = (int(base) * 0x9E3779B97F4A7C15 + int(index) + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & 0x7FFFFFFF


def validate_request(prompt_ids: Sequence[Sequence[int]], spec: SamplingSpec, max_model_len: int | None = None) -> None:
    """Refuse a malformed batch before it reaches an engine (shared by both engines)."""
    if not isinstance(spec, SamplingSpec):
        raise TypeError(f"spec: expected rollout.types.SamplingSpec, got {type(spec).__name__}")
    checks = [
        (isinstance(spec.n, int) and spec.n >= 1, "spec.n", spec.n, "an integer >= 1"),
        (spec.temperature > 0, "spec.temperature", spec.temperature, "a number > 0"),
        (0 < spec.top_p <= 1, "spec.top_p", spec.top_p, "a number in (0, 1]"),
        (isinstance(spec.top_k, int) and spec.top_k >= 0, "spec.top_k", spec.top_k, "an integer >= 0 (0 = off)"),
        (0 <= spec.min_p < 1, "spec.min_p", spec.min_p, "a number in [0, 1) (0 = off)"),
        (isinstance(spec.max_new_tokens, int) and spec.max_new_tokens >= 1, "spec.max_new_tokens",
         spec.max_new_tokens, "an integer >= 1"),
        (isinstance(spec.logprobs_topk, int) and spec.logprobs_topk >= 0, "spec.logprobs_topk", spec.logprobs_topk,
         "an integer >= 0 (0 = off)"),
        (isinstance(spec.index_offset, int) and spec.index_offset >= 0, "spec.index_offset", spec.index_offset,
         "an integer >= 0"),
    ]
    for ok, name, value, expected in checks:
        if not ok:
            raise ValueError(f"{name} = {value!r}: expected {expected}")
    if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
        raise ValueError(f"prompt_ids: expected a non-empty list of token-id lists, got {type(prompt_ids).__name__}"
                         f"{'' if not isinstance(prompt_ids, (list, tuple)) else ' (empty)'}")
    for i, p in enumerate(prompt_ids):
        if not isinstance(p, (list, tuple)) or not p or not all(isinstance(t, int) and t >= 0 for t in p):
            raise ValueError(f"prompt_ids[{i}]: expected a non-empty list of non-negative ints, got {p!r:.80}")
        if max_model_len is not None and len(p) + spec.max_new_tokens > max_model_len:
            raise ValueError(f"prompt_ids[{i}] has {len(p)} tokens; with spec.max_new_tokens = {spec.max_new_tokens} "
                             f"that exceeds the engine's max_model_len = {max_model_len}")
    if spec.sample_indices and (len(spec.sample_indices) != len(prompt_ids) * spec.n or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in spec.sample_indices)):
        raise ValueError(f"spec.sample_indices has {len(spec.sample_indices)} entries: expected one integer >= 0 per "
                         f"sample ({len(prompt_ids)} prompts x n = {spec.n})")


def validate_score_request(sequences: Sequence[Sequence[int]], max_model_len: int) -> None:
    """``score``'s sequences: 2 tokens at least (one to condition on), and room for the one token vLLM samples."""
    for k, seq in enumerate(sequences):
        if len(seq) < 2 or len(seq) + 1 > max_model_len:
            raise ValueError(f"score: sequences[{k}] has {len(seq)} tokens; expected 2 to "
                             f"{max_model_len - 1} (max_model_len - 1)")
