"""A check's record: its name (``--only``), what it asks in one line, whether it needs the engine, and the function
that returns its findings. One file per check under ``checks/``, each exporting ``CHECK``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trainer.doctor.context import Doctor
from trainer.doctor.finding import Finding


class CheckCannotRun(RuntimeError):
    """A check that cannot run with this engine, model or recipe: skipped with this message as the reason."""


@dataclass(frozen=True)
class Check:
    name: str
    question: str
    run: Callable[[Doctor], list[Finding]]
    needs_engine: bool = True
