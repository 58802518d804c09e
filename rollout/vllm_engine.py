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
  after every load (and after wake-up), and the first generate after each checks
  that it was (``rollout.stale_kv``).
- The reload copies each layer's new values into its original storage
  (``layerwise.py: _copy_and_restore_kernel_tensors``, "preserves cudagraph refs"): every parameter
  keeps its address across a sync, so CUDA graphs captured at start stay valid and the engine runs
  them on CUDA by default (``enforce_eager=None``: eager on CPU, where compiling costs more than it
  saves). ``tests/rollout/test_vllm_engine.py`` checks the addresses on the CPU engine.

Memory on CUDA (``enable_sleep_mode``): ``release_memory()`` before the trainer's update puts vLLM to
sleep at level 1 (``LLM.sleep``: weights copied to pinned host memory, KV cache dropped; vLLM's cumem
allocator, ``device_allocator/cumem.py``); the next update wakes the weights first, loads into them and
wakes the KV cache after it (``LLM.wake_up(tags=...)``), so the trainer's update never shares the GPU
with the KV cache and the load never shares it with the merged chunk and the KV cache at once; a
``generate`` or ``score`` wakes whatever still sleeps. vLLM resumes scheduling only once every tag is
awake (``v1/engine/core.py: wake_up``).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from rollout.adapters import LoraAdapter
from rollout.base import EngineCannotLoad, InProcessEngine, one_line
from rollout.cpu_amx import request_amx_permission
from rollout.device_placement import check_engine_device, keep_current_device, placement_options
from rollout.fp8_weights import check_block_fp8_update, check_engine_fp8_layers, engine_fp8_layers
from rollout.model_files import checkpoint_shapes, eos_token_ids, has_vision_tower
from rollout.moe_config import is_moe, moe_shape, route_shape
from rollout.prompt_logprobs import read_prompt_logprobs
from rollout.requests import validate_request, validate_score_request
from rollout.routes import NO_ROUTE, ROUTE_DTYPE
from rollout.stale_kv import StaleKVAlarm
from rollout.support import Support
from rollout.types import Rollouts, SamplingSpec, Scored
from rollout.vllm_adapters import ServedAdapter, lora_options
from rollout.vllm_image_capture import ImageCapture
from rollout.vllm_plugins.route_capture import install_route_capture, reset_routes, take_routes
from rollout.vllm_plugins.support_capture import begin_supports, take_supports
from rollout.vllm_requests import engine_top_k, rollout_params, score_params
from rollout.vllm_workspace import engine_workspace, guard_generate
from rollout.weight_updates import DEFAULT_PACKED_MODULES, check_update, engine_named_tensors, quiet_partial_reload

DEFAULT_CPU_KV_CACHE_BYTES = 256 * 1024**2
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
SLEEP_TAGS = ("weights", "kv_cache")  # what LLM.sleep(level=1) frees (vllm/v1/executor/abstract.py: SLEEP_TAGS)


@contextlib.contextmanager
def _engine_core_keeps_process_groups():
    """vLLM 0.32's ``EngineCore.shutdown`` ends with ``cleanup_dist_env_and_memory()`` (``vllm/v1/engine/core.py``):
    it destroys the model-parallel groups and the distributed environment of the whole process, whatever other
    in-process engine still uses them (and a trainer's own process group with them). ``close`` decides that itself
    (the last engine, and only a group vLLM created), so the core's call is reduced to its memory release."""
    import vllm.v1.engine.core as core

    cleanup = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = lambda *a, **k: gc.collect()
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = cleanup


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


# vLLM warns once, when an adapter request meets an engine holding a tokenizer, that per-adapter tokenizers are
# deprecated: parityrl's adapters never bring one (the base model's tokenizer serves every request)
_ADAPTER_TOKENIZER_NOTE = _DropMessage("vLLM has deprecated support for supporting different tokenizers")


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


