"""The one interface every rollout engine implements, and what an unreachable engine raises."""
from __future__ import annotations

from typing import Iterable, Protocol

import torch

from rollout.adapters import LoraAdapter
from rollout.types import Rollouts, SamplingSpec, Scored


class EngineUnavailable(RuntimeError):
    """The engine cannot be reached (a server not started, dead, or not answering in time), or what it
    answers is not the protocol at all (a body cut short: ``rollout.server_engine.MalformedAnswer``).

    Not a wrong answer: the run stops, keeps its last checkpoint, and continues with
    ``parityrl train <recipe> --resume`` once the engine is back; the message names the engine
    and the action that failed. `parityrl train` exits with status 4 (the engine's).
    """


class EngineCannotLoad(EngineUnavailable):
    """The engine refused this model (or these settings) at start: an architecture or config variant it does not
    implement, a quantisation it cannot run. The message is the engine's own reason in one line, not its traceback;
    `parityrl train`, `compare` and `doctor` exit with status 4 naming it."""

    exit_status = 4



class RolloutEngine(Protocol):
    """What the trainer uses of an engine (``trainer.sampling`` and ``trainer.measurement``): sampling, scoring, weight sync, release.

    max_model_len: prompt + completion tokens per sequence the engine holds (None: no limit known).
    pushes_weights: False on an engine whose weights another process pushes (a data-parallel rank
        other than 0 sharing rank 0's server): a sync only calls ``follow_push``.
    streams_weights: True when an update may come as a stream of chunks of whole decoder layers
        (``load_weight_chunks``), each made after the previous one was taken, so the trainer never
        holds a whole merged model; False: the update comes whole in one ``load_weights``.
    fp8_block_weights: True for an engine running vLLM's CUDA block-FP8 layers, which takes the
        targeted weights as block-FP8 values and scales (``rollout.fp8_weights.fp8_block_weights``);
        False: HF-named weights in a float dtype.
    adapter_dtype: the dtype a LoRA adapter's weights run in on this engine, which serves adapters
        (``load_adapter``); None: it was started without LoRA support and takes merged weights only.
    """

    max_model_len: int | None
    pushes_weights: bool
    streams_weights: bool
    fp8_block_weights: bool
    adapter_dtype: torch.dtype | None

    def generate(self, prompt_ids: list[list[int]], spec: SamplingSpec) -> Rollouts:
        """Sample ``spec.n`` completions per prompt; groups are contiguous."""

    def score(self, sequences: list[list[int]], topk: int = 0) -> Scored:
        """log p(x_t | x_<t) at temperature 1 of every token t >= 1 of each given sequence, from one
        prefill (no decoding), with the top-k per position if asked; the parity probe compares
        engine and trainer on fixed sequences with it (trainer.measurement.probe)."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the named parameters (Hugging Face names, e.g.
        ``model.layers.0.self_attn.q_proj.weight``) in place. Names not given keep
        their current values."""

    def load_adapter(self, adapter: LoraAdapter) -> None:
        """Run ``adapter`` (one version of the policy's LoRA, ``rollout.adapters``) over the base weights the
        engine started from, for every generate and score from now on. Only called when ``adapter_dtype``."""

    def load_weight_chunks(self, chunks: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> None:
        """Take one update as an iterable of chunks (whole decoder layers,
        ``rollout.weight_export.layer_chunks``), each taken before the next is made. Only called
        when ``streams_weights``; an engine that does not stream raises."""

    def follow_push(self, adapter: bool = False) -> None:
        """Only called when not ``pushes_weights``: another process has just pushed new weights (with
        ``adapter``: a new adapter version, ``load_adapter``); expect their version from now on. An engine
        that pushes its own weights raises."""

    def release_memory(self) -> None:
        """Called before the trainer's update: free what the engine holds on the accelerator until it is used
        again (the colocated CUDA vLLM engine in sleep mode: ``VLLMEngine.release_memory``); nothing elsewhere.
        The engine's next use brings it back itself."""

    def close(self) -> None:
        """Release the engine's memory."""


class InProcessEngine:
    """The weight-sync part of the interface for an engine in the trainer's own process (colocated vLLM, HF).

    It pushes its own weights, and since its ``load_weights`` keeps the values of names not sent,
    each chunk of a streamed update is loaded as an update of its own as it arrives.
    """

    pushes_weights = True
    streams_weights = True
    fp8_block_weights = False
    adapter_dtype = None

    def load_weight_chunks(self, chunks: Iterable[Iterable[tuple[str, torch.Tensor]]]) -> None:
        for chunk in chunks:
            self.load_weights(chunk)

    def follow_push(self, adapter: bool = False) -> None:
        raise RuntimeError(f"{type(self).__name__} pushes its own weights (pushes_weights is True): "
                           "call load_weights, not follow_push")

    def release_memory(self) -> None:
        """Nothing to free by default (``RolloutEngine.release_memory``)."""


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and the last line of its message (an engine's reason, not its traceback).
    A pydantic ValidationError (vLLM's configs) ends in a link to pydantic's docs, and its reason is the line above."""
    text = [x.strip() for x in str(e).strip().splitlines()
            if x.strip() and not x.strip().startswith("For further information visit")]
    return f"{type(e).__name__}: {text[-1]}" if text else type(e).__name__
