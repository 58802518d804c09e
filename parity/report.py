"""Report directory of an engine-vs-trainer log-prob comparison, written from plain python rows.

Files (``REPORT_FILES``):

* ``summary.json``  settings, versions, counts, metrics, breakdowns (strict JSON: a
  non-finite float, e.g. the open upper edge of the last entropy bin, is written as null);
* ``tokens.jsonl``  one row per valid completion token;
* ``samples.jsonl`` one row per sample (prompt and completion text, length, finish reason);
* ``report.xlsx``   "summary" sheet (settings + metrics), "longest" and "typical" sheets
  of per-token rows for a handful of samples, one sheet per breakdown table;
* ``scatter_logprob.png``, ``scatter_prob.png``, ``diff_by_position.png``, ``diff_hist.png``.

The caller computes every number (``parity.metrics`` holds the definitions); this
module only lays them out. matplotlib and openpyxl are the ``reports`` extra and are
imported lazily: ``require_report_deps`` lets a caller fail before any expensive work.
Plots use the Agg canvas directly, never pyplot, so no global backend state is touched.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any, Dict, Iterable, List, Sequence

__all__ = [
    "REPORT_FILES",
    "TOKEN_COLUMNS",
    "require_report_deps",
    "check_out_dir",
    "prepare_out_dir",
    "write_report",
    "pick_longest",
    "pick_typical",
]

TOKEN_COLUMNS = (
    "sample", "prompt", "position", "token_id", "token",
    "engine_logprob", "trainer_logprob", "diff", "trainer_entropy",
)
PLOT_FILES = ("scatter_logprob.png", "scatter_prob.png", "diff_by_position.png", "diff_hist.png")
REPORT_FILES = ("summary.json", "tokens.jsonl", "samples.jsonl", "report.xlsx") + PLOT_FILES

# Excel refuses cells longer than this, and XML 1.0 refuses most control characters
# (byte-level tokenizers produce tokens such as "\x1b"); both are escaped, not dropped.
_XLSX_MAX_CELL = 32_767
_XLSX_ILLEGAL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def require_report_deps() -> None:
    """Raise ImportError with the install hint if matplotlib or openpyxl is missing."""
    missing = []
    for mod in ("matplotlib", "openpyxl"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise ImportError(
            f"the comparison report needs {' and '.join(missing)}; install the reports extra: "
            f"pip install -e '.[reports]'  (or: pip install {' '.join(missing)})"
        )


def check_out_dir(out_dir: Path | str, overwrite: bool = False) -> Path:
    """Refuse ``out_dir`` if it is a file, or a non-empty directory without ``overwrite``; touches nothing.

    Called before any expensive work, so a refusal costs the user nothing.
    """
    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {str(out)!r} exists and is a file; expected a new or empty directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(
            f"--out {str(out)!r} already exists and is not empty (an earlier report?); "
            "choose another directory or pass --overwrite to replace the report files in it"
        )
    return out


def prepare_out_dir(out_dir: Path | str, overwrite: bool = False) -> Path:
    """``check_out_dir``, then create the directory (with ``overwrite``: remove this module's files first).

    Only the report's own files are removed (a stale plot must not survive next to a
    new summary); anything else the user keeps there stays.
    """
    out = check_out_dir(out_dir, overwrite)
    if out.is_dir():
        for name in REPORT_FILES:
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    return out


# ----------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------


def write_report(
    out_dir: Path | str,
    *,
    summary: Dict[str, Any],
    tokens: Sequence[Dict[str, Any]],
    samples: Sequence[Dict[str, Any]],
    per_position: Sequence[Dict[str, Any]],
    num_examples: int = 5,
) -> Dict[str, Path]:
    """Write every report file into the (prepared) directory ``out_dir``; returns name -> path.

    Args:
        summary: JSON-able dict; its scalar leaves go to the xlsx "summary" sheet, each list
            of row dicts under ``summary["breakdowns"]`` to a sheet of its own.
        tokens: rows with the keys ``TOKEN_COLUMNS``, ordered by (sample, position).
        samples: rows with at least "sample", "prompt", "num_tokens", "finish_reason",
            "prompt_text", "completion_text" (optionally "mae", "seq_log_ratio").
        per_position: ``parity.metrics.error_by_position`` rows with one bucket per position.
        num_examples: samples in each of the "longest" and "typical" sheets.

    ``summary.json`` is written last, so its presence marks a complete report.
    """
    require_report_deps()
    out = Path(out_dir)
    paths = {name: out / name for name in REPORT_FILES}
    _write_jsonl(paths["tokens.jsonl"], tokens)
    _write_jsonl(paths["samples.jsonl"], samples)
    _write_xlsx(paths["report.xlsx"], summary, tokens, samples, num_examples)
    _write_plots(out, tokens, per_position, summary.get("metrics", {}))
    _write_json(paths["summary.json"], summary)
    return paths


# ----------------------------------------------------------------------------------
# JSON
# ----------------------------------------------------------------------------------


def _finite(x: Any) -> Any:
    """Non-finite floats -> None, recursively (strict JSON has no Infinity/NaN)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(_finite(obj), indent=2, allow_nan=False) + "\n")


