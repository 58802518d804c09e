"""How this run's engine gets the policy after every update (``rollout.lora_sync`` resolved,
``trainer.precision.lora_sync``): the LoRA adapter as a new version (``sync_adapter``), or the merged weights
(``sync_weights``). The loop calls it the same way in both modes; every rank leaves it together (with a shared
server rank 0 pushes while the others wait for it before their next generate; a failed push stops every rank).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from trainer.config import RunConfig
from trainer.distributed.data_parallel import DataParallel
from trainer.precision import recipe_for
from trainer.precision.lora_sync import ADAPTER, engine_lora_sync
from trainer.sampling.engines import block_fp8_engine, sync_adapter, sync_weights


@dataclass
class PolicySync:
    """One run's sync. ``mode``: ``adapter`` | ``merged``; ``version``: the adapter versions served so far."""

    mode: str
    policy: object  # the PEFT model
    dp: DataParallel
    dtype: torch.dtype  # the engine's (model.dtype): a merge is rounded to it once
    block_fp8: bool = False  # merged: block-FP8 weights + scales (trainer.sampling.engines.block_fp8_engine)
    gather: Optional[object] = None  # ZeRO-3: one module's shards at a time (every rank takes part)
    chunk_bytes: Optional[int] = None  # merged: rollout.sync_chunk_bytes
    version: int = 0

    def __call__(self, engine) -> dict[str, float]:
        """Push the policy's current weights; the sync's ``perf/sync_*`` figures."""
        out, error = {}, None
        try:
            if self.mode == ADAPTER:
                self.version += 1
                out = sync_adapter(engine, self.policy, version=self.version, gather=self.gather)
            else:
                out = sync_weights(engine, self.policy, block_fp8=self.block_fp8, gather=self.gather,
                                   dtype=self.dtype, chunk_bytes=self.chunk_bytes)
        except Exception as e:  # noqa: BLE001 - re-raised by raise_together on this rank
            error = e
        self.dp.raise_together(error)
        return out


def policy_sync(cfg: RunConfig, engine, policy, dp: DataParallel, *, gather=None, announce: bool = True,
                model_dir: Optional[str] = None) -> PolicySync:
    """The run's sync for its engine (``model_dir``: the run's model, which the engine must have started from to serve
    the adapter over its base). An ``auto`` that falls back to ``merged`` says why once (``announce``)."""
    recipe = recipe_for(cfg.precision.recipe)
    mode, why = engine_lora_sync(cfg, engine, recipe, model_config=policy.config, model_dir=model_dir)
    if why and announce:
        print(f"rollout.lora_sync: merged ({why})", flush=True)
    return PolicySync(mode=mode, policy=policy, dp=dp, dtype=getattr(torch, cfg.model.dtype),
                      block_fp8=block_fp8_engine(recipe), gather=gather, chunk_bytes=cfg.rollout.sync_chunk_bytes)
