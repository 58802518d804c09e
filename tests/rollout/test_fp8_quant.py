"""FP8 recipes, engine side: the emulated vLLM quantization method (CPU) and the CUDA weight format.

The quantized engine runs in a SUBPROCESS (bench/parity/bench_fp8_parity.py): a second vLLM engine in this
process would break the session's shared engine.

Figures (builtin:tiny, T=0.7, 16 prompts x 2 samples x 32 tokens, seeds 0/1/2, initial / after a LoRA sync):
    BF16 engine vs BF16 trainer            MAE 0.0008-0.0013
    fp8_unified (FP8 engine, FP8 trainer)  MAE 0.0026-0.0054
    fp8_rollout (FP8 engine, BF16 trainer) MAE 0.0032-0.0095   (1.2x-2.2x fp8_unified, pooled 1.3x-1.9x)
    stale (sync skipped)                   MAE 0.037-0.045
fp8_unified is not at the BF16 floor although the engine holds the trainer's quantized weights bitwise:
FP8 rounding amplifies the BF16 kernel differences upstream of each quantizer (a value near a rounding
boundary flips by a whole E4M3 step, 2^-4 relative, instead of a BF16 step, 2^-8).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from parity.precision import (
    FP8_TARGETS,
    dequantize_weight_blocks,
    fake_quant_weight,
    fake_quant_weight_shards,
    fp8_linear,
)
from rollout.engine_options import block_fp8_kwargs, emulated_fp8_kwargs
from rollout.fp8_weights import (
    FP8_BLOCK_QUANT_CONFIG,
    FP8_LINEAR_KERNEL,
    check_cuda_block_shapes,
    check_engine_fp8_layers,
    engine_fp8_layers,
    fp8_block_weights,
    is_fp8_layer,
    is_fp8_target,
    write_fp8_checkpoint,
)
from rollout.vllm_plugins.names import EMULATED_FP8
from rollout.weight_updates import to_engine_dtype

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
UNIFIED_BOUND = 0.01  # half the suite's BF16 engine-vs-HF bound (MAE_BOUND = 0.02 in test_vllm_engine.py)


# ---- fast: the vLLM quantization method without an engine ------------------------------------------
def test_registered_with_vllm_and_buildable_without_arguments():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from rollout.vllm_plugins.fp8_quant import EmulatedFp8Config

    assert EMULATED_FP8 in QUANTIZATION_METHODS
    assert get_quantization_config(EMULATED_FP8) is EmulatedFp8Config
    cfg = EmulatedFp8Config()  # what vLLM's get_quant_config does when config.json has no quantization_config
    assert cfg.get_name() == EMULATED_FP8 and cfg.get_config_filenames() == []
    assert torch.bfloat16 in cfg.get_supported_act_dtypes()
    assert EmulatedFp8Config.from_config({"targets": ["q_proj"]}).targets == ("q_proj",)


def test_which_layers_are_quantized():
    from rollout.vllm_plugins.fp8_quant import EmulatedFp8Config

    cfg = EmulatedFp8Config()
    cfg.packed_modules_mapping = LLAMA_PACKED  # vLLM sets it from the model class
    for prefix in ("model.layers.0.self_attn.qkv_proj", "model.layers.3.self_attn.o_proj",
                   "model.layers.11.mlp.gate_up_proj", "model.layers.0.mlp.down_proj"):
        assert cfg.is_target(prefix), prefix
    for prefix in ("lm_head", "model.embed_tokens", "model.norm", "model.layers.0.self_attn.attn", "qkv_proj"):
        assert not cfg.is_target(prefix), prefix
    assert cfg.get_quant_method(torch.nn.Linear(2, 2), "model.layers.0.mlp.down_proj") is None  # not a vLLM LinearBase
    partial = EmulatedFp8Config(targets=("q_proj", "v_proj"))
    partial.packed_modules_mapping = LLAMA_PACKED
    with pytest.raises(ValueError, match="k_proj"):
        partial.is_target("model.layers.0.self_attn.qkv_proj")
    assert not partial.is_target("model.layers.0.mlp.down_proj")


@pytest.fixture
def no_tp(monkeypatch):
    """vLLM parameters ask the tensor-parallel group for their rank; there is none outside an engine."""
    import vllm.model_executor.parameter as param

    monkeypatch.setattr(param, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(param, "get_tensor_model_parallel_world_size", lambda: 1)


def test_linear_method_is_the_trainer_s_computation(no_tp):
    from rollout.vllm_plugins.fp8_quant import EmulatedFp8LinearMethod

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 192, generator=g).bfloat16() * s for n, s in ((128, 1.0), (64, 0.01), (64, 1.0)))
    layer, method = torch.nn.Module(), EmulatedFp8LinearMethod()
    method.create_weights(layer, 192, [128, 64, 64], 192, 256, torch.bfloat16, weight_loader=None)
    assert layer.weight.shape == (256, 192) and layer.fp8_shard_rows == [128, 64, 64]
    layer.weight.data.copy_(torch.cat([q, k, v]))
    method.process_weights_after_loading(layer)
    # Per-module blocks (k's 64 rows are their own block), exactly the trainer's q/k/v weights.
    assert torch.equal(layer.weight.data, torch.cat([fake_quant_weight(t) for t in (q, k, v)]))
    x = torch.randn(7, 192, generator=g).bfloat16()
    got = method.apply(layer, x)
    assert torch.equal(got, torch.cat([fp8_linear(x, t) for t in (q, k, v)], dim=-1))
    # A second load of the same (already quantized) values changes nothing: idempotent.
    before = layer.weight.data.clone()
    method.process_weights_after_loading(layer)
    assert torch.equal(layer.weight.data, before)


def test_tensor_parallel_shards_must_cover_whole_blocks(no_tp):
    from rollout.vllm_plugins.fp8_quant import EmulatedFp8LinearMethod

    with pytest.raises(ValueError, match="whole"):
        EmulatedFp8LinearMethod().create_weights(torch.nn.Module(), 96, [256], 192, 256, torch.bfloat16,
                                                 weight_loader=None)  # row-parallel shard of 96 inputs
    with pytest.raises(ValueError, match="whole"):
        EmulatedFp8LinearMethod().create_weights(torch.nn.Module(), 192, [96], 192, 192, torch.bfloat16,
                                                 weight_loader=None)  # column-parallel shard of 96 rows


# ---- fast: engine options and the CUDA weight format -----------------------------------------------
def test_fp8_engine_options():
    """The building blocks the FP8 recipes compose (each recipe's: tests/trainer/precision/test_records.py)."""
    assert emulated_fp8_kwargs() == {"quantization": EMULATED_FP8}
    assert block_fp8_kwargs() == {"quantization": "fp8",
                                  "kernel_config": {"linear_backend_per_quant": {"fp8_block_w8a8": "cutlass"}}}


def test_fp8_block_weights_format():
    g = torch.Generator().manual_seed(1)
    named = [("model.layers.0.self_attn.q_proj.weight", torch.randn(256, 200, generator=g).bfloat16()),
             ("model.layers.0.input_layernorm.weight", torch.ones(200, dtype=torch.bfloat16)),
             ("lm_head.weight", torch.randn(50, 200, generator=g).bfloat16())]
    out = dict(fp8_block_weights(named))
    assert list(out) == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_proj.weight_scale_inv",
                         "model.layers.0.input_layernorm.weight", "lm_head.weight"]
    q, s = out["model.layers.0.self_attn.q_proj.weight"], out["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (256, 200)
    assert s.dtype == torch.float32 and s.shape == (2, 2)
    # What the CUDA engine dequantizes is bitwise what the trainer multiplies by.
    assert torch.equal(dequantize_weight_blocks(q, s, torch.bfloat16), fake_quant_weight(named[0][1]))
    assert out["lm_head.weight"] is named[2][1] and out["model.layers.0.input_layernorm.weight"] is named[1][1]
    assert is_fp8_target("model.layers.3.mlp.down_proj.weight") and not is_fp8_target("model.layers.3.mlp.down_proj.bias")
    assert not is_fp8_target("lm_head.weight") and not is_fp8_target("q_proj.weight")
    # Routed experts are a FusedMoE in vLLM, not linear layers: BF16, as in the emulation and the trainer.
    assert not is_fp8_target("model.layers.0.mlp.experts.3.down_proj.weight")
    assert is_fp8_target("model.layers.0.mlp.shared_expert.down_proj.weight")


def test_cuda_block_shapes_are_checked_up_front():
    ok = {"model.layers.0.self_attn.q_proj.weight": (256, 256), "model.layers.0.self_attn.k_proj.weight": (128, 256),
          "model.layers.0.self_attn.v_proj.weight": (100, 256), "lm_head.weight": (300, 256)}
    check_cuda_block_shapes(ok)  # the last shard of a fused group may be ragged
    with pytest.raises(ValueError, match=r"k_proj.weight: 64 rows"):
        check_cuda_block_shapes({**ok, "model.layers.0.self_attn.k_proj.weight": (64, 256)})  # the tiny model's k/v
    with pytest.raises(ValueError, match="K=200"):
        check_cuda_block_shapes({"model.layers.0.mlp.down_proj.weight": (256, 200)})


def test_write_fp8_checkpoint(tmp_path):
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    from trainer.builtin.tiny import ensure_tiny_base

    with pytest.raises(ValueError, match="k_proj.weight: 64 rows"):
        write_fp8_checkpoint(ensure_tiny_base(), tmp_path / "tiny-fp8")  # CPU emulation only
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    src = tmp_path / "src"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    merged_q = torch.randn(256, 256).bfloat16()
    out = write_fp8_checkpoint(src, tmp_path / "fp8",
                               named_tensors=[("model.layers.0.self_attn.q_proj.weight", merged_q)])
    conf = json.loads((out / "config.json").read_text())
    assert conf["quantization_config"] == {**FP8_BLOCK_QUANT_CONFIG,
                                           "ignored_layers": ["lm_head", "model.embed_tokens"]}
    assert Fp8Config.from_config(conf["quantization_config"]).weight_block_size == [128, 128]
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for leaf in FP8_TARGETS:
            module = f"model.layers.0.{'self_attn' if leaf in ('q_proj', 'k_proj', 'v_proj', 'o_proj') else 'mlp'}.{leaf}"
            assert f.get_tensor(f"{module}.weight").dtype == torch.float8_e4m3fn
            assert f.get_tensor(f"{module}.weight_scale_inv").dtype == torch.float32
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale_inv")
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert torch.equal(dequantize_weight_blocks(q, s), fake_quant_weight(merged_q))
    assert "model.embed_tokens.weight" in keys and "lm_head.weight_scale_inv" not in keys
    with pytest.raises(FileExistsError):
        write_fp8_checkpoint(src, out)


def test_engine_keeps_fp8_tensors_and_scales_in_their_dtype():
    q = torch.zeros(2, 2, dtype=torch.float8_e4m3fn)
    assert to_engine_dtype("a.weight", q, torch.bfloat16) is q
    s = torch.ones(1, 1)
    assert to_engine_dtype("a.weight_scale_inv", s, torch.bfloat16).dtype == torch.float32
    assert to_engine_dtype("a.weight", torch.ones(2), torch.bfloat16).dtype == torch.bfloat16


def test_fused_engine_weight_equals_per_module_trainer_weights():
    """The engine's fused qkv quantization restarts blocks per shard (what makes the weight check below pass)."""
    w = torch.randn(256, 128).bfloat16()
    assert torch.equal(fake_quant_weight_shards(w, [128, 64, 64]),
                       torch.cat([fake_quant_weight(w[:128]), fake_quant_weight(w[128:192]), fake_quant_weight(w[192:])]))


# ---- fast: vLLM's own block-FP8 layers, built as on a Hopper GPU -----------------------------------
@pytest.fixture
def fake_sm90(monkeypatch, no_tp):
    """vLLM's block-FP8 layer construction as on an SM90 GPU with DeepGEMM and FlashInfer installed.

    The platform says CUDA to the kernel selection, and every CUDA candidate for block FP8
    (``_POSSIBLE_FP8_BLOCK_KERNELS``) says it can run: which one a layer gets is then vLLM's own choice
    (``choose_scaled_mm_linear_kernel``). The online-FP8 module asks the platform for CUTLASS support when
    it is imported, so it is imported (as on a CPU) before the platform changes.
    """
    import vllm.distributed
    import vllm.model_executor.kernels.linear as kl
    import vllm.model_executor.layers.quantization.online.fp8  # noqa: F401
    from vllm.platforms import PlatformEnum

    monkeypatch.setattr(kl.current_platform, "_enum", PlatformEnum.CUDA)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: 1)
    runs = classmethod(lambda cls, *args: (True, None))
    for kernel in kl._POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CUDA]:
        monkeypatch.setattr(kernel, "is_supported", runs)
        monkeypatch.setattr(kernel, "can_implement", runs)
    return kl