def _write_jsonl(path: Path, rows: Iterable[Dict[str, Any]]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(_finite(row), allow_nan=False, ensure_ascii=False) + "\n")


# ----------------------------------------------------------------------------------
# Sample selection
# ----------------------------------------------------------------------------------


def pick_longest(samples: Sequence[Dict[str, Any]], k: int) -> List[Dict[str, Any]]:
    """The ``k`` samples with the most tokens (ties: lower sample index first)."""
    return sorted(samples, key=lambda s: (-s["num_tokens"], s["sample"]))[:k]


def pick_typical(samples: Sequence[Dict[str, Any]], k: int, exclude: Iterable[int] = ()) -> List[Dict[str, Any]]:
    """The ``k`` samples whose length is closest to the median length (ties: lower index).

    Samples in ``exclude`` are skipped while enough others remain, so a small run still
    gets a full sheet.
    """
    if not samples:
        return []
    median = statistics.median(s["num_tokens"] for s in samples)
    excluded = set(exclude)
    pool = [s for s in samples if s["sample"] not in excluded]
    if len(pool) < k:
        pool = list(samples)
    return sorted(pool, key=lambda s: (abs(s["num_tokens"] - median), s["sample"]))[:k]


# ----------------------------------------------------------------------------------
# XLSX
# ----------------------------------------------------------------------------------


