"""Trainer side of ``fp8_unified``: the decoder's linear layers run ``parity.precision.fp8_linear``.

``convert_to_fp8(model)`` swaps, in place, the class of every targeted linear
layer inside the decoder layers (q/k/v/o/gate/up/down projections by default)
for a subclass whose forward is the FP8 quantized linear layer the rollout
engine runs (``rollout.vllm_plugins.fp8_quant``). Parameters, names, state dicts and
optimizer state are untouched: master weights, LoRA adapters and gradients
stay in their own dtypes (BF16 base, float32 adapters), and only the operands
of each GEMM are quantized (straight-through backward; ``parity.precision``).

Kept in BF16, by design (the quantized set is exactly the engine's):

- ``lm_head`` and the embeddings: the log-probs the parity metrics and the loss
  read come straight from lm_head, and it is small next to the decoder GEMMs;
  vLLM's ``ParallelLMHead`` / ``VocabParallelEmbedding`` are not linear layers
  to the quantization config either.
- norms, rotary embeddings, the attention softmax and the attention
  score/value products (QK^T, PV): not weight GEMMs; same in vLLM.

LoRA layers: the adapter is merged, not added on the side. The engine receives
merged weights ``W' = W + sum_a s_a B_a A_a`` at each sync
(``rollout.weight_export``: float32 sum, one rounding to BF16) and quantizes
W' in 128x128 blocks. The only trainer forward identical to that is::

    y = fp8_linear(x, bf16(W + s * B @ A))       # quantize the merged weight

(same float32 operations as the export, so W' is bitwise the engine's). A
quantized base plus a BF16 LoRA branch, ``Q(x) Q(W)^T + s x A^T B^T``, would
be a different function from anything the engine can run with merged weights.
Gradients reach A and B through the straight-through weight quantizer:
``dL/dW' = dL/dy^T Q(x)``, then ``dL/dA = s B^T dL/dW'`` and
``dL/dB = s dL/dW' A^T``. Consequence: an adapter update smaller than half an
E4M3 step of an element (2^-4 relative to that element) does not change the
forward until accumulated updates cross a rounding boundary; the master
adapter keeps accumulating them in float32 (Jet-RL, arXiv 2601.14243, trains
the same way: the rollout graph is a subgraph of the training graph).

Cost of merging, per LoRA layer and micro-batch, on the emulated backend: one extra [N, r] x [r, K]
GEMM and an [N, K] float32 temporary plus its quantization in the forward, and in the backward the
full weight gradient dL/dW' (tokens x N x K FLOPs, as much as the forward GEMM) before it is reduced
to A and B. On the FP8-GEMM backend (``scaled_mm``, CUDA) the merged weight is quantized once per
change of W, A or B and adapter state (``parity.fp8_gemm.Fp8WeightCache``: once per optimizer step
for the policy, once for the reference with the adapter off, side by side), and the backward takes
the adapters' gradients through the rank (``parity.fp8_gemm.Fp8CachedLinear``): the same STE
gradients, without the [N, K] product. ``fp8_weight_quantizations(model)`` counts the
quantizations (per step: ``reset=True``).
LoRA dropout cannot be applied to a merged weight (the
engine has none either): ``convert_to_fp8`` refuses adapters with dropout > 0.
"""
from __future__ import annotations

import warnings
from typing import Iterable, Optional

import torch
from torch import nn

from parity.fp8_gemm import FP8_BACKENDS, Fp8WeightCache, fp8_cached_linear, scaled_mm_supported, verify_scaled_mm
from parity.lora import merged_lora_weight
from parity.precision import FP8_TARGETS, fake_quant_weight, fp8_linear
from trainer.config.schema import RecipeError
from trainer.models.architecture import decoder_layers, decoder_linear_leaves

__all__ = ["FP8_TARGETS", "Fp8Linear", "convert_to_fp8", "fp8_targets", "fp8_weight_quantizations", "fp8_weights",
           "invalidate_fp8_caches", "is_fp8_module", "lora_merged_weight"]


