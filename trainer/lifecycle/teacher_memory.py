"""What a colocated teacher holds in the trainer's process, and the engine options that keep it to that (CUDA).

A ``teacher.engine: vllm`` teacher is a second vLLM engine on the trainer's GPU, started before the student's
(``trainer/rl/loop.py: setup``). It only scores: one prefill per sequence with prompt log-probs, one token sampled
and dropped (``rollout.vllm_engine.VLLMEngine.score``). On CUDA it therefore gets options of its own
(``teacher_engine_options``), not the student's:

- eager (``enforce_eager``): no CUDA graphs, whose capture serves decoding (launch-bound small batches) a teacher
  never does, and whose pool and start time it would pay for nothing;
- a batch of ``TEACHER_BATCH_TOKENS`` prompt tokens per engine step (``max_num_batched_tokens``; at least one
  sequence of the run) and a KV cache sized to hold one such step (``teacher_kv_bytes``), where the student's
  ``rollout.kv_cache_memory_bytes`` is sized for its rollouts;
- as its start-up check (``gpu_memory_utilization``, ``vllm/v1/worker/utils.py: request_memory``: vLLM starts
  when that share of the GPU is free, and with a KV size given reserves no more) its own weights and KV cache as a
  share of the GPU, not the student's share;
- no sleep mode: vLLM's cumem allocator is one per process (``vllm/device_allocator/cumem.py``), a second engine
  cannot load weights into it ("CuMem allocator can only be used for one instance per process",
  ``gpu_worker.py: _maybe_get_memory_pool_context``) and ``sleep()`` unmaps every allocation in it. The teacher's
  memory is ordinary CUDA memory, resident for the whole run; the capacity check counts it (``TeacherMemory``).

Where ``teacher_parity/*`` is measured, the teacher is also loaded into the trainer's process on its first
measured step (``trainer.teacher.teacher.Teacher.parity``; with ``teacher.parity_every: null`` that is step 1) and
kept: counted as ``trainer_copy``. On CPU the teacher's engine keeps the student's settings (the KV cache in host
memory, vLLM's CPU engine eager by default); the capacity check counts the same terms against host memory.
These options are read from vLLM 0.32's source and checked on CPU (tests/trainer/lifecycle/test_teacher_memory.py):
no GPU has run them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rollout.vllm_engine import DEFAULT_CPU_KV_CACHE_BYTES
from trainer.builtin.model_files import parameter_count, read_json, safetensors_header, weight_files
from trainer.builtin.resolve import model_dir_at_hand
from trainer.config import RunConfig
from trainer.lifecycle.capacity import DTYPE_BYTES, ModelSize, kv_bytes_per_token

# Prompt tokens per engine step: vLLM's own LLM-class default on GPUs under 70 GiB (``engine/arg_utils.py:
# get_batch_defaults``, 8192; 16384 on H100-class cards), fixed here so that the KV cache and the capacity
# check do not depend on the card. One chunk of prompt logits (``v1/worker/gpu/sample/prompt_logprob.py``
# computes them in chunks) stays the step's largest activation.
TEACHER_BATCH_TOKENS = 8192


@dataclass
class TeacherMemory:
    """Bytes a colocated teacher holds on the trainer's device, each a lower bound."""

    engine_weights: int  # its engine's weights (FP8 recipes on CUDA: one byte each)
    kv: int  # its engine's KV cache (a Transformers engine: none)
    trainer_copy: int  # its weights in the trainer for teacher_parity/* (0: never measured)

    @property
    def engine(self) -> int:
        """What is resident once its engine has started (before the student's engine starts)."""
        return self.engine_weights + self.kv

    @property
    def total(self) -> int:
        return self.engine + self.trainer_copy


def batch_tokens(max_model_len: int) -> int:
    """The teacher engine's ``max_num_batched_tokens``: ``TEACHER_BATCH_TOKENS``, or one sequence when longer
    (vLLM refuses a limit under ``max_model_len`` without chunked prefill, ``config/scheduler.py``)."""
    return max(TEACHER_BATCH_TOKENS, max_model_len)


def teacher_dtype_name(cfg: RunConfig) -> str:
    """``teacher.dtype``, else the student's ``model.dtype``."""
    return cfg.teacher.dtype or cfg.model.dtype


