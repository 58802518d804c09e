"""The doctor's two records: a check (its name for ``--only``, what it asks in one line, whether it needs the engine,
and the function that returns its findings; one file per check under ``checks/``, each exporting ``CHECK``) and a
finding (one line of the doctor's table: a check's figure, the level expected, the verdict and, when it is not a
pass, the likely cause in one line)."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from trainer.precision.verdict import FAIL, PASS, WARN, verdict

SKIP = "SKIP"
VERDICTS = (PASS, WARN, FAIL, SKIP)


@dataclass(frozen=True)
class Finding:
    """``check``: the check's name (``--only``); ``item``: what was measured; ``figure``: the measured value (None:
    nothing to measure, e.g. a skip); ``expected``: the level it is judged against, in words ("<= 1e-4");
    ``verdict``: PASS / WARN / FAIL / SKIP; ``cause``: for anything but a pass, the likely cause or why it was
    skipped; ``details``: what doctor.json keeps beside it (per-layer errors, ids...)."""

    check: str
    item: str
    figure: Optional[float]
    expected: str
    verdict: str
    cause: str = ""
    details: Optional[dict[str, Any]] = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"Finding.verdict = {self.verdict!r}: expected one of {VERDICTS}")
        if self.verdict != PASS and not self.cause:
            raise ValueError(f"Finding {self.check}/{self.item}: a {self.verdict} must say its cause")

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != ""}


def at_most(check: str, item: str, figure: float, limit: float, cause: str, *, warn_factor: Optional[float] = None,
            details: Optional[dict[str, Any]] = None) -> Finding:
    """The verdict of ``trainer.precision.verdict`` (PASS when ``figure <= limit``; with ``warn_factor`` a figure up to
    ``warn_factor * limit`` is a WARN; FAIL beyond, a NaN fails). ``cause``: the likely cause, said when it does not
    pass."""
    found = verdict(figure, limit, warn_factor)
    return Finding(check, item, float(figure), f"<= {limit:.3g}", found, "" if found == PASS else cause, details)


def skipped(check: str, item: str, why: str) -> Finding:
    return Finding(check, item, None, "-", SKIP, why)



class CheckCannotRun(RuntimeError):
    """A check that cannot run with this engine, model or recipe: skipped with this message as the reason."""


@dataclass(frozen=True)
class Check:
    name: str
    question: str
    run: Callable[..., list[Finding]]  # called with the battery's ``context.Doctor`` (which imports this module)
    needs_engine: bool = True
    # hooks the engine's own modules: forward hooks fire only in an eager engine (not in a replayed CUDA graph nor in
    # vLLM's torch.compile'd forward), so the battery's engine runs eagerly when such a check is asked
    hooks_engine: bool = False
