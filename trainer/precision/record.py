"""One record per precision recipe: everything the rest of the trainer asks about a recipe's numerics.

A recipe is registered once, as a ``PrecisionRecipe`` (``registry.register_recipe``), by the module
of this package named after it. The record holds:

- ``dtypes`` and ``dtype_reason``: the ``model.dtype`` values it runs in, and why;
- ``mae_floor``: per dtype, the probe mae a healthy run may reach on the smallest model (``MaeFloor``),
  below which the relative parity limit judges nothing (``parity.guards.MaeRatioLimit``);
- ``engine_options(cuda)``: the extra ``VLLMEngine`` keyword arguments, composed from the building
  blocks of ``rollout.engine_options``;
- ``block_fp8_on_cuda``: on CUDA the engine starts from a block-FP8 copy of the model and every sync
  pushes block-FP8 weights and scales (``rollout.fp8_weights``);
- ``transform(model)``: what the trainer's model becomes after LoRA is added (identity for most);
- ``engine_logprobs``: the trainer's log-probs are the engine's own forward (``trainer.models.exact``);
- ``merged_sync``: why the engine must hold the LoRA-merged weights (``rollout.lora_sync: merged``) rather than
  serve the adapter; None: it can serve the adapter (``trainer.precision.lora_sync``);
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
ASYNC = "async"  # rollout.max_staleness >= 1: off-policy rollouts
PROCESSES = "processes"  # a launch of several processes (data parallel)
COMPARE = "compare"  # `parityrl compare`
CUDA = "cuda"  # a CUDA device is present
SITUATIONS = (SERVER, HF_ENGINE, ZERO2, ZERO3, ASYNC, PROCESSES, COMPARE, CUDA)


@dataclass(frozen=True)
class MaeFloor:
    """The floor of the relative parity limit for one dtype of a recipe (docs/parity-metrics.md "Limits").

    ``mae``: the ``probe/mae`` a healthy run reaches on the built-in tiny model (4 layers), the
    smallest level any model has, with room for a high learning rate's faster drift; the limit is
    ``max_mae_ratio`` times the larger of it and the run's own level, so noise below it never
    counts as a jump. ``any_depth``: the level does not
    grow with the model's depth (float32 ~1e-5 at 4 and at 30 layers; exact mode's 0), so even the
    probe before step 1, which has no run level to compare with, is judged against the floor: a
    pipeline fault present from the start (a dropped logit softcap) trips it. In BF16 the level
    grows with depth (2e-3 at 4 layers, 5e-2 at 30), so a floor fit for a tiny model would fire on
    every deep one there. Each record's comment says where its figures come from.
    """

    mae: float
    any_depth: bool

    def __post_init__(self) -> None:
        if not (self.mae >= 0 and self.mae < float("inf")):
            raise ValueError(f"MaeFloor: mae must be a finite number >= 0, got {self.mae!r}")


# float32 on both sides: the pipeline self-test. ~1e-5 at any depth (`parityrl compare`, 4 and 30
# layers, bench/RESULTS.md "The parity level by model and dtype"; the probe of a float32 GRPO run on the
# tiny model read 1.1e-5 to 1.6e-5, 2026-11-25); 1e-4 is where docs/parity-metrics.md says rounding ends.
# A CPU figure: on CUDA vLLM's float32 attention runs Triton's default TF32 dots (docs/parity-metrics.md).
FLOAT32_FLOOR = MaeFloor(1e-4, any_depth=True)


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
    mae_floor: Mapping[str, MaeFloor]  # one per dtype in dtypes
    engine_options: Callable[[bool], dict] = no_engine_options
    block_fp8_on_cuda: bool = False
    transform: Callable[[Any], Any] = same_model
    engine_logprobs: bool = False
    merged_sync: Optional[str] = None
    refuses: Mapping[str, str] = field(default_factory=dict)
    check_model: Optional[Callable[[Any], None]] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name):
            raise ValueError(f"PrecisionRecipe: name must be a non-empty string, got {self.name!r}")
        if not self.dtypes:
            raise ValueError(f"PrecisionRecipe {self.name!r}: dtypes must name at least one model.dtype")
        if set(self.mae_floor) != set(self.dtypes) or not all(isinstance(f, MaeFloor)
                                                              for f in self.mae_floor.values()):
            raise ValueError(f"PrecisionRecipe {self.name!r}: mae_floor must hold one MaeFloor for each of its dtypes "
                             f"{self.dtypes}, got {dict(self.mae_floor)!r}")
        unknown = sorted(set(self.refuses) - set(SITUATIONS))
        if unknown:
            raise ValueError(f"PrecisionRecipe {self.name!r}: refuses unknown situations {unknown}; "
                             f"expected some of {SITUATIONS}")
        if not (callable(self.engine_options) and callable(self.transform)):
            raise TypeError(f"PrecisionRecipe {self.name!r}: engine_options and transform must be callables")
        object.__setattr__(self, "refuses", MappingProxyType(dict(self.refuses)))
        object.__setattr__(self, "mae_floor", MappingProxyType(dict(self.mae_floor)))  # a frozen record throughout
