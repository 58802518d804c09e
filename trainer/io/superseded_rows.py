"""A resume's record files hold no rows past the checkpoint it resumes from.

A run writes a step's rows (``metrics.jsonl``, ``samples.jsonl``, ``parity_breakdown.jsonl``) before that
step's checkpoint, and checkpoints only every ``checkpoint.every`` steps; a run killed in between leaves rows
of steps its checkpoint does not hold. The resume trains those steps again, so their earlier rows are not
the run's. ``move_superseded_rows`` moves them to ``<name>.superseded.jsonl`` (``metrics.superseded.jsonl``,
...) before the resume appends, each row with ``superseded_by_resume_from`` = the checkpoint's step.

Moved rather than marked in place: every reader of these files (the end-of-run summary, the bench scripts,
the tests, a user's ``json.loads`` per line, pandas) takes every row as a step; a mark would need each of
them to know to skip it, while a file that never holds a step twice cannot be misread. The rows are kept,
not deleted: they are what the earlier run measured (wandb keeps them too, see ``resume_line``).

The move is crash-safe: the rows are appended (and synced) to the superseded file first, then cut from the
record file, so a kill in between leaves them in both places -- the next resume moves them again -- and never
loses one.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

# The files a step appends rows to (each row with its "step"): trainer/io/run_logger.py, trainer/lifecycle/samples_table.py,
# trainer/measurement/parity_breakdown.py.
RECORD_FILES = ("metrics.jsonl", "samples.jsonl", "parity_breakdown.jsonl")
MARK = "superseded_by_resume_from"


def superseded_path(path: Path) -> Path:
    """``runs/x/metrics.jsonl`` -> ``runs/x/metrics.superseded.jsonl`` (not ``*/metrics.jsonl`` nor
    ``metrics.jsonl*``: no glob for the record file finds it)."""
    path = Path(path)
    stem = path.name[:-len(".jsonl")] if path.name.endswith(".jsonl") else path.name
    return path.with_name(f"{stem}.superseded.jsonl")


def _step(line: bytes) -> Optional[int]:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def move_rows_past(path: Path, resumed_step: int) -> list[int]:
    """Move the rows of ``path`` whose step is past ``resumed_step`` to ``superseded_path(path)``; the step of
    each row moved, in file order. A line that is not a row with a step stays where it is."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.splitlines(keepends=True)
    past = [i for i, line in enumerate(lines) if (s := _step(line)) is not None and s > resumed_step]
    if not past:
        return []
    steps = [_step(lines[i]) for i in past]
    with open(superseded_path(path), "ab") as f:
        for i in past:
            row = json.loads(lines[i])
            f.write((json.dumps({**row, MARK: resumed_step}) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
    if past == list(range(past[0], len(lines))):  # the usual case: a tail (rows are appended in step order)
        os.truncate(path, sum(len(line) for line in lines[:past[0]]))
    else:  # rows of an older resume's repeats in between: the kept rows, written whole, then swapped in
        moved = set(past)
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.writelines(line for i, line in enumerate(lines) if i not in moved)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return steps


def move_superseded_rows(run_dir: Path, resumed_step: int, files: tuple[str, ...] = RECORD_FILES
                         ) -> dict[str, list[int]]:
    """``move_rows_past`` for each record file of ``run_dir``: file name -> the steps of its rows moved (only
    files that had any)."""
    moved = {}
    for name in files:
        steps = move_rows_past(Path(run_dir) / name, resumed_step)
        if steps:
            moved[name] = steps
    return moved


def step_ranges(steps: list[int]) -> str:
    """``[11, 12, 13, 15]`` -> ``"11-13, 15"``."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive steps
    for s in sorted(set(steps)):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def resume_line(run_dir: Path, resumed_step: int, moved: dict[str, list[int]], *, wandb: bool) -> Optional[str]:
    """The console line of a resume that moved rows (None if it moved none): how many, of which steps, where."""
    if not moved:
        return None
    steps = step_ranges([s for v in moved.values() for s in v])
    files = ", ".join(f"{name} {len(v)} row{'s' * (len(v) != 1)} -> {superseded_path(Path(name)).name}"
                      for name, v in moved.items())
    line = (f"note: resuming from step {resumed_step}: moved the rows of steps {steps} that the earlier run wrote "
            f"past its checkpoint out of the way in {run_dir} ({files}); this run writes those steps again")
    if wandb:
        line += (f"; the wandb run keeps the earlier values of steps {steps} (wandb drops a logged step below the "
                 "last one it holds, with its own warning)")
    return line
