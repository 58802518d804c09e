"""Rollout side of the FP8 recipes on CPU: a vLLM quantization method running parity.precision.

vLLM's FP8 kernels (CUTLASS / DeepGEMM / Triton block-FP8 GEMMs) do not exist
on CPU. Importing this module registers, with
``vllm.model_executor.layers.quantization.register_quantization_config``, the
method ``"parityrl_fp8_emulated"`` (``EMULATED_FP8``), whose linear layers
compute exactly what the trainer's ``trainer.models.precision`` layers compute::

    y = parity.precision.fp8_linear(x, W)     # fake_quant_act(x) @ fake_quant_weight(W)^T, in BF16

i.e. the same function: E4M3, 128x128 weight blocks, 1x128 activation groups,
float32 scales, quantize -> dequantize -> BF16 GEMM. Use it with
``VLLMEngine(model, quantization=EMULATED_FP8)`` (``llm_kwargs`` go to
``vllm.LLM``); the engine must be in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
or the engine-core process must import this module too, since the
registration lives in the importing process.

How vLLM finds it without a quantization config in the model's config.json:
``LLM(quantization=name)`` -> ``get_quant_config``
(``vllm/model_executor/model_loader/weight_utils.py``) finds no
``quantization_config`` in the HF config, and since ``get_config_filenames()``
is empty it builds ``EmulatedFp8Config()`` with no arguments.

Which layers: ``get_quant_method`` returns ``EmulatedFp8LinearMethod`` for the
``LinearBase`` layers inside the decoder (``...layers.<i>...``) whose HF shards
are all in ``FP8_TARGETS`` (``qkv_proj`` = q,k,v; ``gate_up_proj`` = gate,up;
``o_proj``; ``down_proj``), ``UnquantizedLinearMethod`` for any other linear
layer, and ``None`` (= unquantized) for everything else: lm_head
(``ParallelLMHead``), embeddings, attention (no FP8 KV cache).

Weights: vLLM fuses q/k/v (and gate/up) into one matrix; the trainer quantizes
each HF module on its own, so blocks restart at every shard boundary
(``fake_quant_weight_shards`` with the layer's ``output_partition_sizes``).
``process_weights_after_loading`` replaces the BF16 weight by its
fake-quantized value once per load; ``apply`` then only quantizes the
activations. In-place weight sync (``collective_rpc("reload_weights")``,
``vllm/model_executor/model_loader/reload/layerwise.py``) rebuilds each layer
whose weights are sent from the construction-time metadata, loads the new
BF16 tensors, calls ``process_weights_after_loading`` again and copies the
result into the live storage; layers not sent keep their (already quantized)
weights. So the cached value is always the quantization of the last weights
pushed. Because the quantizer is idempotent in BF16, pushing the trainer's
master weights or its already fake-quantized weights yields the same engine
weights, bitwise (tests/parity/test_precision.py).

Tensor parallelism: a rank's shard restarts the block grid, so it must be a
whole number of 128-blocks along the split dimension; ``create_weights``
refuses otherwise rather than silently quantizing differently from the trainer.
"""
from __future__ import annotations

from typing import Any, Iterable, Optional

import torch
from vllm.model_executor.layers.linear import LinearBase, LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from parity.precision import BLOCK, FP8_TARGETS, fake_quant_weight_shards, fp8_linear
from rollout.fp8_weights import is_fp8_layer
from rollout.vllm_plugins.names import EMULATED_FP8

__all__ = ["EMULATED_FP8", "EmulatedFp8Config", "EmulatedFp8LinearMethod"]


class EmulatedFp8LinearMethod(LinearMethodBase):
    """BF16 weights stored fake-quantized (128x128 blocks per shard); activations fake-quantized per call."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        split_k = input_size_per_partition != input_size
        split_n = sum(output_partition_sizes) != output_size
        if (split_k and input_size_per_partition % BLOCK) or (
                split_n and any(s % BLOCK for s in output_partition_sizes)):
            raise ValueError(
                f"{getattr(layer, 'prefix', type(layer).__name__)}: a tensor-parallel shard of "
                f"{input_size_per_partition} inputs x {output_partition_sizes} outputs does not cover whole "
                f"{BLOCK}x{BLOCK} blocks, so the engine would quantize differently from the trainer; "
                "use a tensor-parallel size that splits the layer on block boundaries")
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        # Rows of each HF module in the fused weight (q, k, v / gate, up): each gets its own block grid.
        layer.fp8_shard_rows = list(output_partition_sizes)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        with torch.no_grad():
            layer.weight.data.copy_(fake_quant_weight_shards(layer.weight.data, layer.fp8_shard_rows))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, bias, weight_is_quantized=True)


@register_quantization_config(EMULATED_FP8)
class EmulatedFp8Config(QuantizationConfig):
    """FP8 block quantization emulated with parity.precision (any device; meant for CPU)."""

    def __init__(self, targets: Iterable[str] = FP8_TARGETS) -> None:
        super().__init__()
        self.targets = tuple(targets)

    def get_name(self) -> str:
        return EMULATED_FP8

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0  # plain torch ops: no GPU capability needed

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # nothing to read from the checkpoint: quantized on load

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "EmulatedFp8Config":
        return cls(targets=config.get("targets", FP8_TARGETS))

    def is_target(self, prefix: str) -> bool:
        """True for a decoder linear layer all of whose HF shards are targets (e.g. qkv_proj -> q,k,v): the rule
        the CUDA engine's layers are checked against too (``rollout.fp8_weights.is_fp8_layer``)."""
        return is_fp8_layer(prefix, self.packed_modules_mapping, self.targets)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if not isinstance(layer, LinearBase):
            return None  # lm_head, embeddings, attention: unquantized
        return EmulatedFp8LinearMethod() if self.is_target(prefix) else UnquantizedLinearMethod()