def require_in_process() -> None:
    """The engine must run in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING`` defaults to 0 here, and any other
    value is refused. Set before vLLM is first imported (``vllm/envs.py`` reads it when the engine starts)."""
    value = os.environ.setdefault(MULTIPROCESSING_ENV, "0")
    try:
        in_process = int(value) == 0  # vLLM's own parsing: bool(int(...))
    except ValueError:
        in_process = False
    if not in_process:
        raise ValueError(
            f"{MULTIPROCESSING_ENV} = {value!r}: expected 0 (unset it) for the colocated engine. With it, vLLM runs "
            "the model in a separate engine-core process, and every weight sync (reload_weights through "
            "collective_rpc, rollout.vllm_engine) would copy the trainer's tensors across that process boundary, "
            "while the route capture and exact mode read the model in place. A separate vLLM process is "
            "rollout.mode: server (`parityrl serve`)")


def memory_options(cuda: bool, kv_cache_memory_bytes: int | None, gpu_memory_utilization: float | None) -> dict:
    """``vllm.LLM``'s memory arguments. The KV cache is ``kv_cache_memory_bytes`` wherever it is given (CPU:
    256 MiB when not: the CPU backend would otherwise reserve ~92% of RAM). On CUDA vLLM then reserves the
    weights, that cache and its activation / graph buffers (``gpu_worker.py: determine_available_memory``),
    and ``gpu_memory_utilization`` is only its start-up check (``v1/worker/utils.py: request_memory``: it
    starts when that share of the GPU is free); without a KV size, vLLM gives the KV cache the rest of that
    share. The one default of the share is the recipe's (``rollout.gpu_memory_utilization``): none here."""
    kv = kv_cache_memory_bytes
    if kv is None and not cuda:
        kv = DEFAULT_CPU_KV_CACHE_BYTES
    if kv is not None and int(kv) < 1024**2:
        raise ValueError(f"kv_cache_memory_bytes = {kv_cache_memory_bytes!r}: expected at least 1 MiB")
    memory = {} if kv is None else {"kv_cache_memory_bytes": int(kv)}
    if cuda:
        if gpu_memory_utilization is None:
            raise ValueError("gpu_memory_utilization = None on CUDA: expected the share of the GPU the engine may "
                             "take, the recipe's rollout.gpu_memory_utilization (trainer.config.RolloutConfig holds "
                             "its default)")
        memory["gpu_memory_utilization"] = float(gpu_memory_utilization)
    return memory


def image_options(max_images: int, settings: dict | None = None) -> dict:
    """VLLMEngine options for prompts with images: room for ``max_images`` per prompt (vLLM's own default, 999,
    sizes its start-up profiling for that many); the tokenizer, which vLLM's multimodal processor renders the
    placeholders with; normalisation in the front end (``mm_device_do_normalize`` off: the pixels the engine core
    receives, and ``rollout.vllm_image_capture`` fingerprints, are then the normalised tensor a Transformers processor
    gives, on every model; vLLM's default moves it into the vision tower for Qwen-VL and a few others). ``settings``:
    the run's image processor settings (``data.image_processor``), which vLLM passes to its processor call
    (``mm_processor_kwargs``) as the trainer passes them to its own."""
    return {"limit_mm_per_prompt": {"image": int(max_images)}, "load_tokenizer": True, "mm_device_do_normalize": False,
            **({"mm_processor_kwargs": dict(settings)} if settings else {})}


def route_options(cuda: bool, enable_prefix_caching: bool) -> dict:
    """What an engine that returns routes asks of vLLM. On CPU the project's capture (``route_capture``) sees
    only the tokens a forward computes, so prefix caching goes off (a cached token would have no route). On
    CUDA vLLM's own capture (Model Runner V2's AuxOutput connector) keeps routes per KV block and drops them
    with the prefix cache; it requires prefix caching (``config/vllm.py: _verify_aux_output_compatibility``),
    which therefore stays as asked."""
    if cuda:
        return {"enable_prefix_caching": enable_prefix_caching, "enable_return_routed_experts": True}
    return {"enable_prefix_caching": False}


