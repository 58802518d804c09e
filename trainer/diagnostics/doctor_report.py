"""The doctor's table on the console and ``doctor.json`` beside the plots in the report folder (beside `parityrl
compare`'s report, ``compare_report``)."""
from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any, Sequence

# A finding is the doctor's ``trainer.doctor.records.Finding`` (check, item, figure, expected, verdict, cause,
# ``to_json()``), read here by its fields only: the diagnostics room sits below the doctor's.
Finding = Any


def format_figure(x) -> str:
    if x is None:
        return "-"
    if x == 0 or (1e-3 <= abs(x) < 1e4):
        return f"{x:.4g}"
    return f"{x:.2e}"


def table(findings: Sequence[Finding]) -> str:
    """check | item | figure | expected | verdict, then the cause of every line that did not pass."""
    rows = [(f.check, f.item, format_figure(f.figure), f.expected, f.verdict) for f in findings]
    head = ("check", "item", "figure", "expected", "verdict")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [line(head), line(tuple("-" * w for w in widths))]
    for f, r in zip(findings, rows):
        out.append(line(r))
        if f.cause:
            out.append(f"{'':{widths[0]}}  -> {f.cause}")
    return "\n".join(out)


def write_json(out_dir: Path, findings: Sequence[Finding], *, status: int, header: dict[str, Any],
               seconds: dict[str, float]) -> Path:
    path = Path(out_dir) / "doctor.json"
    doc = {"command": "parityrl doctor",
           "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           **header, "exit_status": status, "seconds": seconds,
           "verdicts": {v: sum(f.verdict == v for f in findings) for v in ("PASS", "WARN", "FAIL", "SKIP")},
           "findings": [f.to_json() for f in findings]}
    path.write_text(json.dumps(doc, indent=2, default=float) + "\n")
    return path
