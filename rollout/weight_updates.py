"""The rules of a weight update into a vLLM engine, colocated (``rollout.vllm_engine``) or a server
(``rollout.server_engine``, ``rollout.vllm_plugins.server_transfer``).

vLLM rebuilds a fused module (``qkv_proj`` = q,k,v; ``gate_up_proj`` = gate,up) from the shards
it is sent, and a missing shard comes back as uninitialised memory (``rollout.vllm_engine``'s
module docstring): every update carries whole fused groups (``check_fused_groups``). Tensors are
cast to the engine dtype, except the CUDA FP8 format's (``to_engine_dtype``).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Iterable

import torch

# vLLM's fused modules for Llama-family models, used if the model class cannot be asked.
DEFAULT_PACKED_MODULES = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
# Partial reloads are routine here; these loggers warn about every module not in the update.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.model_executor.model_loader.reload.inplace")


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

    Hook for the CUDA FP8 recipes (``rollout.fp8_weights.fp8_block_weights``): the
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
