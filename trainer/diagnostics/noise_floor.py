"""The model's own noise floor, point by point: what its dtype alone does to its hidden states, measured on the model
itself, so that "is this engine-vs-trainer gap normal?" is judged against this model and not against a constant.
The doctor's layers check judges by it; it lives in the room the doctor shares with `parityrl compare`.

The floor at a point is the relative error ‖low − wide‖ / ‖wide‖ between the trainer's forward in the run's dtype
(``low``: the model the doctor holds) and the *same weights* cast up to a wider dtype (``wide``: float32 for bf16 and
fp16, float64 for float32), on the same token ids, read at the same points as the layers check. The weights are not
rounded again, so the floor isolates the rounding of the computation, which is what the engine and the trainer do
differently; it grows with depth and width the way the two sides' difference does (rounding errors of one layer are
carried and amplified by the next ones), which one band per dtype cannot: a 48-layer random Qwen3 in bf16 reads
4e-2 at layer 9 while the 4-layer tiny model's worst point is 6e-3 (docs/doctor.md).

The band a healthy engine-vs-trainer point stays in is ``FACTOR`` times that floor (never below one rounding of the
dtype, ``UNIT_ROUNDOFF``). ``FACTOR`` = 4: the engine and the trainer are two roundings of one computation, each
about a floor away from the wide forward, so their difference is about sqrt(2) floors when the two roundings are
independent and up to 2 when they oppose; the engine also rounds at points the trainer does not (fused q/k/v and
gate/up GEMMs, a fused residual add in the norm, its own attention kernel). Measured (CPU, vLLM 0.32,
`bench/parity/doctor_floor.py`, bench/RESULTS.md "The doctor's noise floor (issue 55)"), the largest healthy ratio to the
floor is 2.2 (SmolLM2-135M's layer 0 attention, where the floor is below one bf16 rounding), 1.3 on a random
48-layer Qwen3, and each fault the doctor's tests plant reads 13x its floor or more where it is planted: 4 sits
between the two.
"""
from __future__ import annotations

import copy
from typing import Callable, Mapping

import torch

WIDER = {"bfloat16": torch.float32, "float16": torch.float32, "float32": torch.float64}
# One rounding to the dtype, relative (2^-p for p explicit mantissa bits + 1): the smallest band a point can have,
# since one side storing a value the other keeps wider moves it by up to that.
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
FACTOR = 4.0

States = Callable[[torch.nn.Module, list, list], list]


def wide_copy(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """The model's own weights, cast up to ``WIDER[dtype]`` (a copy: the doctor's model is left as it is)."""
    if dtype not in WIDER:
        raise ValueError(f"model.dtype {dtype!r}: the noise floor is measured for {', '.join(WIDER)}")
    return copy.deepcopy(model).to(WIDER[dtype]).eval()


def measure(model: torch.nn.Module, dtype: str, seqs: list[list[int]], names: list[str], states: States,
            low: list[dict] | None = None) -> dict[str, float]:
    """Per point name, the relative error of ``model``'s forward in ``dtype`` against its wide copy's, over every
    position of ``seqs``. ``states(model, seqs, names)`` reads the points (the layers check's trainer side);
    ``low``: the model's own states when already read."""
    low = states(model, seqs, names) if low is None else low
    wide_model = wide_copy(model, dtype)
    try:
        wide = states(wide_model, seqs, names)
    finally:
        del wide_model
    return {n: _relative_error(torch.cat([s[n] for s in low]), torch.cat([s[n] for s in wide])) for n in names}


def _relative_error(low: torch.Tensor, wide: torch.Tensor) -> float:
    """‖low − wide‖ / ‖wide‖ in float64 (0 where both are zero)."""
    num, denom = float((low.double() - wide.double()).norm()), float(wide.double().norm())
    return num / denom if denom > 0 else (0.0 if num == 0 else float("inf"))


def bands(floor: Mapping[str, float], dtype: str) -> dict[str, float]:
    """Per point, the band a healthy engine-vs-trainer point stays in: ``FACTOR`` x max(floor, one rounding)."""
    return {n: FACTOR * max(f, UNIT_ROUNDOFF[dtype]) for n, f in floor.items()}
