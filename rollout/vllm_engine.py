"""vLLM as the rollout engine, in the trainer's own process.

One ``vllm.LLM`` built in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), fed
token ids, returning the log-prob of every sampled token *after* temperature,
top-k and top-p (``logprobs_mode="processed_logprobs"``: log_softmax of the
logits vLLM actually sampled from, i.e. renormalised over the kept tokens;
see ``vllm/v1/sample/ops/topk_topp_sampler.py``).

Tokenizer: none. The engine is started with ``skip_tokenizer_init=True`` by
default: token ids in, token ids out, and the trainer's tokenizer is the only
one (so the two sides can never disagree on a chat template or special
tokens). Stopping therefore does not rely on vLLM's tokenizer: the EOS ids of
the model's ``generation_config.json`` / ``config.json`` are passed as
``stop_token_ids``. ``load_tokenizer=True`` also fills ``completion_texts``.

Weight sync (``load_weights``) goes through vLLM's in-place
``reload_weights`` (``vllm/model_executor/model_loader/reload/``), with two
properties learnt from its source and checked in ``tests/rollout``:

- vLLM rebuilds a module from the shards it is given; for a fused module
  (``qkv_proj`` = q,k,v; ``gate_up_proj`` = gate,up) a missing shard comes back
  as uninitialised memory (the CPU backend even deletes the unpacked weight
  after repacking, so there is nothing to read back). Every update must
  therefore carry whole fused groups; ``load_weights`` refuses otherwise, and
  ``rollout.weight_export.merged_lora_weights`` adds the unchanged siblings.
- The prefix cache keeps KV blocks computed with the old weights; it is reset
  after every load (and after wake-up).
"""
from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Sequence

import torch

from rollout.base import LayerChunkUpdates
from rollout.types import Rollouts, SamplingSpec, Scored

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024**2
# vLLM's fused modules for Llama-family models, used if the model class cannot be asked.
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
# Partial reloads are routine here; these loggers warn about every module not in the update.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")
_MASK64 = (1 << 64) - 1


def validate_score_request(sequences: Sequence[Sequence[int]], max_model_len: int) -> None:
    """``score``'s sequences: 2 tokens at least (one to condition on), and room for the one token vLLM samples."""
    for k, seq in enumerate(sequences):
        if len(seq) < 2 or len(seq) + 1 > max_model_len:
            raise ValueError(f"score: sequences[{k}] has {len(seq)} tokens; expected 2 to "
                             f"{max_model_len - 1} (max_model_len - 1)")


def read_prompt_logprobs(seq: Sequence[int], positions: Sequence, topk: int, bad) -> tuple[list, list, list]:
    """One scored sequence from vLLM's prompt log-probs, as both engines receive them.

    ``positions[t]``: ``{token id: (logprob, rank)}`` of the actual token and the top ``topk`` by
    rank (``None`` at t = 0, which has nothing to condition on). Returns the log-probs of tokens
    1.. and, with ``topk``, each position's top-k ids and log-probs, most likely first.
    ``bad(msg)`` builds the exception for an answer that does not fit the sequence.
    """
    if positions is None or len(positions) != len(seq):
        raise bad(f"{None if positions is None else len(positions)} prompt log-prob positions for {len(seq)} tokens")
    lps, top_ids, top_lps = [], [], []
    for t in range(1, len(seq)):
        pos = positions[t] or {}
        if seq[t] not in pos:
            raise bad(f"position {t} has no log-prob for its token {seq[t]}")
        lps.append(pos[seq[t]][0])
        if topk:
            top = sorted((rank, tid, lp) for tid, (lp, rank) in pos.items() if rank <= topk)
            if len(top) != topk:
                raise bad(f"position {t}: {len(top)} top log-probs, expected {topk}")
            top_ids.append([tid for _, tid, _ in top])
            top_lps.append([lp for _, _, lp in top])
    return lps, top_ids, top_lps


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


