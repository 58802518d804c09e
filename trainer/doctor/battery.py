"""Run the checks, in order, each to the end whatever the others did, and turn the findings into an exit status.

A check that cannot run here (``CheckCannotRun``, or an engine that cannot start: ``EngineCannotStart``) is a SKIP
with its reason; a check that raises anything else is a FAIL naming the error, never a traceback (the battery is
what a CI gates on: a broken check must not read as a pass).
"""
from __future__ import annotations

import time
from typing import Iterable, Optional, Sequence

from trainer.doctor.checks import CHECKS
from trainer.doctor.context import Doctor, EngineCannotStart, engine_reason
from trainer.doctor.records import FAIL, PASS, SKIP, WARN, Check, CheckCannotRun, Finding, skipped

# Exit statuses (docs/doctor.md; docs/runs-and-checkpoints.md lists every command's).
EXIT_PASSED = 0  # something passed, nothing failed (a SKIP is said, not failed; WARN rows are summed up as warnings)
EXIT_ENGINE = 4  # the engine cannot load this model (and nothing failed): the reason is printed
EXIT_FAILED = 8  # at least one check failed
EXIT_UNCHECKED = 9  # nothing was checked: no PASS and no FAIL (every row skipped or warned); never a pass


def select(only: Optional[Sequence[str]]) -> list[Check]:
    """The checks to run: all, or those named by ``--only`` (an unknown name is a ``ValueError`` naming the known)."""
    if not only:
        return list(CHECKS)
    known = {c.name: c for c in CHECKS}
    unknown = [n for n in only if n not in known]
    if unknown:
        raise ValueError(f"--only {unknown[0]!r}: expected one of {', '.join(known)}")
    return [c for c in CHECKS if c.name in only]


def hook_checks(checks: Iterable[Check]) -> list[str]:
    """The names of ``checks`` that hook the engine's modules (``Check.hooks_engine``): the battery's engine then
    runs eagerly (``context.engine_config``)."""
    return [c.name for c in checks if c.hooks_engine]


def run_checks(doc: Doctor, checks: Iterable[Check]) -> tuple[list[Finding], dict[str, float]]:
    """Every finding of every check, and each check's seconds."""
    findings, seconds = [], {}
    for check in checks:
        doc.say(f"check {check.name}: {check.question}")
        t0 = time.monotonic()
        try:
            found = check.run(doc)
        except EngineCannotStart as e:
            found = [skipped(check.name, "engine", f"the engine cannot load this model: {e}")]
        except CheckCannotRun as e:
            found = [skipped(check.name, "-", str(e))]
        except Exception as e:  # noqa: BLE001 - reported as this check's failure, the others still run
            found = [Finding(check.name, "-", None, "completes", FAIL, f"the check could not complete: "
                                                                          f"{engine_reason(e)}")]
        seconds[check.name] = round(time.monotonic() - t0, 2)
        findings += found
    return findings, seconds


def exit_status(findings: Sequence[Finding], engine_error: Optional[str]) -> int:
    """FAIL anywhere: 8; else an engine that cannot load the model: 4; else no PASS at all (nothing was checked to a
    verdict, e.g. every check skipped on this engine): 9; else 0."""
    if any(f.verdict == FAIL for f in findings):
        return EXIT_FAILED
    if engine_error:
        return EXIT_ENGINE
    return EXIT_PASSED if any(f.verdict == PASS for f in findings) else EXIT_UNCHECKED


def summary(findings: Sequence[Finding], status: int) -> str:
    """The battery's last line: what its exit status means, with the warnings and skips counted (a WARN is never
    summed up as a pass, nor a battery of skips as one)."""
    count = {v: sum(f.verdict == v for f in findings) for v in (PASS, WARN, FAIL, SKIP)}
    tally = ", ".join(f"{n} {v}" for v, n in count.items() if n)
    warned = [f"{f.check}: {f.item}" for f in findings if f.verdict == WARN]
    head = {EXIT_FAILED: "a check failed",
            EXIT_ENGINE: "the engine cannot load this model",
            EXIT_UNCHECKED: "nothing was checked: no check passed or failed",
            EXIT_PASSED: "no check failed" if warned else "every check that ran passed"}[status]
    warnings = f"; {len(warned)} warning{'s' if len(warned) > 1 else ''} ({'; '.join(warned)})" if warned else ""
    return f"{head} ({tally or 'no rows'}){warnings}"
