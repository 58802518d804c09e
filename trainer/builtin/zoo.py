"""Small random-init decoders of several architectures, built offline from transformers' own config classes.

The architecture matrix of the test suite and of ``bench/parity/arch_parity.py``: one
model per family parityrl claims to support, each tiny (2 layers, hidden 64,
head_dim 32 -- a head size vLLM's CPU attention supports, see
``CPUAttentionBackend.get_supported_head_sizes``) and deterministic (fixed seed).

Weights are re-drawn with std ``INIT_STD`` = 0.2 and every bias (Qwen2's q/k/v,
Qwen2-MoE's) is non-zero: at transformers' default std 0.02 the next-token
distribution is nearly uniform and a dropped softcap, scale or bias moves the
log-probs by less than the bf16 noise, so a numerics bug would be invisible.
Norm weights are drawn around their neutral value (1 for ``x * w`` norms,
0 for Gemma's ``x * (1 + w)``) so the model stays well conditioned.

The tokenizer is the built-in tiny model's byte-level BPE (``trainer.builtin.tiny``),
so the models need nothing from a hub.
"""
from __future__ import annotations

import json
from pathlib import Path

from trainer.builtin.tiny import build_tokenizer, default_cache_dir, file_lock

__all__ = ["ARCHITECTURES", "INIT_STD", "MOE_ARCHITECTURES", "VOCAB", "build_arch_model", "ensure_arch_model"]

INIT_STD = 0.2
VOCAB = 512  # the tiny tokenizer fills exactly this many ids
ZOO_VERSION = 1  # bump when a config or the init changes: the cache key

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, max_position_embeddings=256)

# name -> (config class name, extra config kwargs). Gemma2 keeps its real softcap defaults
# (final_logit_softcapping=30, attn_logit_softcapping=50): those are what the matrix tests.
ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "gemma2": ("Gemma2Config", dict(query_pre_attn_scalar=32)),
    "phi3": ("Phi3Config", dict(tie_word_embeddings=False, pad_token_id=0)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=64, shared_expert_intermediate_size=128,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
}

# The other mixture-of-experts families that routing replay covers (trainer.models.routing_replay), outside
# the architecture matrix (Qwen2-MoE stands for MoE there): the routing measurements (bench/parity/bench_routing.py)
# and the replay tests build them. Top-2 of 8 (Mixtral: of 4), as in the measurements.
MOE_ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[],
                                         norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None)),
    "olmoe": ("OlmoeConfig", dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2)),
}
_ALL = {**ARCHITECTURES, **MOE_ARCHITECTURES}
# Each one as a recipe's model.path (``trainer.builtin.resolve``): e.g. builtin:zoo-qwen3_moe. Saved in float32, which
# any model.dtype loads exactly as a file saved in that dtype would.
ZOO_PREFIX = "builtin:zoo-"
ZOO_MODELS = {f"{ZOO_PREFIX}{arch}": arch for arch in _ALL}
ZOO_MAX_POSITIONS = _COMMON["max_position_embeddings"]


def build_arch_model(arch: str, seed: int = 0, overrides: dict | None = None):
    """(model float32, tokenizer) for one entry of ``ARCHITECTURES`` or ``MOE_ARCHITECTURES``.

    ``overrides``: config values replacing the zoo's (e.g. 128-multiple sizes for vLLM's CUDA block-FP8 layers).
    """
    import torch
    import transformers

    if arch not in _ALL:
        raise ValueError(f"arch = {arch!r}: expected one of {sorted(_ALL)}")
    cls_name, extra = _ALL[arch]
    tok = build_tokenizer(VOCAB, _COMMON["max_position_embeddings"])
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config = getattr(transformers, cls_name)(**{**_COMMON, **ids, **extra, **(overrides or {})})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        gemma_norm = "gemma" in config.model_type
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(0.0 if gemma_norm else 1.0, INIT_STD / 2)
                else:
                    p.normal_(0.0, INIT_STD)
    model.generation_config = transformers.GenerationConfig(**ids)
    return model, tok


def ensure_arch_model(arch: str, cache_dir: str | Path | None = None, dtype: str = "float32") -> Path:
    """Build ``arch`` once into the cache (saved in ``dtype``) and return its directory."""
    import torch

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    out = root / f"zoo-v{ZOO_VERSION}-{arch}-{dtype}"
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".zoo-{arch}.lock"):
        if (out / "config.json").is_file():
            return out
        model, tok = build_arch_model(arch)
        model = model.to(getattr(torch, dtype))
        model.config.dtype = getattr(torch, dtype)
        tmp = out.with_name(out.name + ".tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "zoo.json").write_text(json.dumps({"arch": arch, "version": ZOO_VERSION}))
        tmp.rename(out)
    return out
