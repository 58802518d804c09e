"""Recipe -> rollout engine, and the weight sync into it.

The only place where ``trainer/`` touches ``rollout/``'s constructors; the
loop itself sees the ``RolloutEngine`` interface and ``Rollouts`` only.
"""
from __future__ import annotations

import torch

from rollout.types import SamplingSpec
from trainer.config import RunConfig


def make_engine(cfg: RunConfig, model_dir: str, *, max_model_len: int):
    r = cfg.rollout
    if r.engine == "vllm":
        from rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_dir, dtype=cfg.model.dtype, max_model_len=max_model_len, seed=cfg.train.seed,
                          kv_cache_memory_bytes=r.kv_cache_memory_bytes, gpu_memory_utilization=r.gpu_memory_utilization,
                          enforce_eager=r.enforce_eager, max_num_seqs=r.max_num_seqs,
                          # vLLM refuses requests for more log-probs than max_logprobs (default 20).
                          max_logprobs=max(20, cfg.parity.topk))
    if r.engine == "hf":
        from rollout.hf_engine import HFEngine

        return HFEngine(model_dir, dtype=cfg.model.dtype, device="cuda" if torch.cuda.is_available() else "cpu")
    raise ValueError(f"rollout.engine = {r.engine!r}: expected 'vllm' or 'hf'")


def sampling_spec(cfg: RunConfig, step: int) -> SamplingSpec:
    r = cfg.rollout
    # A per-step seed makes a resumed run sample exactly what an uninterrupted one would.
    return SamplingSpec(n=cfg.algorithm.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                        max_new_tokens=r.max_new_tokens, seed=cfg.train.seed * 1_000_003 + step,
                        logprobs_topk=cfg.parity.topk)


def sync_weights(engine, policy) -> dict[str, float]:
    """Push the policy's current weights (LoRA merged, changed modules only) into the engine."""
    from rollout.weight_export import merged_lora_weights, payload_bytes

    named = list(merged_lora_weights(policy))
    engine.load_weights(named)
    return {"perf/sync_bytes": float(payload_bytes(named)), "perf/sync_tensors": float(len(named))}
