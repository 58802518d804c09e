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

Remaining difference on CUDA (documented; it needs a GPU to measure): vLLM's FP8
GEMM accumulates in float32 on tensor cores while the trainer's emulation runs a
BF16 GEMM on the dequantized operands (or ``torch`` ``scaled_mm`` with
``backend="scaled_mm"``); the quantized operands are identical. Keep DeepGEMM's
UE8M0 (power-of-two) scales off (``VLLM_USE_DEEP_GEMM_E8M0=0``, on Blackwell):
they round activation scales to powers of two, a different quantizer.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from parity.precision import BLOCK, FP8_TARGETS, quantize_weight_blocks
from rollout.vllm_plugins.names import DECODER_LAYER as _DECODER_LAYER, EMULATED_FP8

__all__ = [
    "FP8_BLOCK_QUANT_CONFIG",
    "SCALE_SUFFIX",
    "check_cuda_block_shapes",
    "fp8_block_weights",
    "is_fp8_target",
    "write_fp8_checkpoint",
]

# vLLM's Fp8Config for DeepSeek-V3-style block FP8 (vllm/model_executor/layers/quantization/fp8.py).
FP8_BLOCK_QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
SCALE_SUFFIX = "weight_scale_inv"
_FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def is_fp8_target(name: str, targets: Sequence[str] = FP8_TARGETS) -> bool:
    """``...layers.<i>.<...>.<leaf>.weight`` with leaf in ``targets`` (HF names)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in targets and bool(_DECODER_LAYER.search(name))


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


def write_fp8_checkpoint(src_dir: str | Path, out_dir: str | Path, *,
                         named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
                         targets: Sequence[str] = FP8_TARGETS) -> Path:
    """Write a block-FP8 copy of a local HF model for vLLM's ``fp8`` method; returns ``out_dir``.

    Copies every non-weight file of ``src_dir`` (tokenizer, generation config),
    adds ``quantization_config = FP8_BLOCK_QUANT_CONFIG`` to config.json and
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
    check_cuda_block_shapes({n: tuple(t.shape) for n, t in tensors.items()}, targets)
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = dict(FP8_BLOCK_QUANT_CONFIG)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({n: t.contiguous() for n, t in fp8_block_weights(tensors.items(), targets=targets)},
              str(out / "model.safetensors"))
    return out