def _weight_cache(module: nn.Module) -> Fp8WeightCache:
    """The layer's quantized-weight cache (a plain attribute: not a parameter, buffer or state-dict entry)."""
    cache = module.__dict__.get("_fp8_cache")
    if cache is None:
        cache = module.__dict__["_fp8_cache"] = Fp8WeightCache()
    return cache


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose forward is ``fp8_linear`` (same parameters, same state dict).

    backend "scaled_mm": FP8 GEMM on a weight quantized once per change of the weight
    (``parity.fp8_gemm.Fp8WeightCache``); "emulated": ``fp8_linear``, quantizing on every call.
    """

    fp8_backend: str = "emulated"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_backend != "scaled_mm":
            return fp8_linear(x, self.weight, self.bias)
        w = self.weight
        return fp8_cached_linear(x, _weight_cache(self), (w,), (), lambda: w.detach(), self.bias, weight=w)


def lora_merged_weight(module: nn.Module) -> torch.Tensor:
    """The weight a PEFT LoRA Linear's forward uses, differentiably: ``parity.lora.merged_lora_weight``
    (float32 when an adapter is added; the caller rounds it once to the compute dtype), the merge
    the weight sync sends the engine, so the trainer quantizes bitwise the engine's weight.

    Refuses adapters that are disabled but merged into the base: the base weight then holds them.
    """
    if module.disable_adapters and module.merged:
        raise RuntimeError(f"{type(module).__name__}: adapters are disabled but merged into the base weight; "
                           "unmerge them before an fp8 forward")
    return merged_lora_weight(module)


def fp8_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> the fake-quantized weight each converted layer's forward multiplies by (detached).

    The engine's quantized weights must equal these bitwise after a sync
    (``bench/parity/bench_fp8_parity.py`` checks it); the dtype is the model's.
    """
    root = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = {}
    with torch.no_grad():
        for name, m in root.named_modules():
            if is_fp8_module(m):
                w = lora_merged_weight(m) if hasattr(m, "lora_A") else m.weight
                dtype = m.get_base_layer().weight.dtype if hasattr(m, "lora_A") else m.weight.dtype
                out[f"{name}.weight"] = fake_quant_weight(w.detach().to(dtype))
    return out


def _lora_sources(module: nn.Module) -> tuple[list[torch.Tensor], tuple, list[tuple[torch.Tensor, torch.Tensor, float]]]:
    """What ``lora_merged_weight(module)`` is computed from: its tensors and values (the weight
    cache's key), and the (A, B, scaling) of each adapter it adds (their factored gradients)."""
    sources = [module.get_base_layer().weight]
    extra: list = [bool(module.disable_adapters), tuple(module.merged_adapters)]
    lora = []
    if not module.disable_adapters:
        for adapter in module.active_adapters:
            if adapter in module.lora_A and adapter not in module.merged_adapters:
                if module.fan_in_fan_out:  # PEFT resets it for an nn.Linear base; a [in, out] base is not one
                    raise NotImplementedError("fp8 LoRA layers: fan_in_fan_out (a transposed base weight) is not supported")
                a, b, s = module.lora_A[adapter].weight, module.lora_B[adapter].weight, float(module.scaling[adapter])
                sources += [a, b]
                extra.append((adapter, s))
                lora.append((a, b, s))
    return sources, tuple(extra), lora


def _fp8_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    self._check_forward_args(x, *args, **kwargs)
    if kwargs.get("adapter_names") is not None:
        raise NotImplementedError("fp8 LoRA layers do not support per-sample adapter_names (mixed-batch LoRA)")
    base = self.get_base_layer()
    if self.fp8_backend != "scaled_mm":
        w = lora_merged_weight(self)
        return fp8_linear(x, w.to(x.dtype), base.bias)
    if self.disable_adapters and self.merged:
        lora_merged_weight(self)  # raises: the base weight holds disabled adapters
    sources, extra, lora = _lora_sources(self)
    dtype = x.dtype
    return fp8_cached_linear(x, _weight_cache(self), sources, extra + (dtype,),
                             lambda: lora_merged_weight(self).to(dtype), base.bias, weight=base.weight, lora=lora)


_LORA_FP8_CLASSES: dict[type, type] = {}


