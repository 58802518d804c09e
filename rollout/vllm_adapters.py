"""The colocated vLLM engine's LoRA adapter (``rollout.lora_sync: adapter``): one version served at a time, every
request sent with it.

The engine is started with vLLM's LoRA support (``lora_options``: ``enable_lora``, the smallest allowed
``max_lora_rank`` at least the recipe's rank, one adapter on the device and room for the next one in vLLM's CPU
cache while it is added). Each version is written as PEFT's files into the engine's own temporary directory and
added by vLLM's ``LLMEngine.add_lora`` (loaded there and then, so a broken adapter fails the sync, not the next
rollout); the previous one is removed and its files deleted. vLLM's adapter ids and names are the engine's own
sequence, so an engine reused by several runs never mistakes one run's version 1 for another's: its prefix cache
keys blocks by the adapter's name and path (``vllm/v1/core/kv_cache_utils.py`` ``_gen_lora_extra_hash_keys``).

``reload_weights`` (a merged sync, or the base weights restored) drops every adapter vLLM holds
(``vllm/v1/worker/lora_model_runner_mixin.py`` ``reset_lora_state``): ``forget`` follows it.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from rollout.adapters import LoraAdapter, vllm_lora_rank


def lora_options(max_lora_rank: Optional[int], target_modules: Optional[Sequence[str]] = None) -> dict:
    """vLLM's LoRA options for an engine that serves adapters of rank up to ``max_lora_rank`` (None: no LoRA) on
    the layers named ``target_modules`` (Hugging Face leaf names, e.g. ``q_proj``; vLLM maps them onto its fused
    ``qkv_proj`` / ``gate_up_proj``).

    Only those layers get vLLM's LoRA wrappers: without the list every supported layer does, the output layer
    included, whose wrapper adds per-request LoRA logits to per-token rows when prompt log-probs are asked
    (``vllm/lora/layers/logits_processor.py``; on CPU an einsum shape error, the probe's ``score``), and each
    wrapper costs its punica calls even with a zero adapter.
    """
    if max_lora_rank is None:
        return {}
    if isinstance(target_modules, str):  # a PEFT regex, whose characters would each name a layer
        raise TypeError(f"target_modules = {target_modules!r}: expected the adapter's leaf names (a list, e.g. "
                        "rollout.adapters.lora_leaves), not one string")
    # One adapter runs at a time (a new version replaces the old); vLLM's CPU cache holds the next one while it
    # is added, before the old one is removed.
    out = {"enable_lora": True, "max_lora_rank": vllm_lora_rank(max_lora_rank), "max_loras": 1, "max_cpu_loras": 2}
    if target_modules is not None:
        out["lora_target_modules"] = sorted(target_modules)
    return out


class ServedAdapter:
    """The adapter version a vLLM engine runs: its ``request`` goes with every generate and score."""

    def __init__(self, max_rank: int) -> None:
        self.max_rank = vllm_lora_rank(max_rank)
        self.dir = Path(tempfile.mkdtemp(prefix="parityrl-adapter-"))
        self.request = None  # vllm.lora.request.LoRARequest of the version served, None before the first
        self.version: Optional[int] = None  # the trainer's version of it
        self._seq = 0

    def load(self, llm, adapter: LoraAdapter) -> None:
        """Serve ``adapter`` from now on (``llm``: the ``vllm.LLM``)."""
        from vllm.lora.request import LoRARequest

        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank}: the engine was started with max_lora_rank "
                             f"{self.max_rank}; start it for the recipe's model.lora.r")
        self._seq += 1
        path = adapter.write(self.dir / str(self._seq))
        request = LoRARequest(f"{adapter.name}-{self._seq}", self._seq, str(path))
        if not llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not add the LoRA adapter {request.lora_name} ({path})")
        old, self.request, self.version = self.request, request, adapter.version
        if old is not None:
            llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def drop(self, llm) -> None:
        """Serve nothing again (the base weights alone): the version served is removed from vLLM and its files
        deleted (``llm``: the ``vllm.LLM``)."""
        if self.request is not None:
            llm.llm_engine.remove_lora(self.request.lora_int_id)
        self.forget()

    def forget(self) -> None:
        """vLLM dropped every adapter (its base weights were reloaded): nothing is served until the next load."""
        if self.request is not None:
            shutil.rmtree(self.request.lora_path, ignore_errors=True)
        self.request, self.version = None, None

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)