class VLLMEngine(InProcessEngine):
    """In-process vLLM behind the ``rollout.base.RolloutEngine`` interface.

    model: local HF directory (or hub id when a network is available).
    dtype: weights/activations dtype, "bfloat16" default.
    max_model_len: prompt + completion token budget per sequence.
    kv_cache_memory_bytes: the KV cache's size (``memory_options``; CPU default 256 MiB; CUDA: none, vLLM
        gives the KV cache what ``gpu_memory_utilization`` leaves).
    gpu_memory_utilization: CUDA: the share of the GPU vLLM checks is free at start (and sizes the KV cache
        from when no size is given); required there, the recipe's ``rollout.gpu_memory_utilization``.
        Ignored on CPU. The GPU is this process's: one of several ranks gets its own
        (``rollout.device_placement``).
    seed: the engine's global seed (samples use per-request seeds, see ``sample_seed``).
    enforce_eager: skip graph capture / torch.compile. None: eager on CPU (compiling costs more than it saves,
        bench/speed/bench_rollout.py), CUDA graphs on CUDA (a small model's decoding is launch-bound).
    enable_prefix_caching: share the prompt's KV across a group's n samples.
    max_num_seqs: sequences per scheduler step.
    eos_ids: stop tokens; default: the model dir's generation_config / config EOS ids.
    load_tokenizer: start vLLM's tokenizer and fill ``Rollouts.completion_texts``.
    return_routes: an MoE model's routes in every ``Rollouts.routes`` (``rollout.routes``). On CPU through
        the project's capture in the V1 runner (``rollout.vllm_plugins.route_capture``), with prefix caching
        off; on CUDA through vLLM's ``enable_return_routed_experts``, with prefix caching on (``route_options``).
    enable_sleep_mode: CUDA only: ``release_memory()`` then frees the engine's GPU memory until the next
        update or rollout (module docstring). Ignored on CPU (vLLM's CPU backend has no sleep mode).
    max_lora_rank: serve LoRA adapters of rank up to this (``load_adapter``; ``rollout.vllm_adapters``): the
        adapter runs beside the base weights, its weights in the engine's dtype (vLLM's ``lora_dtype`` "auto").
        None: no LoRA support (weights are synced merged).
    lora_target_modules: the adapter's layers (HF leaf names): only they get vLLM's LoRA wrappers
        (``rollout.vllm_adapters.lora_options``).
    sampling_supports: return, with truncated sampling (top-k / top-p / min-p), the set of tokens kept at every
        sampled position (``Rollouts.support``): on CUDA vLLM's own ``return_sampling_mask`` (Model Runner V2;
        a mask per token, so only when asked), on CPU the project's capture in the V1 sampler
        (``rollout.vllm_plugins.support_capture``). Without it, truncated rollouts come without them (a greedy
        evaluation's top-k 1 needs none); the trainer refuses to score truncated tokens without their sets.
    llm_kwargs: passed to ``vllm.LLM`` as is.
    """

    _live = 0  # engines open in this process (close() tears the shared vLLM state down with the last)

    def __init__(self, model: str | Path, *, dtype: str = "bfloat16", max_model_len: int = 1024, seed: int = 0,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float | None = None,
                 enforce_eager: bool | None = None, enable_prefix_caching: bool = True, max_num_seqs: int = 256,
                 eos_ids: Sequence[int] | None = None, load_tokenizer: bool = False,
                 enable_sleep_mode: bool = False, return_routes: bool = False, max_lora_rank: int | None = None,
                 lora_target_modules: Sequence[str] | None = None, sampling_supports: bool = False,
                 **llm_kwargs) -> None:
        if not isinstance(max_model_len, int) or max_model_len < 2:
            raise ValueError(f"max_model_len = {max_model_len!r}: expected an integer >= 2")
        self.model = str(model)
        self.dtype = dtype
        self.torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) and hasattr(torch, dtype) else None
        if not isinstance(self.torch_dtype, torch.dtype):
            raise ValueError(f"dtype = {dtype!r}: expected a torch dtype name such as 'bfloat16', 'float16', 'float32'")
        self.max_model_len = max_model_len
        self.cuda = torch.cuda.is_available()
        # a vision-language model: vLLM's multimodal processor refuses to start without the tokenizer
        self.load_tokenizer = load_tokenizer = load_tokenizer or has_vision_tower(self.model)
        self.eos_ids = [int(e) for e in (eos_ids if eos_ids is not None else eos_token_ids(self.model))]
        self._shapes = checkpoint_shapes(self.model)

        memory = memory_options(self.cuda, kv_cache_memory_bytes, gpu_memory_utilization)
        if enforce_eager is None:
            enforce_eager = not self.cuda
        require_in_process()  # before vllm is first imported
        self._refuse_moe_beside_a_dense_engine()
        self._dist_was_initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        for key, value in placement_options(self.cuda).items():  # this rank's GPU, not cuda:0 (device_placement)
            llm_kwargs.setdefault(key, value)
        from vllm import LLM

        # Chunked prefill is off: vLLM 0.32 rewinds the per-request generator of a
        # seeded request whose prefill is split over steps (``gen.set_offset``), which
        # the CPU torch.Generator does not support -> RuntimeError as soon as a batch's
        # prompt tokens exceed max_num_batched_tokens (seen with 64 prompts x n=8).
        # Seeded requests are how rollouts stay reproducible, so prefill stays whole.
        llm_kwargs.setdefault("enable_chunked_prefill", False)
        llm_kwargs = {**lora_options(max_lora_rank, lora_target_modules), **llm_kwargs}
        self.sampling_supports = bool(sampling_supports)
        if self.sampling_supports and self.cuda:
            llm_kwargs.setdefault("return_sampling_mask", True)
        # vLLM then refuses every request with top-k off, truncating or not (rollout.vllm_requests)
        self.sampling_mask = bool(llm_kwargs.get("return_sampling_mask", False))
        self._vocab_size: int | None = None
        self._adapter: ServedAdapter | None = None  # the adapter served (max_lora_rank set)
        self.adapter_dtype: torch.dtype | None = None  # the dtype its weights run in; None: no adapter served
        self._base_changed = False  # a merged update replaced base weights: an adapter needs them back first
        self.stale_kv = StaleKVAlarm()  # every update arms it; the next generate checks its cache reads
        self.return_routes = bool(return_routes)
        if self.return_routes:  # CUDA: vLLM's own capture (Model Runner V2); not run on a GPU by this project yet
            routes = route_options(self.cuda, enable_prefix_caching)
            enable_prefix_caching = routes.pop("enable_prefix_caching")
            llm_kwargs = {**routes, **llm_kwargs}
        if not self.cuda:  # before vLLM's first GEMM, whose 1-4-row bf16 kernel uses AMX without asking
            request_amx_permission()
        # Without a tokenizer, vLLM's chat-template warm-up fails and logs a traceback: expected here.
        with _preserve_rng(), keep_current_device(self.cuda) as device, \
                _drop_log("vllm.renderers.base", "Chat template warmup failed", not load_tokenizer):
            try:
                self._llm = LLM(self.model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching,
                                max_num_seqs=max_num_seqs, skip_tokenizer_init=not load_tokenizer,
                                logprobs_mode="processed_logprobs", enable_sleep_mode=enable_sleep_mode and self.cuda,
                                **memory, **llm_kwargs)
            except Exception as e:  # vLLM's refusals are assertions and errors of every type: one line, its reason
                raise EngineCannotLoad(f"vLLM cannot load the model {self.model}: {one_line(e)}") from e
        VLLMEngine._live += 1
        # the scratch vLLM's worker just made for this engine, kept and made current for its forwards: the next
        # engine of the process replaces vLLM's one global manager (rollout.vllm_workspace)
        self._workspace = engine_workspace()
        guard_generate(self._llm, self._workspace)
        if self.cuda:
            check_engine_device(self._llm, device)
        self._sleep_enabled = enable_sleep_mode and self.cuda
        self._asleep: set[str] = set()  # the SLEEP_TAGS vLLM holds asleep
        # vLLM's CUDA block-FP8 layers load FP8 values + scales (rollout.fp8_weights), not float weights.
        self.fp8_block_weights = llm_kwargs.get("quantization") == "fp8"
        self.packed_modules = self._packed_modules()
        if self.fp8_block_weights:
            self._check_fp8_layers()
        self._images = None  # the images each request consumed (rollout.vllm_image_capture), from the first image
        self._moe_layers = None  # the decoder layers that route (vLLM's own routes hold every layer)
        self.route_shape = self._install_route_capture() if self.return_routes else None
        if max_lora_rank is not None:
            if load_tokenizer:
                logging.getLogger("vllm.v1.engine.input_processor").addFilter(_ADAPTER_TOKENIZER_NOTE)
            self._adapter = ServedAdapter(max_lora_rank)
            self.adapter_dtype = self.torch_dtype  # LoRA runs in the model dtype (lora_dtype "auto", config/lora.py)

    def _install_route_capture(self) -> dict:
        """``{"layers", "top_k", "num_experts"}`` of the model's routes (CPU: hooks the runner's routers)."""
        if self.cuda:
            from transformers import AutoConfig

            shape = moe_shape(AutoConfig.from_pretrained(self.model))
            self._moe_layers = None if shape is None else shape.layers
            if shape is None:
                raise ValueError(f"return_routes: {self.model} is not a mixture-of-experts model of "
                                 f"a supported family (rollout.moe_config.MOE_FAMILIES)")
            return route_shape(shape.num_layers, shape.top_k, shape.num_experts)
        return self.llm.collective_rpc(install_route_capture)[0]

    def _refuse_moe_beside_a_dense_engine(self) -> None:
        """vLLM's parallel groups are process-wide and made by the first engine: a dense model's leave out the
        expert-parallel group, and an MoE engine started next fails deep in its model's construction
        ("expert parallel group is not initialized"). Said here, with what to do."""
        if not VLLMEngine._live:
            return
        from transformers import AutoConfig
        from vllm.distributed import parallel_state

        try:
            moe = is_moe(AutoConfig.from_pretrained(self.model))
        except (OSError, ValueError):  # not a local model: vLLM's own start says what is wrong with it
            return
        if moe and parallel_state._EP is None:
            raise RuntimeError(f"{self.model}: a mixture-of-experts engine cannot start in a process that holds a "
                               "dense model's vLLM engine (vLLM's parallel groups are process-wide and were made "
                               "without the expert-parallel one); close that engine first, or use another process")

    def _check_fp8_layers(self) -> None:
        """vLLM's block-FP8 layers are the recipe's FP8 layers, each on the kernel whose quantizer is
        ``parity.precision``'s (``rollout.fp8_weights.check_engine_fp8_layers``); else the engine is closed."""
        try:
            check_engine_fp8_layers(self.llm.apply_model(engine_fp8_layers)[0], self.packed_modules)
        except RuntimeError:
            self.close()
            raise

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
    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec,
                 images: Sequence[Sequence[Any]] | None = None) -> Rollouts:
        """Sample ``spec.n`` completions per prompt; sample i answers prompt i // n.

        Each sample is its own request with seed ``sample_seed(spec.seed, spec.sample_index(i))``,
        so the same weights and spec give the same samples, whichever rank draws them.

        ``images``: per prompt, the images (PIL) of a vision-language model's prompt, in the order of its
        placeholders (an empty list: a text-only prompt). The prompt holds one placeholder per image; vLLM's processor
        expands each into the image's tokens, and ``Rollouts.prompt_ids`` are the ids it consumed, expanded: the
        sequence the trainer must score (a trainer that expands on its own can disagree, TRL #6401).
        """
        validate_request(prompt_ids, spec, self.max_model_len)
        if images is not None and len(images) != len(prompt_ids):
            raise ValueError(f"images: expected one list per prompt ({len(prompt_ids)}), got {len(images)}")
        if images is not None and self._images is None:
            self._images = ImageCapture(self.llm)
        truncated = spec.truncated and self.sampling_supports  # the kept sets are returned when asked at start
        from vllm.inputs import TokensPrompt

        prompts, params = [], []
        for i, p in enumerate(prompt_ids):
            for j in range(spec.n):
                mm = {"multi_modal_data": {"image": list(images[i])}} if images is not None and images[i] else {}
                prompts.append(TokensPrompt(prompt_token_ids=list(p), **mm))
                params.append(rollout_params(spec, i * spec.n + j, eos_ids=self.eos_ids,
                                             detokenize=self.load_tokenizer, **self._mask_options(spec.top_k)))
        self.wake_up()
        with _preserve_rng():
            self._reset_routes()
            if truncated and not self.cuda:
                self.llm.collective_rpc(begin_supports)
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request())
        self.stale_kv.check([o.num_cached_tokens for o in outputs])
        routes = self._routes(outputs) if self.return_routes else []
        support = self._supports(outputs) if truncated else []

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
            prompt_ids=[list(o.prompt_token_ids) if images is not None else list(prompt_ids[k // spec.n])
                        for k, o in enumerate(outputs)],
            completion_ids=completion_ids, rollout_logprobs=logprobs, finish_reasons=finish,
            group_size=spec.n, completion_texts=texts if self.load_tokenizer else [],
            topk_ids=top_ids if spec.logprobs_topk else [], topk_logprobs=top_lps if spec.logprobs_topk else [],
            routes=routes, support=support,
            images=[self._images.take(o.request_id) for o in outputs] if images is not None else [],
        )

    def _mask_options(self, top_k: int) -> dict:
        """``rollout.vllm_requests``' view of this engine for a request asking ``top_k``: whether vLLM returns sampling
        masks, and (only where that changes the request) the vocabulary size vLLM bounds top-k by."""
        if not (self.sampling_mask and top_k == 0):
            return {"vocab_size": 0, "sampling_mask": self.sampling_mask}
        if self._vocab_size is None:
            self._vocab_size = int(self.llm.model_config.get_vocab_size())  # the bound vLLM's samplers use
        return {"vocab_size": self._vocab_size, "sampling_mask": True}

    def request_top_k(self, top_k: int) -> int:
        """The ``top_k`` a request of this engine's own making (the doctor's prefix-cache legs) sends for ``top_k``
        (0: off): ``rollout.vllm_requests.engine_top_k``."""
        return engine_top_k(top_k, **self._mask_options(top_k))

    def _supports(self, outputs) -> list[Support]:
        """Each output's kept sets, one per completion token (``rollout.support``)."""
        if not self.cuda:
            return self.llm.collective_rpc(
                take_supports, args=([(o.request_id, len(o.outputs[0].token_ids)) for o in outputs],))[0]
        out = []
        for o in outputs:
            mask = o.outputs[0].sampling_mask
            if mask is None or len(mask.token_ids) != len(o.outputs[0].token_ids):
                raise RuntimeError(f"vLLM returned {None if mask is None else len(mask.token_ids)} sampling masks "
                                   f"for request {o.request_id}'s {len(o.outputs[0].token_ids)} tokens")
            out.append(Support.from_lists(mask.token_ids))
        return out

    def _reset_routes(self) -> None:
        """Forget the routes of earlier requests (CPU capture: a new batch of requests starts)."""
        if self.return_routes and not self.cuda:
            self.llm.collective_rpc(reset_routes)

    def _routes(self, outputs) -> list[torch.Tensor]:
        """Each output's routes [prompt + completion tokens, MoE layers, top_k] (``rollout.routes``)."""
        lengths = [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs]
        if not self.cuda:
            return self.llm.collective_rpc(take_routes, args=([(o.request_id, n) for o, n in zip(outputs, lengths)],))[0]
        shape = (self.route_shape["layers"], self.route_shape["top_k"])
        out = []
        for o, n in zip(outputs, lengths):
            got = o.outputs[0].routed_experts  # [tokens, every decoder layer, k]
            if got is not None and self._moe_layers is not None:
                got = got[:, list(self._moe_layers)]
            if got is None or tuple(got.shape[1:]) != shape:
                raise RuntimeError(f"vLLM returned routed_experts of shape {None if got is None else got.shape} "
                                   f"for request {o.request_id}; expected [tokens, {shape[0]} MoE layers, {shape[1]}]")
            r = torch.full((n, *shape), NO_ROUTE, dtype=ROUTE_DTYPE)
            m = min(n, got.shape[0])
            r[:m] = torch.from_numpy(got[:m].astype("int16"))
            out.append(r)
        return out

    def score(self, sequences: list[list[int]], topk: int = 0,
              images: Sequence[Sequence[Any]] | None = None) -> Scored:
        """log p(x_t | x_<t) at temperature 1 of every token t >= 1 of each sequence: one prefill, no decoding.
        With ``topk``, also the k most likely tokens' ids and log-probs at each of those positions.

        ``images``: per sequence, its prompt's images, as ``generate`` takes them: the sequence holds one placeholder
        per image and vLLM expands them, so the log-probs are of the sequence vLLM consumed, expanded (as long as
        ``generate``'s ``Rollouts.prompt_ids`` plus the completion). An already expanded sequence would be expanded
        again: vLLM applies its prompt updates to every token prompt.

        vLLM's prompt log-probs (``SamplingParams.prompt_logprobs``) are log_softmax of the raw
        logits, whatever ``logprobs_mode`` (``gpu_model_runner._get_prompt_logprobs_dict``: prompt
        tokens skip the sampling processors), so they are compared with the trainer's at T = 1.
        Requests with prompt log-probs do not read the prefix cache. One token is sampled per
        request (vLLM needs one) and discarded.
        """
        from vllm.inputs import TokensPrompt

        validate_score_request(sequences, self.max_model_len)
        if images is not None and len(images) != len(sequences):
            raise ValueError(f"images: expected one list per sequence ({len(sequences)}), got {len(images)}")
        prompts = [TokensPrompt(prompt_token_ids=list(seq), **({"multi_modal_data": {"image": list(images[k])}}
                                                                if images is not None and images[k] else {}))
                   for k, seq in enumerate(sequences)]
        params = [score_params(k, topk, **self._mask_options(0)) for k in range(len(sequences))]
        self.wake_up()
        with _preserve_rng():
            self._reset_routes()
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request())
        self.stale_kv.spent()  # its requests filled the cache without reading it (rollout.stale_kv)
        if images is not None:  # the sequences vLLM consumed, their placeholders expanded
            sequences = [list(out.prompt_token_ids) for out in outputs]
            for out in outputs if self._images is not None else []:  # what the capture recorded is nobody's to read
                self._images.take(out.request_id)
        # the sequence's routes; the one token sampled after it is not part of it
        routes = ([r[:len(seq)] for r, seq in zip(self._routes(outputs), sequences)] if self.return_routes else [])

        def row(k: int, seq: list[int], plp):
            positions = None if plp is None else [
                None if pos is None else {tid: (lp.logprob, lp.rank) for tid, lp in pos.items()} for pos in plp]
            return read_prompt_logprobs(seq, positions, topk,
                                        lambda msg: RuntimeError(f"score: vLLM's answer for sequence {k}: {msg}"))

        scored = Scored.from_rows(row(k, seq, out.prompt_logprobs)
                                  for k, (seq, out) in enumerate(zip(sequences, outputs)))
        scored.routes = routes
        return scored

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the named parameters (HF names) in place; names not given keep their values.

        Each update must contain whole fused groups (see module docstring). Tensors are
        cast to the engine dtype. The prefix cache is reset afterwards.
        """
        self.load_weight_chunks([named_tensors])

    def load_weight_chunks(self, chunks: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> None:
        """Each chunk loaded as an update of its own (``InProcessEngine``); a sleeping engine's weights are woken
        before the first and its KV cache after the last (module docstring)."""
        self.wake_up(["weights"])
        for chunk in chunks:
            self._load(chunk)
        self.wake_up(["kv_cache"])

    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        named = engine_named_tensors(named_tensors, self.torch_dtype)
        if not named:
            return
        self._check_update(named)
        self.reload_weights(named)
        self._base_changed = True
        if self._adapter is not None:  # vLLM dropped its adapters with the reload (reset_lora_state)
            self._adapter.forget()
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update (requests running?)")
        self.stale_kv.updated("a weight update")

    def reload_weights(self, named: list[tuple[str, torch.Tensor]] | None = None) -> None:
        """vLLM's in-place reload: ``named`` (engine dtype, checked) over the current weights, or every weight from
        the model's files (None). The prefix cache is the caller's to reset (it refuses while requests run).

        Then the engine core forgets its cached image features: the worker's reload clears its own
        (``reload_weights`` calls ``reset_encoder_cache`` in both model runners, ``vllm/v1/worker/gpu_model_runner.py``
        and ``vllm/v1/worker/gpu/model_runner.py``), while the scheduler still counts every image it has seen as
        cached and schedules no encoder run for it, so the next request holding such an image fails with ``Encoder
        cache miss`` (a vision-language run's held-out images, at its next evaluation). A text model's cache is
        empty."""
        with quiet_partial_reload():
            if named is None:
                self.llm.collective_rpc("reload_weights")
            else:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        self.forget_images()

    def forget_images(self) -> None:
        """The engine core's cached image features dropped, the scheduler's count of them and the worker's tensors:
        the next request holding an image runs the vision encoder on it again."""
        self.llm.llm_engine.reset_encoder_cache()

    def _check_update(self, named: list[tuple[str, torch.Tensor]]) -> None:
        check_update(named, self._shapes, self.model, self.packed_modules)
        if self.fp8_block_weights:  # a float weight would be cast unscaled, its scale never loaded
            check_block_fp8_update(named)

    # ---- LoRA adapter -----------------------------------------------------------------------
    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` over the base weights the engine started from, for every generate and score from
        now on (``rollout.vllm_adapters``). Base weights a merged update replaced are reloaded from the model's
        files first. The prefix cache is reset, as after every weight update."""
        if self._adapter is None:
            raise RuntimeError("load_adapter(): this engine was started without LoRA support; construct "
                               "VLLMEngine(..., max_lora_rank=r) to serve adapters")
        self.wake_up()
        if self._base_changed:
            self.reload_weights()  # from the model's files; vLLM drops its adapters
            self._adapter.forget()
            self._base_changed = False
        self._adapter.load(self.llm, adapter)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after an adapter update (requests running?)")
        self.stale_kv.updated("an adapter update")

    def drop_adapter(self) -> None:
        """Serve the base weights alone again, as before the first ``load_adapter`` (a diagnosis that synced an
        adapter leaves the engine as it found it). The prefix cache is reset."""
        if self._adapter is None or self._adapter.request is None:
            return
        self._adapter.drop(self.llm)
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after an adapter update (requests running?)")
        self.stale_kv.updated("an adapter update")

    @property
    def adapter_version(self) -> int | None:
        """The trainer's version of the adapter served (None: the base weights alone)."""
        return None if self._adapter is None else self._adapter.version

    def _lora_request(self):
        return None if self._adapter is None else self._adapter.request

    # ---- memory -----------------------------------------------------------------------------
    def release_memory(self) -> None:
        """Before the trainer's update (``rollout.base.RolloutEngine``): sleep at level 1 when sleep mode is on
        (CUDA), else nothing. What comes next wakes it: an update (weights, then KV cache), or a rollout."""
        if self._sleep_enabled and not self._asleep:
            self.sleep(level=1)

    def sleep(self, level: int = 1) -> None:
        """Free the engine's accelerator memory (level 1: weights offloaded to host memory, KV cache dropped).

        No-op on CPU (vLLM's CPU backend has no sleep mode). CUDA needs ``enable_sleep_mode=True``.
        """
        if not self.cuda:
            return
        if not self._sleep_enabled:
            raise RuntimeError("sleep(): construct VLLMEngine(..., enable_sleep_mode=True) to use sleep mode")
        if level != 1:  # level 2 discards the weights: an update of LoRA-targeted modules only would lose the rest
            raise ValueError(f"sleep(level={level!r}): expected 1 (weights kept in host memory)")
        self.llm.sleep(level=level)
        self._asleep = set(SLEEP_TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring back what ``sleep`` freed: ``tags`` of ``SLEEP_TAGS`` (None: all). A woken KV cache starts empty
        (the prefix cache is reset). Nothing to do when nothing of it sleeps."""
        wake = set(self._asleep) if tags is None else self._asleep & set(tags)
        if not wake:
            return
        self.llm.wake_up(tags=[t for t in SLEEP_TAGS if t in wake])
        self._asleep -= wake
        if "kv_cache" in wake:
            self.llm.reset_prefix_cache()
            self.stale_kv.updated("a wake-up")

    def close(self) -> None:
        """Shut the engine down and free its memory; safe to call twice."""
        if self._llm is None:
            return
        engine_core = getattr(self._llm.llm_engine, "engine_core", None)
        if engine_core is not None:
            with _engine_core_keeps_process_groups():
                engine_core.shutdown()
        self._llm = None
        self._workspace = None  # its scratch goes with the engine
        if self._adapter is not None:
            self._adapter.close()
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        # vLLM's model-parallel groups are process globals that every in-process engine shares: the
        # last engine to close tears them down (closing one of two engines would break the other:
        # "pipeline model parallel group is not initialized"), which is why the engine core's own teardown is
        # kept from doing it above.
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