def _fp8_lora_class(cls: type) -> type:
    """A subclass of a PEFT LoRA Linear class whose forward is ``_fp8_lora_forward`` (cached per class)."""
    if getattr(cls, "_parityrl_fp8", False):
        return cls
    if cls not in _LORA_FP8_CLASSES:
        _LORA_FP8_CLASSES[cls] = type(f"Fp8{cls.__name__}", (cls,), {
            "forward": _fp8_lora_forward, "fp8_backend": "emulated", "_parityrl_fp8": True,
            "__doc__": f"{cls.__qualname__} running fp8_linear on the merged weight (trainer.models.precision)."})
    return _LORA_FP8_CLASSES[cls]


def is_fp8_module(module: nn.Module) -> bool:
    return isinstance(module, Fp8Linear) or getattr(type(module), "_parityrl_fp8", False)


def fp8_targets(model: nn.Module) -> tuple[str, ...]:
    """The leaf names ``fp8_unified`` quantizes in this model: its decoder linear layers, if the engine quantizes the same.

    Derived from the model (``decoder_linear_leaves``: every Linear in the decoder blocks but
    MoE routers -- the LoRA ``all-linear`` set). The engine's quantization method
    (``rollout.vllm_plugins.fp8_quant.EmulatedFp8Config``) decides per vLLM layer from ``FP8_TARGETS`` and
    the model's fused-module mapping; both sides quantize the same set exactly when every
    leaf found here is one of ``FP8_TARGETS`` (tests/trainer/models/test_architectures.py
    compares the two sets per architecture). Refused otherwise, e.g. Phi3's fused
    ``qkv_proj``/``gate_up_proj``: the trainer's layer is one matrix on one 128x128 block grid,
    while vLLM's loader splits it into q/k/v (gate/up) shards whose grids restart at each shard,
    a different quantization whenever a shard is not a multiple of 128 rows.
    MoE routed experts are not Linear layers on either side (fused 3-D tensors; vLLM's
    ``FusedMoE``): they stay unquantized on both.
    """
    leaves = tuple(decoder_linear_leaves(model))
    other = [leaf for leaf in leaves if leaf not in FP8_TARGETS]
    if other:
        root = model.get_base_model() if hasattr(model, "get_base_model") else model
        raise RecipeError(f"the trainer's FP8 layers: {type(root).__name__}'s decoder linear layers {other} "
                         f"are not ones the engine's FP8 method quantizes per Hugging Face module ({list(FP8_TARGETS)}); "
                         "fused HF modules (e.g. Phi3's qkv_proj) would be quantized on different block grids by "
                         "the engine and the trainer")
    return leaves


def _check_lora(name: str, module: nn.Module) -> None:
    from peft.tuners.lora import Linear as LoraLinear

    if not isinstance(module, LoraLinear):
        raise TypeError(f"{name}: LoRA layer of type {type(module).__name__} is not supported by fp8 (only Linear)")
    if not isinstance(module.get_base_layer(), nn.Linear):
        raise TypeError(f"{name}: LoRA base layer is {type(module.get_base_layer()).__name__}, expected nn.Linear")
    for adapter in module.lora_A:
        dropout = module.lora_dropout[adapter]
        if not isinstance(dropout, nn.Identity) and getattr(dropout, "p", 0.0) > 0:
            raise ValueError(f"{name}: adapter {adapter!r} has LoRA dropout p={dropout.p}; the trainer's FP8 layers merge "
                             "the adapter into the quantized weight, where dropout cannot apply: set "
                             "model.lora.dropout = 0")
        if adapter in getattr(module, "lora_variant", {}) or getattr(module, "use_dora", {}).get(adapter):
            raise NotImplementedError(f"{name}: adapter {adapter!r} is a LoRA variant (e.g. DoRA); its merge is "
                                      "not W + s*B@A, fp8 supports plain LoRA only")
        if getattr(module.lora_B[adapter], "bias", None) is not None:
            raise NotImplementedError(f"{name}: adapter {adapter!r} has lora_bias=True; not supported by fp8")


def invalidate_fp8_caches(model: nn.Module) -> int:
    """Drop every converted layer's cached quantized weight (after writing weights through ``.data``,
    which tensor version counters do not see). Returns the number of caches dropped."""
    dropped = 0
    for m in model.modules():
        cache = m.__dict__.get("_fp8_cache")
        if cache is not None:
            cache.invalidate()
            dropped += 1
    return dropped


