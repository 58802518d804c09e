"""The CUDA FP8 recipes' weight format: vLLM's block-FP8 checkpoint and the tensors each sync pushes.

On CUDA, the recipes with an FP8 engine run vLLM's own block-FP8 linear layers
(``quantization="fp8"``, ``rollout.engine_options.block_fp8_kwargs``: ``Fp8LinearMethod`` with
``weight_block_size=[128, 128]`` and dynamic 1x128 activation groups,
``per_token_group_quant_fp8``), started from an FP8 checkpoint written by
``write_fp8_checkpoint`` and synced with ``fp8_block_weights``. Needs no vLLM import.
The tensor format below is tested on CPU; the CUDA engine path is not run by the
project's CPU-only tests.

CUDA weight sync, exactly: for every targeted decoder weight (leaf name in
``FP8_TARGETS`` under ``...layers.<i>.``, e.g.
``model.layers.0.self_attn.q_proj.weight`` [N, K] BF16, the merged LoRA
weight) two tensors are pushed, computed by ``parity.precision.quantize_weight_blocks``
-- the trainer's own quantizer, so the engine never re-quantizes:

    model.layers.0.self_attn.q_proj.weight             float8_e4m3fn [N, K]          q
    model.layers.0.self_attn.q_proj.weight_scale_inv   float32 [ceil(N/128), ceil(K/128)]   s  (W ~ q * s per block)

(``weight_scale_inv`` is the DeepSeek-V3 checkpoint name vLLM uses for the
block *dequantization* multiplier.) Every other tensor (lm_head, embeddings,
norms) goes as BF16, unchanged. vLLM's loader shards q/k/v into ``qkv_proj``
(rows of the scale at ``shard_offset / 128``), which is why vLLM requires every
shard but the last of a fused module to be a multiple of 128 rows, and its
activation quantizer needs K % 128 == 0; ``check_cuda_block_shapes`` refuses
other models up front (the built-in tiny model's 64-row k/v fail it: it runs the
CPU emulation only). ``VLLMEngine.load_weights`` keeps FP8 tensors and their
float32 scales in their dtype (``to_engine_dtype``) instead of casting to BF16.

Which layers: a block-FP8 checkpoint's config makes vLLM's ``Fp8Config`` give every linear layer
(and every fused MoE) an FP8 method unless its ``ignored_layers`` names it
(``Fp8Config.get_quant_method`` -> ``is_layer_skipped``,
``vllm/model_executor/layers/quantization/utils/quant_utils.py``); a layer with an FP8 method and
BF16 weights in the checkpoint computes with an uninitialised scale. So ``write_fp8_checkpoint``
lists in ``ignored_layers`` every weight matrix it keeps in BF16 (``unquantized_layers``: Phi3's fused
``qkv_proj``/``gate_up_proj``, MLA's ``q_a_proj``/``kv_a_proj_with_mqa``/``kv_b_proj``, routers,
embeddings, lm_head), by its Hugging Face module name: vLLM maps that list with the model class's
``hf_to_vllm_mapper`` and matches a fused layer by its own name or by all of its shards'
(``packed_modules_mapping``), a fused MoE by the names of its experts. Routed experts stay BF16, as in
the CPU emulation and the trainer (they are not linear layers on either side). The layers quantized on
CUDA are then those the emulation quantizes (``is_fp8_layer``), which the engine checks at start
(``check_engine_fp8_layers``), with the kernel each one runs.

The kernel: ``rollout.engine_options.block_fp8_kwargs`` pins vLLM's linear backend for these layers
to CUTLASS (``FP8_LINEAR_KERNEL``). Its activation quantizer is the CUDA op whose formula
``parity.precision`` follows, and it multiplies by the pushed weights and scales as they are. vLLM's
default on Hopper and Blackwell is another quantizer: the first kernel it tries,
``FlashInferFp8DeepGEMMDynamicBlockScaledKernel``, sends batches under 32 tokens to FlashInfer, which
takes BF16 activations and quantizes them itself, and the rest to DeepGEMM, which under
``VLLM_USE_DEEP_GEMM_E8M0=1`` (the default) rounds activation scales up to powers of two and
re-quantizes the loaded weights to power-of-two scales after every reload
(``kernels/linear/scaled_mm/flashinfer.py``, ``deep_gemm.py``; ``fp8_utils.requant_weight_ue8m0_inplace``).

Remaining difference on CUDA (documented; it needs a GPU to measure): vLLM's FP8
GEMM accumulates in float32 on tensor cores while the trainer's emulation runs a
BF16 GEMM on the dequantized operands (or ``torch`` ``scaled_mm`` with
``backend="scaled_mm"``); the quantized operands are identical.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Sequence

import torch

from parity.precision import BLOCK, FP8_TARGETS, quantize_weight_blocks
from rollout.vllm_plugins.names import DECODER_LAYER as _DECODER_LAYER, EMULATED_FP8, VISION_TOWER as _VISION_TOWER

__all__ = [
    "FP8_BLOCK_QUANT_CONFIG",
    "FP8_LINEAR_BACKEND",
    "FP8_LINEAR_KERNEL",
    "FP8_LINEAR_QUANT_KEY",
    "SCALE_SUFFIX",
    "block_fp8_tensors",
    "check_block_fp8_update",
    "check_cuda_block_shapes",
    "check_engine_fp8_layers",
    "engine_fp8_layers",
    "fp8_block_weights",
    "fp8_quant_config",
    "is_fp8_layer",
    "is_fp8_target",
    "scale_shard",
    "unquantized_layers",
    "write_fp8_checkpoint",
]

# vLLM's Fp8Config for DeepSeek-V3-style block FP8 (vllm/model_executor/layers/quantization/fp8.py).
FP8_BLOCK_QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
SCALE_SUFFIX = "weight_scale_inv"
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# One routed expert of a mixture-of-experts block (``mlp.experts.3.gate_proj``): vLLM fuses the experts
# into one FusedMoE, not a linear layer, so neither the emulation nor the trainer quantizes them.
_ROUTED_EXPERT = re.compile(r"(?:^|\.)experts\.\d+\.")
# vLLM's linear-backend key for block-FP8 layers with dynamic 1x128 activation groups
# (``init_fp8_linear_kernel`` in vllm/model_executor/kernels/linear/__init__.py), the backend pinned for
# it, and the kernel class that backend selects there (module docstring: why this one).
FP8_LINEAR_QUANT_KEY = "fp8_block_w8a8"
FP8_LINEAR_BACKEND = "cutlass"
FP8_LINEAR_KERNEL = "CutlassFp8BlockScaledMMKernel"


def is_fp8_target(name: str, targets: Sequence[str] = FP8_TARGETS) -> bool:
    """``...layers.<i>.<...>.<leaf>.weight`` with leaf in ``targets`` (HF names), routed experts and a vision tower's
    blocks excepted."""
    parts = name.split(".")
    return (len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in targets and bool(_DECODER_LAYER.search(name))
            and not _ROUTED_EXPERT.search(name) and not _VISION_TOWER.search(name))


def is_fp8_layer(prefix: str, packed: Mapping[str, Sequence[str]], targets: Sequence[str] = FP8_TARGETS) -> bool:
    """Whether the engine quantizes the vLLM layer ``prefix``: a decoder linear all of whose HF shards
    (``packed``: the model class's ``packed_modules_mapping``, e.g. qkv_proj -> q, k, v) are targets.

    ValueError for a fused layer only some of whose shards are targets: a fused layer shares its
    input quantization, so it is quantized whole or not at all.
    """
    if not _DECODER_LAYER.search(prefix) or _VISION_TOWER.search(prefix):
        return False
    leaf = prefix.rsplit(".", 1)[-1]
    shards = list(packed.get(leaf, [leaf]))
    hits = [sh in targets for sh in shards]
    if any(hits) and not all(hits):
        raise ValueError(f"{prefix} fuses {shards} but only {[sh for sh, h in zip(shards, hits) if h]} are fp8 "
                         "targets; a fused layer shares its input quantization, so target all or none")
    return all(hits)


def fp8_block_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                      targets: Sequence[str] = FP8_TARGETS) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, BF16 tensor) -> the CUDA engine's format: targeted weights as (FP8 q, float32 scale) pairs."""
    for name, t in named_tensors:
        if is_fp8_target(name, targets):
            q, s = quantize_weight_blocks(t)
            yield name, q
            yield name[: -len("weight")] + SCALE_SUFFIX, s
        else:
            yield name, t


def check_block_fp8_update(named: Iterable[tuple[str, torch.Tensor]], targets: Sequence[str] = FP8_TARGETS) -> None:
    """ValueError unless every FP8-targeted weight of an update for vLLM's block-FP8 layers comes as FP8 values with
    its float32 scale, and every scale with its values (``fp8_block_weights``' format).

    vLLM's in-place reload rebuilds each layer an update touches from its construction-time parameters and processes
    it once the layer's tensors are loaded (``vllm/model_executor/model_loader/reload/layerwise.py``): a float weight
    is cast into the float8 parameter unscaled, and a layer whose ``weight_scale_inv`` is not sent is processed with
    an uninitialised one, copied into the live layer. Either way the engine computes garbage from then on."""
    named = list(named)
    weights = {n: t for n, t in named if is_fp8_target(n, targets)}
    scales = {n[: -len(SCALE_SUFFIX)] + "weight" for n, _ in named if n.endswith("." + SCALE_SUFFIX)}
    bad = [f"{n} is {t.dtype}" for n, t in weights.items() if t.dtype != torch.float8_e4m3fn]
    bad += [f"{n} comes without its {SCALE_SUFFIX}" for n in weights if n not in scales]
    bad += [f"{n[:-len('weight')]}{SCALE_SUFFIX} comes without its weight" for n in scales if n not in weights]
    if bad:
        raise ValueError(f"an update for vLLM's block-FP8 layers: {'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}"
                         f"; expected each targeted weight as float8_e4m3fn values with its float32 {SCALE_SUFFIX} "
                         "(rollout.fp8_weights.fp8_block_weights of the float weights): vLLM's reload would cast a "
                         "float weight unscaled and process the layer with a scale it never loaded")


def check_cuda_block_shapes(shapes: dict[str, tuple[int, ...]], targets: Sequence[str] = FP8_TARGETS) -> None:
    """Refuse a model vLLM's CUDA block-FP8 layers cannot run with 128x128 blocks (module docstring)."""
    bad = []
    for name, shape in shapes.items():
        if not is_fp8_target(name, targets):
            continue
        n, k = shape
        if k % BLOCK:
            bad.append(f"{name}: K={k} not a multiple of {BLOCK} (activation groups)")
        leaf = name.split(".")[-2]
        for group in _FUSED:
            if leaf in group[:-1] and n % BLOCK:
                bad.append(f"{name}: {n} rows, not a multiple of {BLOCK}, and fused before {group[-1]}")
    if bad:
        raise ValueError("vLLM's CUDA block-FP8 layers cannot run this model with 128x128 blocks: "
                         + "; ".join(bad[:4]) + ("; ..." if len(bad) > 4 else "")
                         + f". On CPU use quantization={EMULATED_FP8!r}")


def unquantized_layers(shapes: Mapping[str, Sequence[int]], targets: Sequence[str] = FP8_TARGETS) -> list[str]:
    """HF module names of the checkpoint's weight matrices (2-D or more) that stay BF16, sorted:
    the ``ignored_layers`` vLLM's ``Fp8Config`` must be given (module docstring)."""
    return sorted({name[: -len(".weight")] for name, shape in shapes.items()
                   if name.endswith(".weight") and len(shape) >= 2 and not is_fp8_target(name, targets)})


def fp8_quant_config(shapes: Mapping[str, Sequence[int]], targets: Sequence[str] = FP8_TARGETS) -> dict:
    """The ``quantization_config`` of the block-FP8 checkpoint of a model with these tensor shapes."""
    return {**FP8_BLOCK_QUANT_CONFIG, "ignored_layers": unquantized_layers(shapes, targets)}


def engine_fp8_layers(model) -> dict[str, tuple[str, str | None]]:
    """vLLM module prefix -> (its quantization method's class name, its FP8 linear kernel's class name or
    None), for every linear layer and fused MoE of an engine's model (run in the engine:
    ``LLM.apply_model``). Reads vLLM objects by attribute only (``Fp8LinearMethod.fp8_linear``)."""
    out = {}
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        name = type(method).__name__
        if method is None or not (name.endswith("LinearMethod") or name.endswith("MoEMethod")):
            continue  # attention's KV-cache method, embeddings'
        kernel = getattr(method, "fp8_linear", None)
        out[prefix] = (name, None if kernel is None else type(kernel).__name__)
    return out


def block_fp8_tensors(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(FP8 values [N, K], float32 scales [ceil(N/128), ceil(K/128)]) that a vLLM block-FP8 linear layer multiplies
    by, copied to the CPU; None for any other layer (BF16, the CPU emulation's ``parityrl_fp8_emulated``).

    Read by attribute, as vLLM 0.32's ``Fp8LinearMethod`` leaves a layer on CUDA (read from its source, not run here):
    ``create_weights`` registers ``weight`` (float8_e4m3fn [N, K], fused shards stacked in rows) and
    ``weight_scale_inv`` (``BlockQuantScaleParameter``, one scale per 128x128 block, a shard's rows at
    ``shard_offset / 128``) and sets ``weight_block_size``; the CUTLASS kernel's ``process_weights_after_loading``
    (``Fp8BlockScaledMMLinearKernel`` -> ``process_fp8_weight_block_strategy``) keeps both as they are: no transpose,
    no padding off ROCm (``vllm/model_executor/layers/quantization/fp8.py``,
    ``kernels/linear/scaled_mm/BlockScaledMMLinearKernel.py``). ValueError for a block-FP8 layer holding them
    otherwise (vLLM's CPU kernels prepack the weight for AMX; ROCm's FNUZ format), naming the layer."""
    scale, block = getattr(layer, SCALE_SUFFIX, None), getattr(layer, "weight_block_size", None)
    if not isinstance(scale, torch.Tensor) or block is None:
        return None
    q = layer.weight
    n, k = int(layer.output_size_per_partition), int(layer.input_size_per_partition)
    grid = (-(-n // BLOCK), -(-k // BLOCK))
    if (list(block) != [BLOCK, BLOCK] or q.dtype != torch.float8_e4m3fn or tuple(q.shape) != (n, k)
            or scale.dtype != torch.float32 or tuple(scale.shape) != grid):
        raise ValueError(f"{getattr(layer, 'prefix', type(layer).__name__)}: a block-FP8 layer holding weight "
                         f"{q.dtype} {tuple(q.shape)}, {SCALE_SUFFIX} {scale.dtype} {tuple(scale.shape)}, blocks "
                         f"{list(block)}; expected float8_e4m3fn {(n, k)}, float32 {grid}, [{BLOCK}, {BLOCK}] (vLLM's "
                         "CUDA layout after loading: CUTLASS keeps the checkpoint's tensors as they are)")
    return q.detach().cpu().clone(), scale.detach().cpu().clone()


def scale_shard(scale: torch.Tensor, shard_rows: Sequence[int], i: int) -> torch.Tensor:
    """The rows of a fused layer's block scales [ceil(N/128), ...] that belong to its shard ``i`` (``shard_rows``: the
    rows of each shard, in vLLM's order): the scale of the Hugging Face module alone, as ``quantize_weight_blocks``
    gives it. vLLM's loader writes a shard's scales at row ``shard_offset / 128``, which is why it requires every shard
    but the last to be a multiple of 128 rows (``validate_fp8_block_shape``); ValueError otherwise."""
    start = sum(shard_rows[:i])
    if start % BLOCK:
        raise ValueError(f"shard {i} of {list(shard_rows)} starts at row {start}, not a multiple of {BLOCK}: its "
                         "block scales are not rows of the fused layer's")
    return scale[start // BLOCK: start // BLOCK + -(-shard_rows[i] // BLOCK)]


def check_engine_fp8_layers(layers: Mapping[str, tuple[str, str | None]], packed: Mapping[str, Sequence[str]],
                            targets: Sequence[str] = FP8_TARGETS) -> None:
    """RuntimeError unless the engine's FP8 layers are exactly those the emulation and the trainer
    quantize (``is_fp8_layer``), each running ``FP8_LINEAR_KERNEL``. ``layers``: ``engine_fp8_layers``."""
    problems = []
    for prefix, (method, kernel) in sorted(layers.items()):
        fp8 = method.startswith("Fp8")
        if fp8 and not is_fp8_layer(prefix, packed, targets):
            problems.append(f"{prefix} runs {method} but is not an FP8 layer of the recipe (its checkpoint weights are "
                            "BF16 and its scale would be uninitialised); the checkpoint's ignored_layers should name it "
                            "(a block-FP8 copy written by write_fp8_checkpoint does: delete an older copy, e.g. a run "
                            "directory's engine_fp8, to have it written again)")
        elif not fp8 and is_fp8_layer(prefix, packed, targets):
            problems.append(f"{prefix} runs {method}, but the recipe quantizes it (the trainer and the sync do)")
        elif fp8 and kernel != FP8_LINEAR_KERNEL:
            problems.append(f"{prefix} runs the FP8 kernel {kernel}, expected {FP8_LINEAR_KERNEL} (its activation "
                            "quantizer is parity.precision's; check that kernel_config.linear_backend_per_quant "
                            f"{{{FP8_LINEAR_QUANT_KEY!r}: {FP8_LINEAR_BACKEND!r}}} reached vLLM, and that "
                            "VLLM_DISABLED_KERNELS does not name it)")
    if problems:
        raise RuntimeError(f"the block-FP8 engine does not run the recipe's FP8 layers ({len(problems)} layer(s)): "
                           + "; ".join(problems[:4]) + ("; ..." if len(problems) > 4 else ""))


def write_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, *,
                         named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                         targets: Sequence[str] = FP8_TARGETS) -> Path:
    """Write a block-FP8 copy of a local HF model for vLLM's ``fp8`` method; returns ``out_dir``.

    Copies every non-weight file of ``src_dir`` (tokenizer, generation config),
    adds ``quantization_config = fp8_quant_config(...)`` (block FP8, ``ignored_layers``) to config.json and
    writes ``model.safetensors`` with ``fp8_block_weights`` of the checkpoint's
    tensors (or of ``named_tensors``, e.g. the trainer's merged weights, which
    replace the checkpoint's under the same names).
    """
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    files = sorted(src.glob("*.safetensors"))
    if not (src / "config.json").is_file() or not files:
        raise FileNotFoundError(f"{src}: expected a local Hugging Face model directory with config.json and *.safetensors")
    if out.exists():
        raise FileExistsError(f"{out} already exists; write_fp8_checkpoint writes a new directory")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    for name, t in named_tensors or ():
        if name not in tensors:
            raise ValueError(f"named_tensors: {name!r} is not in {src}'s checkpoint")
        tensors[name] = t.detach()
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    check_cuda_block_shapes(shapes, targets)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = fp8_quant_config(shapes, targets)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({n: t.contiguous() for n, t in fp8_block_weights(tensors.items(), targets=targets)},
              str(out / "model.safetensors"))
    return out
