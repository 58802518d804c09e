"""The one interface every rollout engine implements."""
from __future__ import annotations

from typing import Iterable, Protocol

import torch

from rollout.types import Rollouts, SamplingSpec, Scored


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> Rollouts:
        """Sample ``spec.n`` completions per prompt; groups are contiguous."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the named parameters (Hugging Face names, e.g.
        ``model.layers.0.self_attn.q_proj.weight``) in place. Names not given keep
        their current values."""

    def score(self, sequences: list[list[int]], topk: int = 0) -> Scored:
        """log p(x_t | x_<t) at temperature 1 of every token t >= 1 of each given sequence, from one
        prefill (no decoding), with the top-k per position if asked; the parity probe compares
        engine and trainer on fixed sequences with it (trainer.rl.probe)."""

    def close(self) -> None:
        """Release the engine's memory."""

    # Optional: ``load_weight_chunks(chunks)`` -- the engine takes an update as an iterable of
    # chunks (whole decoder layers, ``rollout.weight_export.layer_chunks``), each taken before
    # the next is made; ``trainer.rl.engines.sync_weights`` then streams the merge into it.


class LayerChunkUpdates:
    """``load_weight_chunks`` for engines whose ``load_weights`` keeps the values of names not sent:
    each chunk is loaded as an update of its own as it arrives (the colocated vLLM and HF engines)."""

    def load_weight_chunks(self, chunks: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> None:
        for chunk in chunks:
            self.load_weights(chunk)
