"""The pipeline's timeline: when the engine generated and when the trainer trained, step by step, with the
version of the weights that generated each batch.

What a user looks at to see whether ``rollout.max_staleness`` pays: with k = 0 the lanes alternate (the
engine idles while the trainer trains); with k >= 1 in server mode a batch's generation runs beside earlier
steps' training. Spans are kept in memory (a few per step) and written at the end of the run, and when it
stops, as ``timeline.jsonl`` (one span a line: lane, step, version, start and end in seconds from the run's
start) and ``timeline.png`` when matplotlib is installed (the ``reports`` extra; ``make setup`` installs it),
which also goes to wandb. ``busy_fractions`` is the share of the wall clock each lane was busy.

Lanes: ``generate`` (the engine drawing a batch: the step it is for, the version that generates it; in server
mode with k >= 1 this runs in the rollout thread), ``train`` (scoring, corrections, parity and the update),
``sync`` (waiting for the launched batches, the weight push and the probe), ``eval`` (held-out evaluation).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional, TypeVar

LANES = ("generate", "train", "sync", "eval")
T = TypeVar("T")


@dataclass(frozen=True)
class Span:
    lane: str
    step: int
    version: int  # the weights' version: the batch's behaviour version for ``generate``, step - 1 otherwise
    start: float  # seconds since the timeline began
    end: float


class Timeline:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._t0 = clock()
        self.spans: list[Span] = []  # appended from the rollout thread too: list.append is atomic

    def now(self) -> float:
        return self._clock() - self._t0

    def add(self, lane: str, step: int, version: int, start: float, end: float) -> None:
        if lane not in LANES:
            raise ValueError(f"timeline lane {lane!r}: expected one of {LANES}")
        self.spans.append(Span(lane, step, version, start, end))

    def timed(self, lane: str, step: int, version: int, fn: Callable[..., T], *args) -> T:
        """``fn(*args)``, its span recorded (also when it raises: the time was spent)."""
        start = self.now()
        try:
            return fn(*args)
        finally:
            self.add(lane, step, version, start, self.now())

    def busy_fractions(self) -> dict[str, float]:
        """Each lane's busy time over the wall clock from the first span's start to the last's end
        (overlapping spans of one lane counted once)."""
        if not self.spans:
            return {}
        first, last = min(s.start for s in self.spans), max(s.end for s in self.spans)
        wall = max(last - first, 1e-12)
        out = {}
        for lane in LANES:
            busy, reach = 0.0, first
            for s in sorted((s for s in self.spans if s.lane == lane), key=lambda s: s.start):
                if s.end > reach:
                    busy += s.end - max(s.start, reach)
                    reach = s.end
            out[lane] = busy / wall
        return out

    def write(self, run_dir: Path, title: str) -> Optional[Path]:
        """``timeline.jsonl`` in ``run_dir``, and ``timeline.png`` (returned) when matplotlib is installed."""
        run_dir = Path(run_dir)
        with open(run_dir / "timeline.jsonl", "w") as f:
            for s in self.spans:
                f.write(json.dumps(asdict(s)) + "\n")
        try:
            # late: the plot module imports matplotlib, an optional extra that a run without it never needs
            from trainer.measurement.timeline_plot import save
        except ImportError:
            return None
        path = run_dir / "timeline.png"
        save(self.spans, self.busy_fractions(), title, path)
        return path
