"""Sizes the machine cannot hold, refused before the engine starts: a step's samples against host memory, and the
colocated vLLM engine's KV cache and weights against host or GPU memory.

Every estimate here is a lower bound (what the run needs at the least), so a refusal is certain and a run that
fits is never refused; a run that passes may still need more (activations, vLLM's own buffers, and the trainer's
optimizer and activations: with sleep mode on CUDA the update runs while the engine's weights and KV cache are
off the GPU). Estimates that
need the model's config or weights are skipped when those are not local (a hub id not yet downloaded).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rollout.device_placement import rank_gpu_index
from rollout.vllm_engine import DEFAULT_CPU_KV_CACHE_BYTES
from trainer.config import RunConfig
from trainer.config.validate import sequence_length

# Host bytes of one sample's engine request before any token is generated: the colocated engine is handed a
# step's prompts_per_step x group_size requests at once (rollout.vllm_engine.VLLMEngine.generate builds a
# SamplingParams and a TokensPrompt for each, then vLLM queues those beyond max_num_seqs). Measured with
# tracemalloc: 1169 bytes per sample with a 10-token prompt (vLLM in this venv); vLLM's own per-request state
# comes on top.
REQUEST_BYTES = 1024
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# Config keys of attention whose cache is not 2 x layers x kv_heads x head_dim per token (sliding windows,
# mixed layer types, DeepSeek's latent attention): the one-sequence estimate is skipped for them.
_NOT_FULL_ATTENTION = ("layer_types", "sliding_window_pattern", "kv_lora_rank", "attention_chunk_size")


@dataclass
class Machine:
    host_available: Optional[int]  # bytes the kernel says can be allocated without swapping (None: unknown)
    gpu_total: Optional[int]  # the current GPU's memory (None: no GPU)


@dataclass
class ModelSize:
    parameters: int  # elements of every weight tensor (safetensors headers)
    config: dict  # config.json


def host_available_bytes() -> Optional[int]:
    """``MemAvailable`` of /proc/meminfo (Linux), in bytes; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_total_bytes() -> Optional[int]:
    """This process's GPU's memory: the GPU its colocated engine and its training run on
    (``rollout.device_placement.rank_gpu_index``: LOCAL_RANK under a launcher, which sets the device only later,
    else the current device; ``PlacementError`` when this rank has no visible GPU of its own). Read from the
    device's properties, which need no context on it (mem_get_info would make one)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(rank_gpu_index()).total_memory


def kv_bytes_per_token(config: dict, dtype_bytes: int) -> Optional[int]:
    """2 (K and V) x layers x KV heads x head dim x bytes, for full attention; None when the config does not say
    or describes another kind of attention (``_NOT_FULL_ATTENTION``, an active sliding window)."""
    c = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    if any(c.get(k) for k in _NOT_FULL_ATTENTION):
        return None
    if c.get("sliding_window") and c.get("use_sliding_window", True):
        return None
    layers, heads, hidden = c.get("num_hidden_layers"), c.get("num_attention_heads"), c.get("hidden_size")
    if not all(isinstance(x, int) and x > 0 for x in (layers, heads)):
        return None
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or (hidden // heads if isinstance(hidden, int) else None)
    if not (isinstance(kv_heads, int) and isinstance(head_dim, int) and head_dim > 0):
        return None
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def capacity_problems(cfg: RunConfig, where: str, machine: Machine, model: Optional[ModelSize],
                      engine_weight_bytes_per_param: Optional[int] = None, teacher=None) -> list[str]:
    """Each size of ``cfg`` that ``machine`` cannot hold, as a one-line refusal naming the key and the limit.

    ``engine_weight_bytes_per_param``: the engine's bytes per weight (default: model.dtype's; 1 for FP8 weights).
    ``teacher``: what a colocated teacher holds beside them (``trainer.lifecycle.teacher_memory.TeacherMemory``;
    None: no teacher on this device, or its size not known here).
    """
    r, problems = cfg.rollout, []
    dtype_bytes = DTYPE_BYTES[cfg.model.dtype]
    samples = r.prompts_per_step * cfg.algorithm.group_size
    avail = machine.host_available
    if avail is not None and samples * REQUEST_BYTES > avail:
        problems.append(
            f"{where}: algorithm.group_size = {cfg.algorithm.group_size}: rollout.prompts_per_step x "
            f"algorithm.group_size = {samples} samples per step; the engine is handed a step's requests at once "
            f"(it runs rollout.max_num_seqs = {r.max_num_seqs} at a time and queues the rest), at least "
            f"{REQUEST_BYTES} bytes each before a token is generated: {_size(samples * REQUEST_BYTES)}, more than the "
            f"{_size(avail)} of memory available; expected at most {avail // REQUEST_BYTES} samples per step")
    if r.engine != "vllm" or r.mode != "colocate" or model is None:
        return problems
    seq_len = sequence_length(cfg)
    per_token = kv_bytes_per_token(model.config, dtype_bytes)
    one_sequence = None if per_token is None else per_token * seq_len
    engine_weights = model.parameters * (engine_weight_bytes_per_param or dtype_bytes)
    trainer_weights = model.parameters * dtype_bytes
    kv = r.kv_cache_memory_bytes  # the engine's KV cache where the recipe sizes it (rollout.vllm_engine.memory_options)
    if kv is None and machine.gpu_total is None:
        kv = DEFAULT_CPU_KV_CACHE_BYTES
    if kv is None:  # CUDA: vLLM gives the cache what its share leaves after the weights (activations come out too)
        most = int(r.gpu_memory_utilization * machine.gpu_total) - engine_weights
        if one_sequence is not None and one_sequence > most:
            problems.append(
                f"{where}: rollout.gpu_memory_utilization = {r.gpu_memory_utilization}: with "
                f"rollout.kv_cache_memory_bytes null vLLM gives the KV cache what that share of the GPU leaves after "
                f"the engine's weights ({_size(engine_weights)}), at most {_size(max(0, most))}; one sequence of "
                f"{seq_len} tokens needs {_size(one_sequence)}, so the engine would not start; expected a share of at "
                f"least {(engine_weights + one_sequence) / machine.gpu_total:.3f}")
    elif one_sequence is not None and one_sequence > kv:
        problems.append(
            f"{where}: rollout.kv_cache_memory_bytes = {kv}: one sequence of "
            f"{'env.max_tokens' if cfg.env.enabled else 'data.max_prompt_tokens + rollout.max_new_tokens'} = {seq_len} tokens needs {_size(one_sequence)} of KV cache ({per_token} "
            f"bytes per token in {cfg.model.dtype}), more than the cache holds, so the engine would not start; "
            f"expected at least {one_sequence}")
    if machine.gpu_total is None:  # CPU: the KV cache, in host memory
        if avail is not None and kv + engine_weights + trainer_weights > avail:
            problems.append(
                f"{where}: rollout.kv_cache_memory_bytes = {kv}: the KV cache, the engine's weights "
                f"({_size(engine_weights)}) and the trainer's ({_size(trainer_weights)}: {model.parameters} parameters "
                f"in {cfg.model.dtype}) need {_size(kv + engine_weights + trainer_weights)}, more than the "
                f"{_size(avail)} of memory available; expected at most {max(0, avail - engine_weights - trainer_weights)}")
        student = kv + engine_weights + trainer_weights
        if teacher is not None and avail is not None and student <= avail < student + teacher.total:
            problems.append(_teacher_problem(cfg, where, teacher, student, avail, "memory available"))
    else:
        problems += _gpu_problems(cfg, where, machine, engine_weights, trainer_weights, teacher)
    return problems


def _teacher_problem(cfg: RunConfig, where: str, teacher, student: int, limit: int, what: str) -> str:
    """The colocated teacher's bytes (``teacher_memory.TeacherMemory``) beside the student's ``student``."""
    t = cfg.teacher
    parts = f"its engine's weights ({_size(teacher.engine_weights)})"
    if teacher.kv:
        parts += f" and KV cache ({_size(teacher.kv)})"
    if teacher.trainer_copy:
        parts += (f", and its copy in the trainer for teacher_parity/* ({_size(teacher.trainer_copy)}, loaded on the "
                  f"first measured step and kept)")
    return (f"{where}: teacher.path = {t.path!r}: the colocated teacher (teacher.engine {t.engine}) holds {parts}: "
            f"{_size(teacher.total)} beside the student's {_size(student)}, more than the {_size(limit)} of {what}; "
            f"expected a teacher of at most {_size(max(0, limit - student))} here"
            + (", teacher.parity_every 0" if teacher.trainer_copy else "")
            + ", or teacher.engine server / vllm_url (a server on another device)")


def _gpu_problems(cfg: RunConfig, where: str, machine: Machine, engine_weights: int, trainer_weights: int,
                  teacher=None) -> list[str]:
    """CUDA. What vLLM reserves: its weights and ``rollout.kv_cache_memory_bytes`` of KV cache (activation and graph
    buffers on top), all resident during a rollout, beside the trainer's weights (loaded first: setup starts the
    engine after the policy) and a colocated teacher (its engine started before the student's, never asleep; its
    copy in the trainer once teacher parity is measured). Its start-up check wants ``gpu_memory_utilization`` of
    the GPU free (``vllm/v1/worker/utils.py: request_memory``). Sleep mode keeps the engine's weights in host
    memory during the update (``vllm/device_allocator/cumem.py``: pinned CPU copies)."""
    r, total, problems = cfg.rollout, machine.gpu_total, []
    kv = r.kv_cache_memory_bytes
    # null: vLLM fills its share with the cache (the share check below says whether it can start)
    engine = engine_weights + kv if kv is not None else max(engine_weights, int(r.gpu_memory_utilization * total))
    need = engine + trainer_weights
    if kv is not None and need > total:
        problems.append(
            f"{where}: rollout.kv_cache_memory_bytes = {kv}: the engine's weights ({_size(engine_weights)}) and KV "
            f"cache, beside the trainer's weights ({_size(trainer_weights)}), need {_size(need)}, more than the "
            f"GPU's {_size(total)}; expected at most {max(0, total - engine_weights - trainer_weights)}")
    elif teacher is not None and need + teacher.total > total:
        problems.append(_teacher_problem(cfg, where, teacher, need, total, "the GPU"))
    before = trainer_weights + (0 if teacher is None else teacher.engine)  # resident when the student's engine starts
    free = total - before
    if r.gpu_memory_utilization * total > free:
        loaded = f"the trainer's weights ({_size(trainer_weights)})" + (
            "" if teacher is None else f" and the teacher's engine ({_size(teacher.engine)})")
        problems.append(
            f"{where}: rollout.gpu_memory_utilization = {r.gpu_memory_utilization}: vLLM starts only when that "
            f"share of the GPU ({_size(r.gpu_memory_utilization * total)} of {_size(total)}) is free, and "
            f"{loaded}, loaded first, leave at most {_size(free)}; expected at most {max(0, free) / total:.3f}")
    avail = machine.host_available
    if r.sleep_mode and avail is not None and engine_weights > avail:
        problems.append(
            f"{where}: rollout.sleep_mode = true: the sleeping engine keeps its weights ({_size(engine_weights)}) "
            f"in host memory during every update, more than the {_size(avail)} available; expected false "
            "(the engine then keeps its GPU memory through the update)")
    return problems


def _size(n: float) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} bytes"