def eos_token_ids(model_dir: str | Path) -> list[int]:
    """EOS ids of a local HF model dir: generation_config.json first, then config.json."""
    for fname in ("generation_config.json", "config.json"):
        path = Path(model_dir) / fname
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
    return []


def checkpoint_shapes(model_dir: str | Path) -> dict[str, tuple[int, ...]] | None:
    """Parameter name -> shape from a local safetensors checkpoint's headers (no tensor is read)."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                shapes[k] = tuple(sf.get_slice(k).get_shape())
    return shapes


def check_fused_groups(names: Iterable[str], packed: dict[str, list[str]]) -> None:
    """Refuse an update holding only part of a fused module (see module docstring).

    ``packed``: vLLM's ``packed_modules_mapping``, fused name -> HF shard names.
    A name ``<prefix>.<shard>.<param>`` with ``shard`` in a group needs every
    ``<prefix>.<sibling>.<param>`` of that group in the same update.
    """
    names = set(names)
    missing: list[str] = []
    for name in sorted(names):
        parts = name.split(".")
        if len(parts) < 2:
            continue
        for shards in packed.values():
            if parts[-2] in shards:
                siblings = [".".join(parts[:-2] + [s, parts[-1]]) for s in shards]
                missing += [s for s in siblings if s not in names and s not in missing]
    if missing:
        raise ValueError(
            f"named_tensors: vLLM fuses {sorted(packed)} and rebuilds a fused module from the shards it is sent, "
            f"so an update must contain all of them; missing {missing[:6]}{' ...' if len(missing) > 6 else ''} "
            "(rollout.weight_export.merged_lora_weights adds them)"
        )


def check_update(named: list[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]] | None, model: str,
                 packed: dict[str, list[str]]) -> None:
    """Refuse a weight update with duplicate names, names or shapes not in the checkpoint, or partial fused groups.

    Shared by every engine that takes HF-named tensors (in-process and server).
    ``shapes``: ``checkpoint_shapes(model)`` (None skips the name/shape checks).
    """
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError(f"named_tensors: duplicate names {sorted({n for n in names if names.count(n) > 1})[:6]}")
    if shapes is not None:
        unknown = [n for n in names if n not in shapes]
        if unknown:
            raise ValueError(f"named_tensors: unknown parameter names {unknown[:6]} (not in {model}'s "
                             f"checkpoint; expected HF names such as {next(iter(shapes))!r})")
        bad = [(n, tuple(t.shape), shapes[n]) for n, t in named if tuple(t.shape) != shapes[n]]
        if bad:
            raise ValueError(f"named_tensors: shape mismatch (name, given, expected): {bad[:4]}")
    check_fused_groups(names, packed)


@contextlib.contextmanager
def _preserve_rng():
    """Keep the trainer's RNG streams: in-process vLLM seeds random/numpy/torch at start-up
    (``set_random_seed``) and its CPU sampler draws from the global torch RNG every step."""
    import random

    import numpy as np

    py, npy = random.getstate(), np.random.get_state()
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


@contextlib.contextmanager
def _drop_log(logger_name: str, prefix: str, active: bool = True):
    """Silence one known-harmless message (with its traceback) from one vLLM logger."""
    logger, flt = logging.getLogger(logger_name), _DropMessage(prefix)
    if active:
        logger.addFilter(flt)
    try:
        yield
    finally:
        logger.removeFilter(flt)


@contextlib.contextmanager
def quiet_partial_reload():
    loggers = [logging.getLogger(n) for n in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def to_engine_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast a synced tensor to the engine dtype, except block-FP8 weights and their float32 scales.

    Hook for the CUDA FP8 recipes (``rollout.fp8_export.fp8_block_weights``): the
    engine's ``Fp8LinearMethod`` stores float8_e4m3fn weights and float32
    ``weight_scale_inv``; casting either to BF16 would corrupt them.
    """
    if t.dtype == torch.float8_e4m3fn or name.endswith(".weight_scale_inv"):
        return t
    return t.to(dtype)