def _block_fp8_llama(tmp_path):
    """A Llama whose shapes vLLM's CUDA block-FP8 layers take (hidden 256, q 4x64, k/v 2x64, MLP 384), and its
    block-FP8 checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=384, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    src = tmp_path / "src"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(src)
    return src, write_fp8_checkpoint(src, tmp_path / "fp8")


def _vllm_decoder_linears(src, out, kernel_config: dict) -> torch.nn.Module:
    """Layer 0's four linear layers as vLLM's Llama builds them, with the Fp8Config read from the written
    checkpoint and the engine's ``kernel_config``, under the vLLM config an engine would have."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.config.kernel import KernelConfig
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    quant = Fp8Config.from_config(json.loads((out / "config.json").read_text())["quantization_config"])
    quant.packed_modules_mapping = dict(LLAMA_PACKED)  # as SupportsQuant.__new__ gives it
    config = VllmConfig(model_config=ModelConfig(model=str(src), dtype="bfloat16", skip_tokenizer_init=True),
                        kernel_config=KernelConfig(**kernel_config))
    p, kw = "model.layers.0.", dict(quant_config=quant, disable_tp=True, params_dtype=torch.bfloat16)
    with set_current_vllm_config(config):
        layers = torch.nn.ModuleDict({
            "qkv_proj": QKVParallelLinear(256, 64, 4, 2, prefix=p + "self_attn.qkv_proj", **kw),
            "o_proj": RowParallelLinear(256, 256, prefix=p + "self_attn.o_proj", **kw),
            "gate_up_proj": MergedColumnParallelLinear(256, [384, 384], prefix=p + "mlp.gate_up_proj", **kw),
            "down_proj": RowParallelLinear(384, 256, prefix=p + "mlp.down_proj", **kw)})
    return torch.nn.ModuleDict({"model": torch.nn.ModuleDict({"layers": torch.nn.ModuleList([layers])})})