def teacher_kv_bytes(cfg: RunConfig, config: Optional[dict], max_model_len: int, cuda: bool) -> Optional[int]:
    """The teacher engine's KV cache. CUDA: two engine steps' worth of tokens (``batch_tokens``): one step's
    prompts, plus the rounding of each sequence up to whole KV blocks (16 tokens: at most as many tokens again for
    sequences of 16 tokens or more) and the one token sampled after it. A smaller cache only schedules fewer
    sequences per step; one sequence must fit. Elsewhere, or when the config's attention has no fixed size per
    token (``kv_bytes_per_token``): the student's ``rollout.kv_cache_memory_bytes`` (null: 256 MiB, the CPU
    engine's own default)."""
    per_token = None if config is None else kv_bytes_per_token(config, DTYPE_BYTES[teacher_dtype_name(cfg)])
    if not cuda or per_token is None:  # null: the engine's CPU size, and on CUDA a size its share is counted from
        return cfg.rollout.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES
    return max(1024**2, per_token * 2 * batch_tokens(max_model_len))  # vLLM's engine: at least 1 MiB


def teacher_parity_measured(cfg: RunConfig) -> bool:
    """Whether some step of the run measures ``teacher_parity/*`` (and so loads the teacher into the trainer):
    ``teacher.parity_every`` N >= 1 measures step 1; null follows the probe (``trainer.measurement.probe.due``:
    steps up to ``parity.probe_first``, then every ``parity.probe_every``)."""
    every, steps, p = cfg.teacher.parity_every, cfg.train.steps, cfg.parity
    if every == 0 or steps < 1:
        return False
    return every is not None or p.probe_first >= 1 or p.probe_every <= steps


def model_size(model_dir: str) -> Optional[ModelSize]:
    """The parameters (safetensors headers) and config.json of a local model directory; None when they cannot be
    read from here (PyTorch .bin weights, a damaged file: preflight names those for ``model.path``)."""
    d = Path(model_dir)
    files, problem = weight_files(d)
    config, _ = read_json(d / "config.json")
    if problem or not files or not isinstance(config, dict):
        return None
    headers = []
    for f in files:
        header, problem = safetensors_header(f)
        if problem:
            return None
        headers.append(header)
    return ModelSize(parameters=parameter_count(headers), config=config)


def teacher_size_at_hand(cfg: RunConfig) -> Optional[ModelSize]:
    """The teacher's size when its model is here already (nothing built or downloaded: a recipe's checks)."""
    d = model_dir_at_hand(cfg.teacher.path) if cfg.teacher.path else None
    return None if d is None else model_size(d)


def teacher_memory(cfg: RunConfig, size: ModelSize, *, max_model_len: int, cuda: bool,
                   fp8: bool = False) -> Optional[TeacherMemory]:
    """What the recipe's teacher holds on the trainer's device (``TeacherMemory``); None without one there
    (no teacher, or one on a server). ``fp8``: its engine runs the recipe's block-FP8 layers (CUDA)."""
    t = cfg.teacher
    if not t.path or t.engine not in ("vllm", "hf"):
        return None
    dtype_bytes = DTYPE_BYTES[teacher_dtype_name(cfg)]
    weights = size.parameters * dtype_bytes
    copy = weights if teacher_parity_measured(cfg) else 0
    if t.engine == "hf":  # a Transformers model on the trainer's device, no KV cache kept between steps
        return TeacherMemory(engine_weights=weights, kv=0, trainer_copy=copy)
    kv = teacher_kv_bytes(cfg, size.config, max_model_len, cuda) or 0
    return TeacherMemory(engine_weights=size.parameters * (1 if fp8 else dtype_bytes), kv=kv, trainer_copy=copy)


def teacher_engine_options(cfg: RunConfig, size: Optional[ModelSize], *, max_model_len: int, cuda: bool,
                           gpu_total: Optional[int], fp8: bool = False) -> dict:
    """``VLLMEngine``'s memory and scheduling options for the colocated teacher (module docstring). CPU: the
    student's settings. ``size``: the teacher's (None: not read; its share is then the student's)."""
    r = cfg.rollout
    if not cuda:
        return {"kv_cache_memory_bytes": r.kv_cache_memory_bytes, "gpu_memory_utilization": r.gpu_memory_utilization,
                "enforce_eager": r.enforce_eager, "max_num_seqs": r.max_num_seqs}
    tokens = batch_tokens(max_model_len)
    kv = teacher_kv_bytes(cfg, None if size is None else size.config, max_model_len, cuda)
    share = r.gpu_memory_utilization
    if size is not None and gpu_total:
        need = teacher_memory(cfg, size, max_model_len=max_model_len, cuda=True, fp8=fp8).engine
        # in thousandths, rounded up; vLLM takes (0, 1] (config/cache.py), a teacher too large is the capacity check's
        share = min(1.0, max(0.001, math.ceil(1000 * need / gpu_total) / 1000))
    return {"kv_cache_memory_bytes": kv, "gpu_memory_utilization": share, "enforce_eager": True,
            "max_num_batched_tokens": tokens, "max_num_seqs": min(r.max_num_seqs, tokens)}
