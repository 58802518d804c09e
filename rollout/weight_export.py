"""Export the trainer's current weights under Hugging Face names for an engine sync.

The trainer holds a PEFT LoRA model; the rollout engine holds plain (merged)
weights. A sync sends, for every LoRA-wrapped module, the effective weight

    W = W_base + sum_{a in active adapters} scaling_a * (B_a @ A_a)      [out, in]

(transposed when ``fan_in_fan_out``; Hu et al. 2021, "LoRA",
https://arxiv.org/abs/2106.09685, eq. 3) under the base model's parameter name,
e.g. ``model.layers.0.self_attn.q_proj.weight``.

The merge (``parity.lora``, the one the trainer's FP8 layers compute too) is out of
place, never ``merge_adapter()`` / ``unmerge_adapter()``: that round trip adds and subtracts the delta in the
base weight's storage dtype, so a BF16 base would drift by a rounding error
every sync. The arithmetic is done in float32 and rounded to ``dtype`` once,
which is exactly what a merged checkpoint (``merge_and_unload`` in float32,
then saved in BF16) would hold.

Names: the checkpoint's (``rollout.checkpoint_names``): Transformers 5 fuses
an MoE model's routed experts into one tensor per layer in memory, while the
engine, started from the checkpoint, loads them per expert.

Fused modules: vLLM stores q/k/v as one ``qkv_proj`` and gate/up as one
``gate_up_proj``, and its in-place reload rebuilds a fused module from
whatever shards it is given (the missing shards come back as uninitialised
memory). So when LoRA targets only some members of such a group, the others
are sent as well, with their (unchanged) weights: see ``fused_groups``.

Everything is a generator underneath (one module at a time) so that a
ZeRO-3 trainer can gather one module's shards, export it, and release it:
pass ``gather`` (e.g. ``lambda ps: deepspeed.zero.GatheredParameters(ps)``).
"""
from __future__ import annotations

import contextlib
import re
from typing import Callable, ContextManager, Iterable, Iterator, Sequence

import torch
from torch import nn

from parity.lora import merged_lora_weight
from rollout.checkpoint_names import checkpoint_named

NamedTensors = list[tuple[str, torch.Tensor]]
Gather = Callable[[Sequence[nn.Parameter]], ContextManager]

# Hugging Face leaf names that vLLM fuses into one module (Llama, Mistral, Qwen2/3, ...).
DEFAULT_FUSED_GROUPS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)


def _no_gather(params: Sequence[nn.Parameter]) -> ContextManager:
    return contextlib.nullcontext()


def _lora_types() -> tuple[type, type]:
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return LoraLayer, AuxiliaryTrainingWrapper


def _hf_root(peft_model: nn.Module) -> nn.Module:
    """The wrapped Transformers model, whose module names are the HF names."""
    get_base = getattr(peft_model, "get_base_model", None)
    if get_base is None:
        raise TypeError(
            f"peft_model: expected a peft.PeftModel (with get_base_model()), got {type(peft_model).__name__}; "
            "use full_weights() for a plain model"
        )
    return get_base()


def _merged_lora_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """``parity.lora.merged_lora_weight`` (float32 when an adapter adds to the base), rounded to ``dtype`` once."""
    return merged_lora_weight(module).detach().to(dtype)


def _module_params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters())


def _effective_weights(name: str, module: nn.Module, dtype: torch.dtype) -> NamedTensors:
    """The weights the model's forward uses for ``module``, under HF names."""
    lora_layer, aux_wrapper = _lora_types()
    if isinstance(module, lora_layer):
        return [(f"{name}.weight", _merged_lora_weight(module, dtype))]
    if isinstance(module, aux_wrapper):
        if type(module).__name__ != "ModulesToSaveWrapper":
            raise NotImplementedError(f"{name}: PEFT wrapper {type(module).__name__} is not supported for export")
        active = module.active_adapters
        inner = module.original_module if module.disable_adapters or not active else module.modules_to_save[active[0]]
        return [(f"{name}.{p}", t.detach().to(dtype)) for p, t in inner.named_parameters()]
    return [(f"{name}.{p}", t.detach().to(dtype)) for p, t in module.named_parameters(recurse=False)]


def _group_of(leaf: str, fused_groups: Sequence[Sequence[str]]) -> Sequence[str] | None:
    for group in fused_groups:
        if leaf in group:
            return group
    return None


