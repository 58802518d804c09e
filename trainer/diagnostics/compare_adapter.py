"""`parityrl compare --adapter PATH`: a run's LoRA adapter (a checkpoint) in the engine both ways, side by side.

The trainer's scoring model is the base with the adapter (PEFT, its weights in float32 as a run's are). The same
prompts and seeds are generated twice: with the engine serving the adapter (``rollout.lora_sync: adapter``) and
with the merged weights ``W + s·B·A`` rounded to the engine's dtype (``merged``), each scored by the trainer. The
report's ``lora_sync`` section holds both modes' parity metrics and what the merge loses of this adapter
(``sync/merge_update_error``, ``sync/merge_unchanged_frac`` over every LoRA layer: ``parity.merge_cost``); the
report's tokens and plots are the mode the precision recipe would serve (adapter where it can).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from parity.lora import merged_lora_weight
from parity.merge_cost import MERGE_COST_KEYS, merge_cost_metrics, merge_cost_sums
from parity.metrics import compare
from rollout.adapters import adapter_config, export_lora_adapter, lora_leaves, lora_modules
from rollout.hf_engine import HFEngine
from rollout.types import Rollouts, SamplingSpec
from rollout.weight_export import iter_merged_lora_weights
from trainer.diagnostics.compare_inputs import CompareError
from trainer.measurement.scoring import score_batch
from trainer.models.batch import batch_from_rollouts

ADAPTER_CONFIG = "adapter_config.json"


def resolve_adapter_dir(path: str | Path) -> Path:
    """A PEFT adapter folder: ``path`` itself, or a checkpoint folder's ``adapter/`` (``runs/<name>/checkpoints/
    step_<n>``); ``CompareError`` naming the path otherwise."""
    p = Path(path).expanduser()
    for candidate in (p, p / "adapter"):
        if (candidate / ADAPTER_CONFIG).is_file():
            return candidate
    raise CompareError(f"adapter = {str(path)!r}: no {ADAPTER_CONFIG} there or in its adapter/ folder; expected a "
                       "PEFT adapter folder or a run's checkpoint (runs/<name>/checkpoints/step_<n>)")


def with_adapter(model, adapter_dir: Path):
    """``model`` with the adapter, as the trainer runs it (PEFT keeps the adapter's weights in float32)."""
    from peft import PeftModel

    try:
        return PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False).eval()
    except (ValueError, RuntimeError, KeyError) as e:
        raise CompareError(f"adapter = {str(adapter_dir)!r}: it does not fit the model "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


def merge_cost_of(policy, dtype: torch.dtype) -> dict[str, float]:
    """What merging this adapter into ``dtype`` weights loses, over every LoRA layer."""
    sums = dict.fromkeys(MERGE_COST_KEYS, 0.0)
    with torch.no_grad():
        for _, module in lora_modules(policy):
            for k, v in merge_cost_sums(module.get_base_layer().weight, merged_lora_weight(module), dtype).items():
                sums[k] += v
    return merge_cost_metrics(sums)


def generate_both(engine, policy, prompt_ids: list[list[int]], spec: SamplingSpec, *, dtype: torch.dtype,
                  start: Optional[Callable[[Optional[dict]], object]] = None,
                  modes: tuple[str, ...] = ("adapter", "merged")) -> dict[str, Rollouts]:
    """The same prompts and seeds generated with the adapter served and with the merged weights (``modes``: the
    merged weights alone for a precision recipe that needs them, ``PrecisionRecipe.merged_sync``).

    ``engine``: a started engine serving adapters (used as is for both, left open), or a name with ``start``:
    ``start(adapter_config)`` starts an engine of that kind serving such adapters, ``start(None)`` one without;
    engines started here are closed after."""
    owned = []

    def started(config):
        owned.append(start(config))
        return owned[-1]

    # the engine wraps the adapter's layers by leaf name (rollout.adapters.lora_leaves), whatever PEFT's config holds
    config = {**adapter_config(policy), "target_modules": lora_leaves(policy)} if "adapter" in modes else None
    out = {}
    try:
        served = started(config) if isinstance(engine, str) else engine
        if "adapter" in modes:
            if served.adapter_dtype is None:
                raise CompareError(f"adapter: the engine ({type(served).__name__}) was started without LoRA "
                                   "support; expected one started to serve adapters (VLLMEngine(..., max_lora_rank=r))")
            served.load_adapter(export_lora_adapter(policy, version=1, dtype=served.adapter_dtype))
            out["adapter"] = served.generate(prompt_ids, spec)
        # the HF engine serving an adapter refuses merged weights (they would add the update twice): another one
        plain = started(None) if isinstance(served, HFEngine) and config is not None else served
        plain.load_weights(iter_merged_lora_weights(policy, dtype=dtype))
        out["merged"] = plain.generate(prompt_ids, spec)
        return out
    finally:
        for e in owned:
            e.close()


def side_by_side(policy, both: dict[str, Rollouts], pad_id: int, device, *, temperature: float, batch_size: int,
                 dtype: torch.dtype) -> dict:
    """The report's ``lora_sync`` section: each mode's parity metrics against the trainer, and the merge's cost."""
    out = {}
    for mode, rollouts in both.items():
        batch = batch_from_rollouts(rollouts, pad_id, device)
        s = score_batch(policy, batch, micro_batch_size=batch_size, temperature=temperature)
        out[mode] = compare(s.logprobs.float().cpu(), batch.rollout_logprobs.cpu(), batch.mask.cpu() > 0)
    out["merge_cost"] = merge_cost_of(policy, dtype)
    return out
