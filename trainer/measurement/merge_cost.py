"""What a merged sync costs this run, measured at every sync whatever ``rollout.lora_sync`` is:
``sync/merge_update_error`` and ``sync/merge_unchanged_frac`` (``parity.merge_cost``).

With ``merged`` they say how much of the trainer's update the engine does not get; with ``adapter`` what merging
would have cost (the evidence for the choice). In what the engine stores: the sync's dtype (``model.dtype``), and
with an FP8 engine (``fp8``: the precision recipes whose engine runs block-FP8 linear layers) the block-FP8 values
of each layer it quantizes (``rollout.fp8_weights.is_fp8_target``), through ``parity.precision.fake_quant_weight``,
the one quantizer both phases call. On a sample of the LoRA layers, fixed for the run: every
``stride``-th layer in model order, the stride chosen so that the sample's base weights hold at most
``MERGE_COST_ELEMENTS`` elements (all of them for a model up to ~2 decoder layers of a 7B; one gate_proj of a 7B
is 68 M elements, so there the sample is a handful of modules spread over the depth). The same modules every sync,
so the figure's trend is the update's, not the sample's. Under ZeRO-3 every rank takes part in each module's
gather (a collective), as in the sync.

A merged run whose merge loses more than ``LOSS_WARNING`` of the update (relative error) is told so on the
console, with what to do, at the first such sync and every ``AGAIN_AFTER`` steps while it lasts.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, ContextManager, Optional, Sequence

import torch
from torch import nn

from parity.lora import merged_lora_weight
from parity.merge_cost import MERGE_COST_KEYS, merge_cost_metrics, merge_cost_sums
from parity.precision import fake_quant_weight
from rollout.adapters import lora_modules
from rollout.fp8_weights import is_fp8_target

MERGE_COST_ELEMENTS = 1 << 24
# The relative error above which a merged sync is said to lose the update: at 0.25 a quarter of the update's
# norm is rounding (the 5e-5 LoRA run on the tiny model read 0.5-0.66; a 2e-3 one 0.02-0.03).
LOSS_WARNING = 0.25
AGAIN_AFTER = 50  # steps between repeated warnings
# An FP8 engine needs the merged weight (the precision record's merged_sync), so serving the adapter is no remedy.
FP8_REMEDY = ("an FP8 engine quantizes the merged weight, so the adapter cannot be served instead: larger updates "
              "per sync, or a precision recipe without an FP8 engine, deliver more of it (docs/precision.md)")

Gather = Callable[[Sequence[nn.Parameter]], ContextManager]


def _base_numel(module: nn.Module) -> int:
    weight = module.get_base_layer().weight
    return int(getattr(weight, "ds_numel", weight.numel()))  # ZeRO-3 keeps the full size in ds_numel


class MergeCost:
    """The merge's cost on a fixed sample of the policy's LoRA layers, in what the engine stores: ``dtype`` (the
    sync's), and with ``fp8`` the block-FP8 values of the layers an FP8 engine quantizes."""

    def __init__(self, policy: nn.Module, dtype: torch.dtype, *, gather: Optional[Gather] = None,
                 budget: int = MERGE_COST_ELEMENTS, fp8: bool = False) -> None:
        named = lora_modules(policy)
        total = sum(_base_numel(m) for _, m in named)
        self.stride = max(1, math.ceil(total / budget)) if named else 1
        # PEFT names end in the HF module name (base_model.model.model.layers.0.self_attn.q_proj)
        self.sample = [(m, fake_quant_weight if fp8 and is_fp8_target(f"{n}.weight") else None)
                       for n, m in named[::self.stride]]
        self.dtype = dtype
        self.fp8 = fp8
        self.stored_as = str(dtype).removeprefix("torch.") + (" then block FP8" if fp8 else "")
        self.gather = gather or (lambda params: contextlib.nullcontext())
        self._warned_at: Optional[int] = None

    def __call__(self) -> dict[str, float]:
        sums = dict.fromkeys(MERGE_COST_KEYS, 0.0)
        for module, store in self.sample:
            with torch.no_grad(), self.gather(list(module.parameters())):
                for k, v in merge_cost_sums(module.get_base_layer().weight, merged_lora_weight(module),
                                            self.dtype, store).items():
                    sums[k] += v
        return merge_cost_metrics(sums)

    def warning(self, step: int, m: dict, mode: str) -> Optional[str]:
        """The console line for a merged sync that loses more than ``LOSS_WARNING`` of the update, else None."""
        err = m.get("sync/merge_update_error")
        if mode != "merged" or err is None or err <= LOSS_WARNING:
            self._warned_at = None
            return None
        if self._warned_at is not None and step - self._warned_at < AGAIN_AFTER:
            return None
        self._warned_at = step
        return (f"warning: step {step}: the merged sync loses {err:.0%} of the update (sync/merge_update_error; "
                f"{m.get('sync/merge_unchanged_frac', float('nan')):.0%} of the sampled weights did not move in "
                f"{self.stored_as}): the engine samples from a coarser policy than the one trained; "
                + (FP8_REMEDY if self.fp8 else "rollout.lora_sync: adapter serves the update itself "
                   "(docs/precision.md \"LoRA in the engine\")"))
