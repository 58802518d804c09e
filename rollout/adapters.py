"""The trainer's LoRA adapter as an engine serves it: one version of the policy, as PEFT saves it.

With ``rollout.lora_sync: adapter`` the engine keeps the base weights it started with and runs the adapter beside
them, as the trainer's PEFT model does, instead of taking ``W + s·B·A`` merged and rounded to the model dtype
(``rollout.weight_export``): in BF16 every part of an update smaller than half a BF16 step of W rounds back to W
there, while an adapter keeps the update to the dtype's relative precision (B and A are rounded, not their
product's sum with W). It is also the smaller push: Qwen2.5-7B with r 16 on every linear is ~81 MB of adapter in
BF16 against ~13 GB of merged weights.

A ``LoraAdapter`` holds PEFT's own file format (``adapter_config.json`` + ``adapter_model.safetensors``, names
``base_model.model.<module>.lora_A.weight``), which vLLM loads (``vllm/lora/lora_model.py``,
``vllm/lora/peft_helper.py``) and PEFT itself reads back. Every sync is a new ``version``: vLLM caches an adapter
by its id and keys its prefix cache by the adapter's name and path (``vllm/v1/core/kv_cache_utils.py``
``_gen_lora_extra_hash_keys``), so a new name per version never reads KV computed by an older one.
"""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

Gather = Callable[[Sequence[nn.Parameter]], ContextManager]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The ranks a vLLM engine can be started with (vllm/config/lora.py ``MaxLoRARanks``): an adapter of rank r runs in
# an engine started with any of them >= r.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that serves an adapter of rank ``r``."""
    for allowed in VLLM_LORA_RANKS:
        if r <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {r}: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]} (vllm/config/lora.py)")


@dataclass
class LoraAdapter:
    """One version of the policy's LoRA adapter.

    ``config``: PEFT's ``adapter_config.json`` contents (r, lora_alpha, target_modules, ...), JSON-ready.
    ``tensors``: PEFT's save names -> [r, in] (lora_A) and [out, r] (lora_B) weights, in the dtype the engine
    asked for. ``version``: >= 1, a new one every sync.
    """

    version: int
    config: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"policy-v{self.version}"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    def write(self, directory: str | Path) -> Path:
        """PEFT's two files in ``directory`` (made if missing), the weights first and the config last, so a
        directory with a config holds a whole adapter."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(out / WEIGHTS_FILE))
        (out / CONFIG_FILE).write_text(json.dumps(self.config, indent=2, sort_keys=True))
        return out


def _json_ready(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if hasattr(value, "value") and type(value).__module__.startswith("peft"):  # PEFT's enums (task_type, ...)
        return value.value
    return value


def adapter_config(peft_model: nn.Module, adapter: str = "default") -> dict:
    """The active adapter's PEFT config as ``adapter_config.json`` holds it."""
    cfg = peft_model.peft_config[adapter]
    return json.loads(json.dumps(_json_ready(cfg.to_dict()), default=str))


def lora_modules(peft_model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(PEFT module name, module) of every LoRA layer, in model order (names as PEFT saves them:
    ``base_model.model.<HF module name>``)."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in peft_model.named_modules() if isinstance(m, LoraLayer)]


def lora_leaves(peft_model: nn.Module) -> list[str]:
    """The leaf names of the policy's LoRA layers (``q_proj``, ...), what an engine wraps to serve its adapter
    (``lora_target_modules``). Not the PEFT config's ``target_modules``: a vision-language policy holds one regex
    there (the language model's blocks only, ``trainer.models.policy.add_lora``), which read as a list of names is
    a list of its characters, and an engine wrapping no layer serves the adapter as zeros without a word."""
    return sorted({name.rsplit(".", 1)[-1] for name, _ in lora_modules(peft_model)})


def export_lora_adapter(peft_model: nn.Module, *, version: int, dtype: torch.dtype,
                        gather: Optional[Gather] = None, adapter: str = "default",
                        device: Optional[str] = "cpu") -> LoraAdapter:
    """The policy's adapter ``adapter`` as one ``LoraAdapter`` version, its weights copied in ``dtype`` to
    ``device`` (None: where they are; a model on the meta device then gives a size-only export).

    ``gather``: under ZeRO-3, gathers one module's shards at a time (every rank must call this then). The copy is
    taken, so the next optimizer step cannot change what the engine loads.
    """
    if not isinstance(version, int) or version < 1:
        raise ValueError(f"version = {version!r}: expected an integer >= 1")
    gather = gather or (lambda params: contextlib.nullcontext())
    tensors: dict[str, torch.Tensor] = {}
    for name, module in lora_modules(peft_model):
        if adapter not in getattr(module, "lora_A", {}):
            continue
        a, b = module.lora_A[adapter], module.lora_B[adapter]
        with torch.no_grad(), gather([a.weight, b.weight]):
            for key, w in (("lora_A", a.weight), ("lora_B", b.weight)):
                tensors[f"{name}.{key}.weight"] = w.detach().to(device=device or w.device, dtype=dtype, copy=True)
    if not tensors:
        raise ValueError(f"the policy has no LoRA layers of adapter {adapter!r} to export")
    return LoraAdapter(version=version, config=adapter_config(peft_model, adapter), tensors=tensors)

