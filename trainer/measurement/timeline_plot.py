"""``timeline.png``: one row per lane, one bar per span, each ``generate`` bar coloured by the version that
generated it and labelled with the step that trains on it (``trainer.measurement.timeline``).

Drawn on a ``matplotlib.figure.Figure`` of its own, not through pyplot: pyplot's global backend and figure list
belong to the user's process (a notebook running ``train``), and a file needs neither."""
from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure

ROWS = {"generate": 3, "train": 2, "sync": 1, "eval": 0}
FIXED = {"train": "#4c72b0", "sync": "#8c8c8c", "eval": "#55a868"}


def save(spans, busy: dict[str, float], title: str, path: Path) -> None:
    fig = Figure(figsize=(12, 3.2))
    ax = fig.subplots()
    versions = sorted({s.version for s in spans if s.lane == "generate"})
    cmap = colormaps["viridis"].resampled(max(len(versions), 2))
    shade = {v: cmap(i) for i, v in enumerate(versions)}
    label_room = max((s.end for s in spans), default=1.0) / 60  # a label fits a bar this long
    for s in spans:
        colour = shade[s.version] if s.lane == "generate" else FIXED[s.lane]
        ax.broken_barh([(s.start, max(s.end - s.start, 1e-3))], (ROWS[s.lane] - 0.4, 0.8), facecolors=colour,
                       edgecolor="white", linewidth=0.5)
        if s.lane in ("generate", "train") and s.end - s.start > label_room:
            text = f"{s.step}" if s.lane == "train" else f"{s.step}\nv{s.version}"
            ax.text((s.start + s.end) / 2, ROWS[s.lane], text, ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(list(ROWS.values()))
    ax.set_yticklabels([f"{lane} ({100 * busy.get(lane, 0.0):.0f}% busy)" for lane in ROWS])
    ax.set_xlabel("seconds since the run started  (generate: the step a batch is for, v = the version generating it)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
