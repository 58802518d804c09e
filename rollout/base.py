"""The one interface every rollout engine implements."""
from __future__ import annotations

from typing import Iterable, Protocol

import torch

from rollout.types import Rollouts, SamplingSpec


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> Rollouts:
        """Sample ``spec.n`` completions per prompt; groups are contiguous."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the named parameters (Hugging Face names, e.g.
        ``model.layers.0.self_attn.q_proj.weight``) in place. Names not given keep
        their current values."""

    def close(self) -> None:
        """Release the engine's memory."""
