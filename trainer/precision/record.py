"""One record per precision recipe: everything the rest of the trainer asks about a recipe's numerics.

A recipe is registered once, as a ``PrecisionRecipe`` (``registry.register_recipe``), by the module
of this package named after it. The record holds:

- ``dtypes`` and ``dtype_reason``: the ``model.dtype`` values it runs in, and why;
- ``engine_options(cuda)``: the extra ``VLLMEngine`` keyword arguments, composed from the building
  blocks of ``rollout.engine_options``;
- ``block_fp8_on_cuda``: on CUDA the engine starts from a block-FP8 copy of the model and every sync
  pushes block-FP8 weights and scales (``rollout.fp8_weights``);
- ``transform(model)``: what the trainer's model becomes after LoRA is added (identity for most);
- ``engine_logprobs``: the trainer's log-probs are the engine's own forward (``trainer.models.exact``);
- ``refuses``: situation (the constants below) -> the reason it cannot run there;
- ``check_model(config)``: raises ValueError for a model config the recipe cannot run.

The consumers (recipe loading, engine construction and sync, the loop's setup, ``serve``,
``compare``) ask the record; none of them names a recipe (``checks`` turns a record into the
messages each of them reports).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

# Situations a recipe may refuse (keys of ``PrecisionRecipe.refuses``).
SERVER = "server"  # rollout.mode server, and the server `parityrl serve` starts
HF_ENGINE = "hf_engine"  # rollout.engine hf (and `parityrl compare --engine hf`)
ZERO2 = "zero2"  # DeepSpeed ZeRO stage 2
ZERO3 = "zero3"  # DeepSpeed ZeRO stage 3
ASYNC = "async"  # rollout.max_staleness 1: rollouts one step off-policy
PROCESSES = "processes"  # a launch of several processes (data parallel)
COMPARE = "compare"  # `parityrl compare`
CUDA = "cuda"  # a CUDA device is present
SITUATIONS = (SERVER, HF_ENGINE, ZERO2, ZERO3, ASYNC, PROCESSES, COMPARE, CUDA)


def no_engine_options(cuda: bool) -> dict:
    """The engine's dtype argument is all it needs."""
    return {}


def same_model(model: Any) -> Any:
    return model


@dataclass(frozen=True)
class PrecisionRecipe:
    name: str
    doc: str  # one line: what both phases run, with the reference
    dtypes: tuple[str, ...]  # model.dtype values it runs in, the first the one to pick by default
    dtype_reason: str
    engine_options: Callable[[bool], dict] = no_engine_options
    block_fp8_on_cuda: bool = False
    transform: Callable[[Any], Any] = same_model
    engine_logprobs: bool = False
    refuses: Mapping[str, str] = field(default_factory=dict)
    check_model: Optional[Callable[[Any], None]] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name):
            raise ValueError(f"PrecisionRecipe: name must be a non-empty string, got {self.name!r}")
        if not self.dtypes:
            raise ValueError(f"PrecisionRecipe {self.name!r}: dtypes must name at least one model.dtype")
        unknown = sorted(set(self.refuses) - set(SITUATIONS))
        if unknown:
            raise ValueError(f"PrecisionRecipe {self.name!r}: refuses unknown situations {unknown}; "
                             f"expected some of {SITUATIONS}")
        if not (callable(self.engine_options) and callable(self.transform)):
            raise TypeError(f"PrecisionRecipe {self.name!r}: engine_options and transform must be callables")
        object.__setattr__(self, "refuses", MappingProxyType(dict(self.refuses)))  # a frozen record throughout