def _cell(x: Any) -> Any:
    """A value openpyxl can store: escaped text, finite numbers, JSON for anything else."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x is None or isinstance(x, (bool, int, float)):
        return x
    if not isinstance(x, str):
        x = json.dumps(_finite(x))
    x = _XLSX_ILLEGAL.sub(lambda m: f"\\x{ord(m.group()):02x}", x)
    return x if len(x) <= _XLSX_MAX_CELL else x[: _XLSX_MAX_CELL - 20] + " ...[truncated]"


def _flatten(d: Dict[str, Any], prefix: str = "") -> List[tuple]:
    """(dotted key, scalar) pairs of a nested dict; lists of rows are left to their own sheets."""
    rows = []
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            rows += _flatten(v, key + ".")
        elif not (isinstance(v, list) and v and isinstance(v[0], dict)):
            rows.append((key, v))
    return rows


def _header(ws, values: Sequence[str], bold) -> None:
    ws.append(list(values))
    for c in ws[ws.max_row]:
        c.font = bold


def _summary_sheet(ws, summary: Dict[str, Any], bold) -> None:
    _header(ws, ("key", "value"), bold)
    for key, value in _flatten({k: v for k, v in summary.items() if k != "breakdowns"}):
        ws.append([key, _cell(value)])
    ws.column_dimensions["A"].width = 42
    ws.column_dimensions["B"].width = 60


def _examples_sheet(ws, chosen, by_sample: Dict[int, List[Dict[str, Any]]], bold) -> None:
    """Per chosen sample: a title line, the prompt and completion text, then one row per token."""
    cols = ("position", "token_id", "token", "engine_logprob", "trainer_logprob", "diff", "trainer_entropy")
    for s in chosen:
        mae = s.get("mae")
        title = (f"sample {s['sample']} (prompt {s['prompt']}): {s['num_tokens']} tokens, "
                 f"finish={s['finish_reason']}" + (f", mean |diff| = {mae:.3e}" if mae is not None else ""))
        _header(ws, (title,), bold)
        ws.append(["prompt", _cell(s["prompt_text"])])
        ws.append(["completion", _cell(s["completion_text"])])
        _header(ws, cols, bold)
        for t in by_sample.get(s["sample"], []):
            ws.append([_cell(t[c]) for c in cols])
        ws.append([])
    for letter, width in zip("ABCDEFG", (12, 10, 16, 16, 16, 14, 16)):
        ws.column_dimensions[letter].width = width


def _table_sheet(ws, rows: Sequence[Dict[str, Any]], bold) -> None:
    cols = list(rows[0].keys())
    _header(ws, cols, bold)
    for r in rows:
        ws.append([_cell(r.get(c)) for c in cols])


def _write_xlsx(path: Path, summary, tokens, samples, num_examples: int) -> None:
    from openpyxl import Workbook
    from openpyxl.styles import Font

    bold = Font(bold=True)
    wb = Workbook()
    ws = wb.active
    ws.title = "summary"
    _summary_sheet(ws, summary, bold)
    by_sample: Dict[int, List[Dict[str, Any]]] = {}
    for t in tokens:
        by_sample.setdefault(t["sample"], []).append(t)
    longest = pick_longest(samples, num_examples)
    typical = pick_typical(samples, num_examples, exclude=[s["sample"] for s in longest])
    _examples_sheet(wb.create_sheet("longest"), longest, by_sample, bold)
    _examples_sheet(wb.create_sheet("typical"), typical, by_sample, bold)
    for name, rows in (summary.get("breakdowns") or {}).items():
        if rows:
            _table_sheet(wb.create_sheet(name[:31]), rows, bold)
    wb.save(path)


# ----------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------


def _figure(width: float = 6.0, height: float = 5.0):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _metric_note(metrics: Dict[str, Any]) -> str:
    parts = []
    for key, label, fmt in (("parity/mae", "mae", ".2e"), ("parity/max_abs", "max", ".2e"),
                            ("parity/pearson", "pearson", ".6f")):
        if metrics.get(key) is not None:
            parts.append(f"{label} {metrics[key]:{fmt}}")
    return ", ".join(parts)


def _scatter(path: Path, x, y, *, log: bool, title: str, xlabel: str, ylabel: str) -> None:
    fig, ax = _figure()
    if log:  # a probability that underflowed to 0 has no place on a log axis
        keep = [(a, b) for a, b in zip(x, y) if a > 0 and b > 0]
        x, y = [a for a, _ in keep], [b for _, b in keep]
        ax.set_xscale("log")
        ax.set_yscale("log")
    if x:  # the diagonal under the points: at parity every point sits on it
        lo, hi = min(min(x), min(y)), max(max(x), max(y))
        ax.plot([lo, hi], [lo, hi], color="grey", linestyle="--", linewidth=0.8, label="y = x (perfect parity)")
    ax.scatter(x, y, s=10, alpha=0.6, linewidths=0, rasterized=True, label="tokens", zorder=3)
    ax.legend(loc="upper left")
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    fig.tight_layout()
    fig.savefig(path)


def _position_plot(path: Path, per_position: Sequence[Dict[str, Any]]) -> None:
    fig, ax = _figure(7.0, 4.5)
    pos = [r["position_start"] for r in per_position]
    ax.plot(pos, [r["mean_abs_d"] for r in per_position], marker=".", label="mean |diff|")
    ax.set(title="mean |trainer - engine| log-prob by completion position", xlabel="position in completion",
           ylabel="mean |diff| (nats)")
    # Later positions hold fewer tokens (completions end): their means are noisier.
    twin = ax.twinx()
    twin.step(pos, [r["num_tokens"] for r in per_position], where="mid", color="grey", alpha=0.5,
              label="tokens at position")
    twin.set_ylabel("tokens at position", color="grey")
    twin.set_ylim(0, 1.1 * max([r["num_tokens"] for r in per_position], default=1))
    fig.tight_layout()
    fig.savefig(path)


def _hist_plot(path: Path, diffs: Sequence[float], note: str) -> None:
    fig, ax = _figure(7.0, 4.5)
    ax.hist(diffs, bins=100, log=True)
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set(title="diff = trainer - engine log-prob" + (f"\n{note}" if note else ""),
           xlabel="diff (nats)", ylabel="tokens (log scale)")
    fig.tight_layout()
    fig.savefig(path)


def _write_plots(out: Path, tokens, per_position, metrics: Dict[str, Any]) -> None:
    lr = [t["engine_logprob"] for t in tokens]
    lt = [t["trainer_logprob"] for t in tokens]
    note = _metric_note(metrics)
    n = f"{len(tokens)} tokens"
    _scatter(out / "scatter_logprob.png", lr, lt, log=False, title=f"log-prob of the sampled token ({n})\n{note}",
             xlabel="engine log-prob", ylabel="trainer (HF) log-prob")
    _scatter(out / "scatter_prob.png", [math.exp(v) for v in lr], [math.exp(v) for v in lt], log=True,
             title=f"probability of the sampled token ({n})", xlabel="engine probability",
             ylabel="trainer (HF) probability")
    _position_plot(out / "diff_by_position.png", per_position)
    _hist_plot(out / "diff_hist.png", [t["diff"] for t in tokens], note)