def test_cuda_fp8_layers_run_the_cutlass_kernel_and_its_quantizer(fake_sm90, tmp_path, monkeypatch):
    from vllm.platforms import PlatformEnum

    src, out = _block_fp8_llama(tmp_path)
    # vLLM's own choice on this GPU: FlashInfer (its own activation quantizer) under 32 tokens, DeepGEMM above.
    default = engine_fp8_layers(_vllm_decoder_linears(src, out, {}))
    assert set(default.values()) == {("Fp8LinearMethod", "FlashInferFp8DeepGEMMDynamicBlockScaledKernel")}
    with pytest.raises(RuntimeError, match="FlashInferFp8DeepGEMMDynamicBlockScaledKernel, expected Cutlass"):
        check_engine_fp8_layers(default, LLAMA_PACKED)
    # The engine options of the CUDA FP8 recipes: every layer on CUTLASS.
    model = _vllm_decoder_linears(src, out, block_fp8_kwargs()["kernel_config"])
    pinned = engine_fp8_layers(model)
    assert pinned == {f"model.layers.0.{m}": ("Fp8LinearMethod", FP8_LINEAR_KERNEL) for m in (
        "qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    check_engine_fp8_layers(pinned, LLAMA_PACKED)
    o_proj = model["model"]["layers"][0]["o_proj"]
    quantizer = o_proj.quant_method.fp8_linear.quant_fp8  # no power-of-two scales, 1x128 dynamic groups
    assert quantizer.use_ue8m0 is False and quantizer.group_size == 128 and not quantizer.static
    # The weights and scales the trainer pushes are used as they are (no re-quantization after a load).
    from safetensors.torch import load_file

    pushed = load_file(str(out / "model.safetensors"))
    q, s = pushed["model.layers.0.self_attn.o_proj.weight"], pushed["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    o_proj.weight.data.copy_(q)
    o_proj.weight_scale_inv.data.copy_(s)
    o_proj.quant_method.process_weights_after_loading(o_proj)
    assert torch.equal(o_proj.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(o_proj.weight_scale_inv, s)
    # Where CUTLASS cannot run, no other kernel (another quantizer) is picked: the engine does not start.
    monkeypatch.setattr(fake_sm90.CutlassFp8BlockScaledMMKernel, "is_supported",
                        classmethod(lambda cls, *args: (False, "not on this device")))
    assert PlatformEnum.CUDA in fake_sm90._POSSIBLE_FP8_BLOCK_KERNELS
    with pytest.raises(ValueError, match="Failed to find a kernel"):
        _vllm_decoder_linears(src, out, block_fp8_kwargs()["kernel_config"])


def test_engine_fp8_layers_are_checked_against_the_recipe_s():
    phi3 = {"qkv_proj": ["qkv_proj"], "gate_up_proj": ["gate_up_proj"]}  # vLLM's Phi3ForCausalLM
    good = {"model.layers.0.self_attn.qkv_proj": ("UnquantizedLinearMethod", None),
            "model.layers.0.self_attn.o_proj": ("Fp8LinearMethod", FP8_LINEAR_KERNEL),
            "model.layers.0.mlp.gate_up_proj": ("UnquantizedLinearMethod", None),
            "model.layers.0.mlp.down_proj": ("Fp8LinearMethod", FP8_LINEAR_KERNEL),
            "model.layers.1.mlp.experts": ("UnquantizedFusedMoEMethod", None),
            "model.layers.1.mlp.gate": ("UnquantizedLinearMethod", None)}
    check_engine_fp8_layers(good, phi3)
    for prefix, bad, match in [
            ("model.layers.0.self_attn.qkv_proj", ("Fp8LinearMethod", FP8_LINEAR_KERNEL), "qkv_proj runs Fp8LinearMethod "
             "but is not an FP8 layer.*ignored_layers"),
            ("model.layers.1.mlp.experts", ("Fp8MoEMethod", None), "experts runs Fp8MoEMethod but is not"),
            ("model.layers.0.mlp.down_proj", ("UnquantizedLinearMethod", None), "down_proj runs Unquantized.*quantizes it"),
            ("model.layers.0.mlp.down_proj", ("Fp8LinearMethod", "DeepGemmFp8BlockScaledMMKernel"), "VLLM_DISABLED")]:
        with pytest.raises(RuntimeError, match=match):
            check_engine_fp8_layers({**good, prefix: bad}, phi3)
    assert is_fp8_layer("model.layers.0.self_attn.qkv_proj", LLAMA_PACKED)
    assert not is_fp8_layer("model.layers.0.self_attn.qkv_proj", phi3) and not is_fp8_layer("lm_head", LLAMA_PACKED)


# ---- fast: the block-FP8 checkpoint of every architecture, read by vLLM's own Fp8Config ----------------
# The zoo's models with the sizes vLLM's CUDA block-FP8 layers take (K and every fused shard but the last
# a multiple of 128), and an MLA model (DeepSeek-V3: latent q/kv projections that stay BF16, shared and
# routed experts, a dense first layer).
BLOCK_SIZES = dict(hidden_size=128, intermediate_size=256, head_dim=64, num_attention_heads=2, num_key_value_heads=2)
MOE_SIZES = dict(moe_intermediate_size=128, shared_expert_intermediate_size=256)
MLA = "deepseek_v3"
# Entries vLLM's model classes add to their packed_modules_mapping in __init__ for these configs.
INIT_PACKED = {"qwen2_moe": {"gate_up_proj": ["gate_proj", "up_proj"]},  # the shared expert (qwen2_moe.py)
               MLA: {"fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]}}  # q_lora_rank set (deepseek_v2.py)


def _all_archs():
    from trainer.builtin.zoo import ARCHITECTURES, MOE_ARCHITECTURES

    return sorted({**ARCHITECTURES, **MOE_ARCHITECTURES}) + [MLA]


def _block_shaped_model(arch: str):
    from trainer.builtin.zoo import MOE_ARCHITECTURES, build_arch_model

    if arch != MLA:
        moe = arch in MOE_ARCHITECTURES or arch == "qwen2_moe"
        return build_arch_model(arch, overrides={**BLOCK_SIZES, **(MOE_SIZES if moe else {})})[0]
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    config = DeepseekV3Config(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=128,
                              kv_lora_rank=128, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=128, n_group=1,
                              topk_group=1, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("arch", _all_archs())
def test_written_checkpoint_tells_vllm_which_layers_are_fp8(arch, tmp_path):
    """vLLM's Fp8Config, as its model loader configures it for the model class, skips (leaves BF16) exactly
    the layers the checkpoint keeps in BF16, on every linear layer's and fused MoE's vLLM prefix; and
    those are the layers the CPU emulation leaves BF16 too."""
    from types import SimpleNamespace

    from safetensors import safe_open
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    from vllm.model_executor.model_loader.utils import configure_quant_config
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import SupportsQuant

    from rollout.vllm_plugins.names import DECODER_LAYER

    model = _block_shaped_model(arch)
    src = tmp_path / "src"
    model.to(torch.bfloat16).save_pretrained(src)
    out = write_fp8_checkpoint(src, tmp_path / "fp8")
    conf = json.loads((out / "config.json").read_text())
    cls = ModelRegistry._try_load_model_cls(conf["architectures"][0])
    packed = {**cls.packed_modules_mapping, **INIT_PACKED.get(arch, {})}  # the model's, once built

    # The quant config as vLLM's loader hands it to the model (model_loader/utils.py configure_quant_config:
    # the class's mapping by reference, which __init__ then extends; models/interfaces.py
    # SupportsQuant.__new__: a copy taken before __init__) with the class's name mapper.
    quant = Fp8Config.from_config(conf["quantization_config"])
    configure_quant_config(quant, cls)
    if issubclass(cls, SupportsQuant):
        SupportsQuant._maybe_apply_model_mapping(SimpleNamespace(
            quant_config=quant, hf_to_vllm_mapper=cls.hf_to_vllm_mapper, packed_modules_mapping=cls.packed_modules_mapping))
    else:
        quant.packed_modules_mapping = packed
    shard_to_fused = {shard: fused for fused, shards in packed.items() for shard in shards}

    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        modules = {n[:-len(".weight")] for n in f.keys() if n.endswith(".weight") and len(f.get_slice(n).get_shape()) >= 2}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        quantized = {n[:-len(".weight_scale_inv")] for n in f.keys() if n.endswith(".weight_scale_inv")}
    prefixes = {}  # vLLM's layer prefix -> the HF modules it loads
    for m in modules:
        if not DECODER_LAYER.search(m):
            continue  # embeddings, lm_head: not linear layers in vLLM
        parent, leaf = m.rsplit(".", 1)
        block, index = parent.rsplit(".", 1)
        routed = index.isdigit() and block.endswith(".experts")  # one routed expert of vLLM's FusedMoE
        prefixes.setdefault(block if routed else f"{parent}.{shard_to_fused.get(leaf, leaf)}", set()).add(m)
    mapper = getattr(cls, "hf_to_vllm_mapper", None)
    wrong = []
    for prefix, hf_modules in sorted(prefixes.items()):
        vllm_prefix = mapper.get_rename_mapper().apply_list([prefix])[0] if mapper is not None else prefix
        skipped = is_layer_skipped(vllm_prefix, quant.ignored_layers, quant.packed_modules_mapping,
                                   match_mode=quant.ignored_layers_match_mode)
        emulated = is_fp8_layer(prefix, packed)  # what the CPU engine's plug-in quantizes
        if skipped == emulated or (hf_modules <= quantized) != emulated:
            wrong.append((prefix, skipped, emulated, sorted(hf_modules & quantized)))
    assert not wrong, wrong
    assert quantized  # o_proj and down_proj at least
    if arch in ("phi3", MLA) or arch in INIT_PACKED or "experts" in " ".join(prefixes):
        assert any(not is_fp8_layer(prefix, packed) for prefix in prefixes)  # decoder layers that stay BF16


# ---- slow: the quantized engine, in a subprocess ---------------------------------------------------
@pytest.mark.slow
def test_quantized_engine_matches_the_quantized_trainer(tmp_path, tiny_model_dir):
    from trainer.config import LoraConfig
    from trainer.models.policy import add_lora, load_base_model

    # A saved adapter (as a run's checkpoints/step_N/adapter), unlike the bench's own random one.
    adapter = tmp_path / "adapter"
    policy = add_lora(load_base_model(tiny_model_dir, "bfloat16"), LoraConfig(r=4, alpha=8.0, dropout=0.0))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in policy.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    policy.save_pretrained(adapter)
    out = tmp_path / "fp8.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "parity", "bench_fp8_parity.py"), "--model", tiny_model_dir,
                           "--json-out", str(out), "--adapters", str(adapter)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    print(json.dumps({k: r[k] for k in ("initial", "after_reload", "engine_methods")}, indent=1))
    methods = r["engine_methods"]
    assert {n: m for n, m in methods.items() if not n.endswith("lm_head")} and all(
        m == "EmulatedFp8LinearMethod" for n, m in methods.items() if not n.endswith("lm_head"))
    assert methods["lm_head"] == "UnquantizedEmbeddingMethod"
    for phase in ("initial", "after_reload"):
        p = r[phase]
        assert p["weight_mismatches"] == []  # the engine multiplies by the trainer's quantized weights, bitwise
        assert p["fp8_unified"]["mae"] < UNIFIED_BOUND, phase
        assert p["fp8_rollout"]["mae"] > p["fp8_unified"]["mae"], phase
    pooled = lambda key: sum(r[ph][key]["mae"] for ph in ("initial", "after_reload"))  # noqa: E731
    # Pooled over both phases the unified recipe is clearly closer: measured 1.3x when written, 1.108x on the
    # 2026-11-24 warm start (0.01095 vs 0.00988, the same with that day's and the previous code): the margin is
    # the model's, so the bound only asks for a gap well above float noise.
    assert pooled("fp8_rollout") > 1.05 * pooled("fp8_unified")
    # The sync reached the engine: scored against the pre-sync samples the new trainer is far off.
    assert r["after_reload"]["stale"]["mae"] > 5 * r["after_reload"]["fp8_unified"]["mae"]
    # A saved adapter pushed after that: the engine holds its weights bitwise (the previous ones would mismatch).
    at_adapter = r["adapters"][str(adapter)]
    assert at_adapter["weight_mismatches"] == []
    assert at_adapter["fp8_unified"]["mae"] < UNIFIED_BOUND