def engine_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
                         ) -> list[tuple[str, torch.Tensor]]:
    """An update's (HF name, tensor) pairs, checked to be pairs and cast to the engine dtype (``to_engine_dtype``).

    Shared by every engine that takes HF-named tensors (in-process and server).
    """
    named = []
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError(f"named_tensors: expected (str, torch.Tensor) pairs, got {type(item).__name__}")
        named.append((item[0], to_engine_dtype(item[0], item[1].detach(), dtype)))
    return named


def _sampled_logprobs(completion, topk: int = 0):
    """(sampled-token log-probs, top-k ids, top-k log-probs) from vLLM's FlatLogprobs output.

    vLLM's sampler writes, per position, the sampled token first and then the top-k
    tokens in rank order (``Sampler.gather_logprobs``); FlatLogprobs keeps that run
    as is, duplicates included (``vllm/logprobs.py: append_logprobs_for_next_position``).
    """
    ids, lps = list(completion.token_ids), completion.logprobs
    if lps is None or len(lps) != len(ids):
        raise RuntimeError(f"vLLM returned {None if lps is None else len(lps)} log-prob positions for {len(ids)} tokens")
    if not hasattr(lps, "start_indices"):
        raise RuntimeError("expected vLLM FlatLogprobs (SamplingParams(flat_logprobs=True)); got a list of dicts")
    sampled, top_ids, top_lps = [], [], []
    for pos, tok in enumerate(ids):
        lo, hi = lps.start_indices[pos], lps.end_indices[pos]
        if hi - lo != 1 + topk or lps.token_ids[lo] != tok:
            raise RuntimeError(f"vLLM log-probs at position {pos}: expected the sampled token {tok} then {topk} top "
                               f"tokens, got ids {lps.token_ids[lo:hi]}")
        sampled.append(lps.logprobs[lo])
        if topk:
            top_ids.append(list(lps.token_ids[lo + 1:hi]))
            top_lps.append(list(lps.logprobs[lo + 1:hi]))
    return sampled, top_ids, top_lps


