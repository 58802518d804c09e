"""vLLM's own block-FP8 linear layers as a CUDA engine holds them, built on the CPU without an engine: one Llama
decoder layer's four linears (``Fp8LinearMethod`` on the CUTLASS kernel the CUDA FP8 recipes pin), loaded from a
block-FP8 checkpoint and reloaded through vLLM's in-place reload (``vllm/model_executor/model_loader/reload/``), the
path ``VLLMEngine.load_weights`` takes (``collective_rpc("reload_weights")``, Model Runner V2's too).

What stands in for the GPU: the kernel selection's platform says CUDA and every CUDA block-FP8 kernel says it runs
(as tests/rollout/test_fp8_quant.py's ``fake_sm90``), and the engine's ``kernel_config`` then makes vLLM pick CUTLASS;
no kernel is called. Everything a load does to the layers is vLLM's: ``create_weights``, the weight loaders of the
fused shards and their block scales, ``process_weights_after_loading``, and the layerwise reload. The model class's
name mapping (HF ``q_proj`` -> vLLM ``qkv_proj`` shard ``"q"``, Llama's ``stacked_params_mapping``) is written here.
"""
import json
from pathlib import Path

import torch

from rollout.engine_options import block_fp8_kwargs
from rollout.fp8_weights import write_fp8_checkpoint

PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
# vLLM's LlamaModel.load_weights: (fused parameter, HF leaf, shard id)
STACKED = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
           ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
PREFIX = "model.layers.0."
# HF module -> (vLLM module, shard index), as weight_sync's _locate finds them on an engine
WHERE = {f"{PREFIX}self_attn.{leaf}": (f"{PREFIX}self_attn.qkv_proj", i) for i, leaf in enumerate(PACKED["qkv_proj"])}
WHERE.update({f"{PREFIX}mlp.{leaf}": (f"{PREFIX}mlp.gate_up_proj", i) for i, leaf in enumerate(PACKED["gate_up_proj"])})
WHERE.update({f"{PREFIX}self_attn.o_proj": (f"{PREFIX}self_attn.o_proj", 0),
              f"{PREFIX}mlp.down_proj": (f"{PREFIX}mlp.down_proj", 0)})


def fake_sm90(monkeypatch) -> None:
    """vLLM's kernel selection as on an SM90 GPU (tests/rollout/test_fp8_quant.py ``fake_sm90``), and no
    tensor-parallel group (there is none outside an engine)."""
    import vllm.distributed
    import vllm.model_executor.kernels.linear as kl
    import vllm.model_executor.layers.quantization.online.fp8  # noqa: F401 - imported as on a CPU, before the switch
    import vllm.model_executor.parameter as param
    from vllm.platforms import PlatformEnum

    monkeypatch.setattr(param, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(param, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(kl.current_platform, "_enum", PlatformEnum.CUDA)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)
    runs = classmethod(lambda cls, *args: (True, None))
    for kernel in kl._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CUDA]:
        monkeypatch.setattr(kernel, "is_supported", runs)
        monkeypatch.setattr(kernel, "can_implement", runs)


def block_fp8_llama(tmp_path: Path) -> tuple[Path, Path]:
    """A one-layer Llama whose shapes vLLM's CUDA block-FP8 layers take (hidden 256, q 4x64, k/v 2x64, MLP 384),
    in bf16, and its block-FP8 checkpoint (``write_fp8_checkpoint``, as the engine's start writes it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    src = tmp_path / "src"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    return src, write_fp8_checkpoint(src, tmp_path / "fp8")


class BlockFp8Decoder(torch.nn.Module):
    """Layer 0's linears under the engine's module names (``model.layers.0.self_attn.qkv_proj``, ...), built by
    vLLM with the written checkpoint's ``Fp8Config`` and the CUDA FP8 recipes' ``kernel_config``."""

    def __init__(self, src: Path, fp8: Path) -> None:
        super().__init__()
        from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
        from vllm.config.kernel import KernelConfig
        from vllm.model_executor.layers.linear import (
            MergedColumnParallelLinear,
            QKVParallelLinear,
            RowParallelLinear,
        )
        from vllm.model_executor.layers.quantization.fp8 import Fp8Config
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        quant = Fp8Config.from_config(json.loads((fp8 / "config.json").read_text())["quantization_config"])
        quant.packed_modules_mapping = dict(PACKED)  # as SupportsQuant.__new__ gives it
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(src), dtype="bfloat16", skip_tokenizer_init=True),
            kernel_config=KernelConfig(**block_fp8_kwargs()["kernel_config"]))
        kw = dict(quant_config=quant, disable_tp=True, params_dtype=torch.bfloat16)
        with set_current_vllm_config(self.vllm_config):
            attn = torch.nn.ModuleDict({
                "qkv_proj": QKVParallelLinear(256, 64, 4, 2, prefix=PREFIX + "self_attn.qkv_proj", **kw),
                "o_proj": RowParallelLinear(256, 256, prefix=PREFIX + "self_attn.o_proj", **kw)})
            mlp = torch.nn.ModuleDict({
                "gate_up_proj": MergedColumnParallelLinear(256, [384, 384], prefix=PREFIX + "mlp.gate_up_proj", **kw),
                "down_proj": RowParallelLinear(384, 256, prefix=PREFIX + "mlp.down_proj", **kw)})
            layer = torch.nn.ModuleDict({"self_attn": attn, "mlp": mlp})
            self.model = torch.nn.ModuleDict({"layers": torch.nn.ModuleList([layer])})
            record_metadata_for_reloading(self)  # as vLLM's initialize_model does, before any load
        self._load_checkpoint(fp8)

    def linears(self) -> dict[str, torch.nn.Module]:
        return {name: m for name, m in self.named_modules() if hasattr(m, "quant_method")}

    def load_weights(self, weights) -> set[str]:
        """HF-named tensors into layer 0's linears through each parameter's own weight loader (vLLM's Llama
        ``load_weights`` for these names); other names are skipped. Returns the vLLM parameter names loaded."""
        layer, loaded = self.model["layers"][0], set()
        for name, t in weights:
            parts = name[len(PREFIX):].split(".") if name.startswith(PREFIX) else []
            if len(parts) != 3:
                continue  # other layers, norms
            block, leaf, attr = parts
            fused = next(((f, shard) for f, hf, shard in STACKED if hf == leaf), None)
            key = leaf if fused is None else fused[0]
            if key not in layer[block]:
                continue
            param = getattr(layer[block][key], attr)
            param.weight_loader(param, t, *(() if fused is None else (fused[1],)))
            loaded.add(f"model.layers.0.{block}.{key}.{attr}")
        return loaded

    def _load_checkpoint(self, fp8: Path) -> None:
        from safetensors.torch import load_file

        self.load_weights(load_file(str(fp8 / "model.safetensors")).items())
        for m in self.linears().values():
            m.quant_method.process_weights_after_loading(m)

    def reload(self, named) -> None:
        """``named`` through vLLM's in-place reload, as ``VLLMEngine.load_weights`` sends an update."""
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        reload_weights(self.vllm_config, self, list(named), None, True)
