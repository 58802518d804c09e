"""Rollout side of exact mode on CPU: vLLM's own kernels, made invariant to the batch.

Two of vLLM's CPU choices make a token's numbers depend on what else is in the batch; this
module removes both for an exact-mode engine and nothing else changes:

Measured with vLLM 0.32 on CPU (``tests/rollout/test_engine_forward.py``): the GEMM vLLM picks for an
unquantized linear layer (oneDNN via ``dispatch_cpu_unquantized_gemm``) gives a row the same
bits for every batch of M >= 2 rows (checked up to M = 4096, float32 and bfloat16), but a
single row (M = 1) takes another reduction order when the inner dimension is large (SmolLM2's
down_proj, K = 1536: the last sequence still decoding, or a one-token prefill after a prefix
hit). On a CPU with AMX tiles, read from vLLM's source and not measured (no such host here): bf16 weights of
up to 1 MiB (SmolLM2's q/k/v/o projections) go to SGLang's ``weight_packed_linear`` instead
(``vllm/model_executor/layers/utils.py`` ``check_cpu_sgl_kernel``), whose AMX brgemm runs only for M > 4 rows
(``csrc/cpu/sgl-kernels/gemm.h`` ``can_use_brgemm<at::BFloat16>``) and another kernel below: decode steps with
1-4 sequences left would part from the trainer's prefill, our reading of exact mode's 3e-2 on SmolLM2 bf16 on
an AMX host. A trainer forward always has many rows, so the engine must never multiply fewer than
``MIN_ROWS``: ``invariant_linear`` pads a product of 1-4 rows with copies of its first and keeps its own.

And the attention: vLLM splits a sequence's KV over threads depending on the batch
(``kv_split``); an exact-mode engine's attention metadata is built without the split.

Importing this module registers the quantization method ``"parityrl_exact"`` (``EXACT``) whose
linear layers and lm_head keep vLLM's weights and GEMM dispatch and only route the product
through ``invariant_linear`` — the function ``rollout.engine_forward`` calls on the trainer side.
Started as ``VLLMEngine(model, quantization=EXACT)`` by ``trainer.sampling.engines`` for
``precision.recipe: exact`` (in-process engine: the registration lives in this process).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from rollout.vllm_plugins.names import EXACT

__all__ = ["EXACT", "ExactConfig", "MIN_ROWS", "invariant_linear", "kv_split"]


# The fewest rows a product is computed with: above SGLang's AMX brgemm threshold (M > 4; module docstring), and
# >= 2 for oneDNN's lone-row order.
MIN_ROWS = 5


def invariant_linear(gemm: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``gemm(x)`` that gives every row the bits it gets inside a batch of ``MIN_ROWS`` or more rows.

    vLLM's CPU GEMMs pick their kernel or reduction order by the row count (module docstring): oneDNN for a lone
    row when K is large (measured: K = 1536 differs, K <= 576 does not; every M >= 2 agrees), SGLang's AMX path
    for M <= 4. A product of fewer than ``MIN_ROWS`` rows is computed with copies of its first row appended.
    """
    shape = x.shape
    rows = x.numel() // shape[-1]
    if rows >= MIN_ROWS:
        return gemm(x)
    flat = x.reshape(rows, shape[-1])
    padded = torch.cat([flat, flat[:1].expand(MIN_ROWS - rows, shape[-1])]).contiguous()
    return gemm(padded)[:rows].reshape(*shape[:-1], -1)


def kv_split(vllm_config) -> bool:
    """Whether the engine's CPU attention splits one sequence's KV over threads.

    vLLM does (``VLLM_CPU_ATTN_SPLIT_KV``, default on) when the batch leaves threads idle, and
    the split depends on the whole batch: measured, a sequence's decode log-probs changed
    (1.3e-5 on SmolLM2, float32) from the step at which a sibling finished. Exact mode turns it
    off for its engine (``ExactCPUAttentionBuilder``). Measured cost at 8 prompts x 4 x 32 tokens
    on SmolLM2 (``bench/parity/bench_exact.py``): none (rollout time 0.98x of the default's); it would
    show where few long sequences leave threads idle.
    """
    from vllm import envs

    return not isinstance(vllm_config.quant_config, ExactConfig) and bool(envs.VLLM_CPU_ATTN_SPLIT_KV)


class ExactLinearMethod(UnquantizedLinearMethod):
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return invariant_linear(lambda rows: super(ExactLinearMethod, self).apply(layer, rows, bias), x)


class ExactLMHeadMethod(UnquantizedEmbeddingMethod):
    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        return invariant_linear(lambda rows: super(ExactLMHeadMethod, self).apply(layer, rows, bias), x)


class ExactCPUAttentionBuilder(CPUAttentionMetadataBuilder):
    """vLLM's CPU attention metadata, without the KV split for an exact-mode engine (see ``kv_split``)."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        from vllm import _custom_ops as ops

        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if kv_split(self.vllm_config) or self.is_encoder_only_attention or md.dynamic_causal is not None:
            return md
        md.scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=common_attn_metadata.num_reqs, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, seq_lens=md.seq_lens, dtype=self.dtype, query_start_loc=md.query_start_loc,
            causal=md.causal, sliding_window_size=self.window_size, isa=self.isa, enable_kv_split=False,
            dynamic_causal=None, kv_cache_dtype=self.kv_cache_dtype)
        return md


class ExactCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU attention with ``ExactCPUAttentionBuilder``; the same as vLLM's for any other engine."""

    @staticmethod
    def get_builder_cls():
        return ExactCPUAttentionBuilder


# The CPU platform always picks CPU_ATTN (vllm/platforms/cpu.py), so exact mode overrides that
# entry; engines without ExactConfig get vLLM's behaviour unchanged from the subclass.
register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.ExactCPUAttentionBackend")


@register_quantization_config(EXACT)
class ExactConfig(QuantizationConfig):
    """No quantization: vLLM's unquantized layers with row-count-invariant products (exact mode)."""

    def get_name(self) -> str:
        return EXACT

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "ExactConfig":
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Optional[QuantizeMethodBase]:
        if isinstance(layer, ParallelLMHead):
            return ExactLMHeadMethod()
        if isinstance(layer, LinearBase):
            return ExactLinearMethod()
        return None  # embeddings (a lookup), attention