class VLLMEngine(LayerChunkUpdates):
    """In-process vLLM behind the ``rollout.base.RolloutEngine`` interface.

    model: local HF directory (or hub id when a network is available).
    dtype: weights/activations dtype, "bfloat16" default.
    max_model_len: prompt + completion token budget per sequence.
    kv_cache_memory_bytes: KV cache size on CPU (default 256 MiB; without it the
        CPU backend reserves ~92% of RAM). Ignored on CUDA.
    gpu_memory_utilization: fraction of GPU memory vLLM may use on CUDA. Ignored on CPU.
    seed: the engine's global seed (samples use per-request seeds, see ``sample_seed``).
    enforce_eager: skip graph capture / torch.compile (fast start; see bench/bench_rollout.py).
    enable_prefix_caching: share the prompt's KV across a group's n samples.
    max_num_seqs: sequences per scheduler step.
    eos_ids: stop tokens; default: the model dir's generation_config / config EOS ids.
    load_tokenizer: start vLLM's tokenizer and fill ``Rollouts.completion_texts``.
    enable_sleep_mode: CUDA only; needed for ``sleep()``/``wake_up()`` to free memory.
    llm_kwargs: passed to ``vllm.LLM`` as is.
    """

    _live = 0  # engines open in this process (close() tears the shared vLLM state down with the last)

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", max_model_len: int = 1024, seed: int = 0,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.5,
                 enforce_eager: bool = True, enable_prefix_caching: bool = True, max_num_seqs: int = 256,
                 eos_ids: Sequence[int] | None = None, load_tokenizer: bool = False,
                 enable_sleep_mode: bool = False, **llm_kwargs) -> None:
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len = {max_model_len!r}: expected an integer >= 2")
        self.model = str(model)
        self.dtype = dtype
        self.torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and hasattr(torch, dtype) else None
        if not isinstance(self.torch_dtype, torch.dtype):
            raise ValueError(f"dtype = {dtype!r}: expected a torch dtype name such as 'bfloat16', 'float16', 'float32'")
        self.max_model_len = max_model_len
        self.cuda = torch.cuda.is_available()
        self.load_tokenizer = load_tokenizer
        self.eos_ids = [int(e) for e in (eos_ids if eos_ids is not None else eos_token_ids(self.model))]
        self._shapes = checkpoint_shapes(self.model)

        if self.cuda:
            memory = {"gpu_memory_utilization": gpu_memory_utilization}
        else:
            kv = DEFAULT_CPU_KV_CACHE_BYTES if kv_cache_memory_bytes is None else int(kv_cache_memory_bytes)
            if kv < 1024**2:
                raise ValueError(f"kv_cache_memory_bytes = {kv_cache_memory_bytes!r}: expected at least 1 MiB")
            memory = {"kv_cache_memory_bytes": kv}
        # In-process engine: must be set before vllm is first imported.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._dist_was_initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        from vllm import LLM

        # Chunked prefill is off: vLLM 0.32 rewinds the per-request generator of a
        # seeded request whose prefill is split over steps (``gen.set_offset``), which
        # the CPU torch.Generator does not support -> RuntimeError as soon as a batch's
        # prompt tokens exceed max_num_batched_tokens (seen with 64 prompts x n=8).
        # Seeded requests are how rollouts stay reproducible, so prefill stays whole.
        llm_kwargs.setdefault("enable_chunked_prefill", False)
        # Without a tokenizer, vLLM's chat-template warm-up fails and logs a traceback: expected here.
        with _preserve_rng(), _drop_log("vllm.renderers.base", "Chat template warmup failed", not load_tokenizer):
            self._llm = LLM(self.model, dtype=dtype, max_model_len=max_model_len, seed=seed, enforce_eager=enforce_eager,
                            enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
                            skip_tokenizer_init=not load_tokenizer, logprobs_mode="processed_logprobs",
                            enable_sleep_mode=enable_sleep_mode and self.cuda, **memory, **llm_kwargs)
        VLLMEngine._live += 1
        self._sleep_enabled = enable_sleep_mode and self.cuda
        self.packed_modules = self._packed_modules()

    def _packed_modules(self) -> dict[str, list[str]]:
        try:
            mapping = self._llm.apply_model(lambda m: dict(getattr(type(m), "packed_modules_mapping", {}) or {}))[0]
        except Exception:  # noqa: BLE001 - any failure here only loses precision of a safety check
            mapping = None
        return {k: list(v) for k, v in (mapping or DEFAULT_PACKED_MODULES).items()}

    @property
    def llm(self):
        if self._llm is None:
            raise RuntimeError("VLLMEngine is closed")
        return self._llm

    # ---- generation -------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> Rollouts:
        """Sample ``spec.n`` completions per prompt; sample i answers prompt i // n.

        Each sample is its own request with seed ``sample_seed(spec.seed, spec.index_offset + i)``,
        so the same weights and spec give the same samples, whichever rank draws them.
        """
        validate_request(prompt_ids, spec, self.max_model_len)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for i, p in enumerate(prompt_ids):
            for j in range(spec.n):
                prompts.append(TokensPrompt(prompt_token_ids=list(p)))
                params.append(SamplingParams(
                    n=1, temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                    max_tokens=spec.max_new_tokens, logprobs=spec.logprobs_topk, flat_logprobs=True,
                    seed=sample_seed(spec.seed, spec.index_offset + i * spec.n + j), stop_token_ids=list(self.eos_ids),
                    detokenize=self.load_tokenizer))
        with _preserve_rng():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)

        completion_ids, logprobs, finish, texts, top_ids, top_lps = [], [], [], [], [], []
        for k, out in enumerate(outputs):
            c = out.outputs[0]
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"sample {k}: vLLM finished with reason {c.finish_reason!r}")
            completion_ids.append(list(c.token_ids))
            sampled, ids_k, lps_k = _sampled_logprobs(c, spec.logprobs_topk)
            logprobs.append(sampled)
            top_ids.append(ids_k)
            top_lps.append(lps_k)
            finish.append(c.finish_reason)
            texts.append(c.text or "")
        return Rollouts(
            prompt_ids=[list(prompt_ids[k // spec.n]) for k in range(len(outputs))],
            completion_ids=completion_ids, rollout_logprobs=logprobs, finish_reasons=finish,
            group_size=spec.n, completion_texts=texts if self.load_tokenizer else [],
            topk_ids=top_ids if spec.logprobs_topk else [], topk_logprobs=top_lps if spec.logprobs_topk else [],
        )

    def score(self, sequences: list[list[int]], topk: int = 0) -> Scored:
        """log p(x_t | x_<t) at temperature 1 of every token t >= 1 of each sequence: one prefill, no decoding.
        With ``topk``, also the k most likely tokens' ids and log-probs at each of those positions.

        vLLM's prompt log-probs (``SamplingParams.prompt_logprobs``) are log_softmax of the raw
        logits, whatever ``logprobs_mode`` (``gpu_model_runner._get_prompt_logprobs_dict``: prompt
        tokens skip the sampling processors), so they are compared with the trainer's at T = 1.
        Requests with prompt log-probs do not read the prefix cache. One token is sampled per
        request (vLLM needs one) and discarded.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        validate_score_request(sequences, self.max_model_len)
        prompts = [TokensPrompt(prompt_token_ids=list(seq)) for seq in sequences]
        params = [SamplingParams(n=1, max_tokens=1, temperature=1.0, prompt_logprobs=topk, seed=sample_seed(0, k),
                                 detokenize=False) for k in range(len(sequences))]
        with _preserve_rng():
            outputs = self.llm.generate(prompts, params, use_tqdm=False)

        def row(k: int, seq: list[int], plp):
            positions = None if plp is None else [
                None if pos is None else {tid: (lp.logprob, lp.rank) for tid, lp in pos.items()} for pos in plp]
            return read_prompt_logprobs(seq, positions, topk,
                                        lambda msg: RuntimeError(f"score: vLLM's answer for sequence {k}: {msg}"))

        return Scored.from_rows(row(k, seq, out.prompt_logprobs)
                                for k, (seq, out) in enumerate(zip(sequences, outputs)))

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the named parameters (HF names) in place; names not given keep their values.

        Each update must contain whole fused groups (see module docstring). Tensors are
        cast to the engine dtype. The prefix cache is reset afterwards.
        """
        named = engine_named_tensors(named_tensors, self.torch_dtype)
        if not named:
            return
        self._check_update(named)
        with quiet_partial_reload():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update (requests running?)")

    def _check_update(self, named: list[tuple[str, torch.Tensor]]) -> None:
        check_update(named, self._shapes, self.model, self.packed_modules)

    # ---- memory -----------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the engine's accelerator memory (level 1: weights offloaded, KV cache dropped).

        No-op on CPU (vLLM's CPU backend has no sleep mode). CUDA needs ``enable_sleep_mode=True``.
        """
        if not self.cuda:
            return
        if not self._sleep_enabled:
            raise RuntimeError("sleep(): construct VLLMEngine(..., enable_sleep_mode=True) to use sleep mode")
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        if not self.cuda:
            return
        if not self._sleep_enabled:
            raise RuntimeError("wake_up(): construct VLLMEngine(..., enable_sleep_mode=True) to use sleep mode")
        self.llm.wake_up()
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Shut the engine down and free its memory; safe to call twice."""
        if self._llm is None:
            return
        engine_core = getattr(self._llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            engine_core.shutdown()
        self._llm = None
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        # vLLM's model-parallel groups are process globals that every in-process engine shares: the
        # last engine to close tears them down (closing one of two engines would break the other:
        # "pipeline model parallel group is not initialized").
        VLLMEngine._live -= 1
        if VLLMEngine._live == 0:
            destroy_model_parallel()
            # Tear down the process group only if vLLM created it (never the trainer's own).
            if not self._dist_was_initialized:
                destroy_distributed_environment()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