def fp8_weight_quantizations(model: nn.Module, *, reset: bool = False) -> int:
    """Weight quantizations of every converted layer's cache since the last reset (``reset=True``
    reads and zeroes them: a per-step count). Once per layer and adapter state in use per optimizer
    step when the cache works; 0 on the emulated backend, which keeps no cache."""
    total = 0
    for m in model.modules():
        cache = m.__dict__.get("_fp8_cache")
        if cache is not None:
            total += cache.quantizations
            if reset:
                cache.quantizations = 0
    return total


def _auto_backend(device: torch.device) -> str:
    """ "scaled_mm" where torch's block-scaled FP8 GEMM runs and passes ``verify_scaled_mm``, else "emulated"."""
    if device.type != "cuda":
        return "emulated"
    if not scaled_mm_supported(device):
        warnings.warn(f"fp8: no block-scaled FP8 GEMM on {device} (torch's needs CUDA SM 9.x and F.scaled_mm); "
                      "the trainer's FP8 layers run emulated (quantize -> dequantize -> BF16 GEMM)", stacklevel=3)
        return "emulated"
    try:
        verify_scaled_mm(device)
    except Exception as exc:  # noqa: BLE001 -- any failure of the check (cuBLASLt, Triton compile) means: emulate
        warnings.warn(f"fp8: the FP8 GEMM failed its check on {device} ({exc}); running emulated", stacklevel=3)
        return "emulated"
    return "scaled_mm"


def convert_to_fp8(model: nn.Module, *, targets: Optional[Iterable[str]] = None,
                   backend: Optional[str] = None) -> list[str]:
    """Make every targeted linear layer of the decoder run ``fp8_linear``, in place; returns their names.

    model: a Hugging Face causal LM, or a PEFT model wrapping one; call it
        *after* ``add_lora`` (a LoRA layer is converted as a whole, see module
        docstring; converting again after wrapping is fine, it is idempotent).
    targets: leaf names of the linear layers to quantize, inside ``<prefix>.layers``
        only (lm_head and embeddings are never touched). Every target must exist.
        None: ``fp8_targets(model)`` (which refuses architectures the engine would quantize differently).
    backend: "emulated" (quantize -> dequantize -> BF16 GEMM; any device), "scaled_mm"
        (CUDA SM 9.x: FP8 GEMMs on weights quantized once per optimizer step; checked once
        against the emulation here, refused if it fails), or None: "scaled_mm" on a CUDA
        model where it passes that check, else "emulated" (CPU: always; with a warning on CUDA).
    Names returned are relative to the Hugging Face model (e.g.
    ``model.layers.0.self_attn.q_proj``), i.e. the names the engine sync uses.
    """
    if backend is not None and backend not in FP8_BACKENDS:
        raise ValueError(f"backend = {backend!r}: expected one of {FP8_BACKENDS} or None (the device decides)")
    from peft.tuners.lora import LoraLayer

    targets = fp8_targets(model) if targets is None else tuple(targets)
    prefix, layers = decoder_layers(model)
    device = next(layers.parameters()).device
    if backend is None:
        backend = _auto_backend(device)
    elif backend == "scaled_mm":
        verify_scaled_mm(device)
    found: set[str] = set()
    converted: list[str] = []
    for name, module in layers.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets:
            continue
        full = f"{prefix}.{name}"
        if isinstance(module, LoraLayer):
            _check_lora(full, module)
            module.__class__ = _fp8_lora_class(type(module))
        elif type(module) in (nn.Linear, Fp8Linear):
            module.__class__ = Fp8Linear
        else:
            raise TypeError(f"{full}: expected nn.Linear or a PEFT LoRA Linear, got {type(module).__name__}")
        module.fp8_backend = backend
        module.__dict__.pop("_fp8_cache", None)
        found.add(leaf)
        converted.append(full)
    missing = [t for t in targets if t not in found]
    if missing:
        raise ValueError(f"convert_to_fp8: targets {missing} not found under {prefix} of {type(model).__name__}")
    return converted