def iter_merged_lora_weights(
    peft_model: nn.Module,
    *,
    dtype: torch.dtype = torch.bfloat16,
    fused_groups: Sequence[Sequence[str]] = DEFAULT_FUSED_GROUPS,
    gather: Gather | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, weight) for every module a PEFT model changes, module by module.

    Yields: LoRA-wrapped modules' merged weights (see ``_merged_lora_weight``),
    ``modules_to_save`` copies under their base names, and the unchanged siblings
    of any LoRA-targeted member of a ``fused_groups`` group (pass ``()`` for an
    engine that does not fuse). Group members are yielded together, modules in
    model order, so an engine that rebuilds one layer at a time sees it whole.
    Tensors without a dtype change may alias the model's storage: consume them
    before the next optimizer step. The model is not modified.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype: expected a torch.dtype, got {dtype!r}")
    lora_layer, aux_wrapper = _lora_types()
    gather = gather or _no_gather
    root = _hf_root(peft_model)
    changed = [
        name
        for name, m in root.named_modules()
        if isinstance(m, (lora_layer, aux_wrapper)) and not _inside_wrapper(name, root, aux_wrapper)
    ]
    done: set[str] = set()
    for name in changed:
        if name in done:
            continue
        parent, _, leaf = name.rpartition(".")
        group = _group_of(leaf, fused_groups)
        members = [name] if group is None else [f"{parent}.{g}" if parent else g for g in group]
        for member in members:
            try:
                module = root.get_submodule(member)
            except AttributeError:
                continue  # this architecture does not have that sibling
            done.add(member)
            with torch.no_grad(), gather(_module_params(module)):
                yield from checkpoint_named(root, _effective_weights(member, module, dtype))


_LAYER_PREFIX = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_chunks(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int | None = None) -> Iterator[NamedTensors]:
    """Group consecutive (name, tensor) pairs into chunks of whole decoder layers (``...layers.<i>.``).

    For engines that take an update in chunks (``load_weight_chunks``): an update streamed this way
    holds at most one chunk of merged weights (never the whole model's), and a layer's
    fused groups stay in one chunk (``iter_merged_lora_weights`` yields a group's members
    together, in model order). Whole layers are added to a chunk while it stays within
    ``max_bytes`` (a layer larger than that is a chunk alone); None: one layer per chunk.
    Tensors outside the decoder layers form chunks of their own runs. Lazy: a chunk is
    yielded as soon as it is known to be complete, which takes the first tensor of the
    next layer (or, when the chunk still has room, the whole next layer).
    """
    def runs() -> Iterator[NamedTensors]:
        run: NamedTensors = []
        key: object = object()
        for name, tensor in named:
            m = _LAYER_PREFIX.match(name)
            k = m.group(1) if m else None
            if run and k != key:
                yield run
                run = []
            key = k
            run.append((name, tensor))
        if run:
            yield run

    if max_bytes is None:
        yield from runs()
        return
    chunk: NamedTensors = []
    size = 0
    for run in runs():
        b = payload_bytes(run)
        if chunk and size + b > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk += run
        size += b
        if size >= max_bytes:  # full: no further layer fits, so do not hold it while the next one is made
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _inside_wrapper(name: str, root: nn.Module, aux_wrapper: type) -> bool:
    """True for modules nested inside a ModulesToSaveWrapper (its copies and original)."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        if isinstance(root.get_submodule(".".join(parts[:i])), aux_wrapper):
            return True
    return False


def merged_lora_weights(
    peft_model: nn.Module,
    *,
    dtype: torch.dtype = torch.bfloat16,
    fused_groups: Sequence[Sequence[str]] = DEFAULT_FUSED_GROUPS,
    gather: Gather | None = None,
) -> NamedTensors:
    """List form of ``iter_merged_lora_weights`` (same arguments)."""
    return list(iter_merged_lora_weights(peft_model, dtype=dtype, fused_groups=fused_groups, gather=gather))


def effective_state(peft_model: nn.Module, *, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every weight the engine holds after a sync, HF-named: base parameters cast to ``dtype``, each
    LoRA-wrapped module's weight merged by ``_merged_lora_weight`` (the sync's own arithmetic).

    What exact mode's trainer-side forward runs on (``trainer.models.exact``), so that it
    multiplies by the same rounded matrices as the engine. Tied parameters appear once.
    ``modules_to_save`` and LoRA variants are refused (exact mode does not cover them).
    """
    lora_layer, aux_wrapper = _lora_types()
    root = _hf_root(peft_model)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in root.named_modules():
            if isinstance(module, aux_wrapper):
                raise NotImplementedError(f"{name}: modules_to_save ({type(module).__name__}) is not covered")
            if isinstance(module, lora_layer):
                out[f"{name}.weight"] = _merged_lora_weight(module, dtype)
                bias = module.get_base_layer().bias
                if bias is not None:
                    out[f"{name}.bias"] = bias.detach().to(dtype)
        for name, p in root.named_parameters():
            if ".lora_" in name or ".base_layer." in name:
                continue
            out[name] = p.detach().to(dtype)
    return out


def full_weights(model: nn.Module, *, dtype: torch.dtype = torch.bfloat16) -> NamedTensors:
    """Every parameter of a plain Transformers model, under its HF name, cast to ``dtype``.

    Tied parameters appear once (under the first name, usually the input
    embedding), which is what vLLM expects for tied checkpoints. Named as the
    checkpoint holds them (``rollout.checkpoint_names``: an MoE model's fused
    experts split per expert).
    """
    if hasattr(model, "peft_config"):
        raise TypeError("model: this is a PEFT model; use merged_lora_weights() to get base-model names")
    with torch.no_grad():
        return checkpoint_named(model, [(name, p.detach().to(dtype)) for name, p in model.named_parameters()])


def payload_bytes(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Total size of the tensors in bytes (for logging the sync size)."""
    return sum(t.numel() * t.element_size() for _, t in named_tensors)
