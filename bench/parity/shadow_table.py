"""A run's shadow table (``parity.correction.shadow: true``) as markdown: every rule side by side, averaged over the
steps that have one, with the step's raw-ratio statistics beside it.

    python bench/parity/shadow_table.py runs/<name>                 # the table of a finished run
    python bench/parity/shadow_table.py runs/<name> --last          # the last shadow step only

Reads ``parity_breakdown.jsonl`` (``correction_shadow``) and ``metrics.jsonl`` (``correction/raw/*``) of the run
directory; nothing is recomputed. docs/corrections.md's measured table was made with it.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

COLUMNS = ("frac_masked", "frac_clipped", "frac_seqs_masked", "ess", "weight_mean", "loss_change", "signal_kept")
RAW = ("ratio_mean", "ratio_p1", "ratio_p99", "ratio_max", "chi2_token", "ess_token", "seq_ratio_p1",
       "seq_ratio_p99", "chi2_seq", "ess_seq")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shadow_steps(run_dir: Path) -> dict[int, list[dict]]:
    """{step: its shadow rows} for every step of the run that has a shadow table."""
    return {r["step"]: r["correction_shadow"] for r in read_jsonl(run_dir / "parity_breakdown.jsonl")
            if "correction_shadow" in r}


def mean_rows(tables: list[list[dict]]) -> list[dict]:
    """Each rule's columns averaged over the steps (rows matched by rule, in the first table's order)."""
    out = []
    for first in tables[0]:
        rows = [next(r for r in t if r["rule"] == first["rule"]) for t in tables]
        out.append({"rule": first["rule"], "in_use": first["in_use"], "options": first["options"],
                    **{c: sum(r[c] for r in rows) / len(rows) for c in COLUMNS}})
    return out


def _fmt(x: float) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "–"
    return f"{x:.2e}" if abs(x) < 1e-3 and x != 0 else f"{x:.4f}"


def markdown(rows: list[dict]) -> str:
    head = "| rule (options) | " + " | ".join(COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 1)]
    for r in rows:
        name = f"**{r['options']}** (in use)" if r["in_use"] else r["options"]
        lines.append(f"| {name} | " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |")
    return "\n".join(lines)


def raw_summary(run_dir: Path, steps: list[int]) -> str:
    """The mean over ``steps`` of the raw ratio statistics (``correction/raw/*``) and parity/mae."""
    metrics = {r["step"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step") in steps}
    keys = [f"correction/raw/{k}" for k in RAW] + ["parity/mae", "correction/num_tokens"]
    mean = {k: sum(metrics[s][k] for s in steps) / len(steps) for k in keys}
    return "\n".join(["| key | mean over the steps |", "|---|---|"] + [f"| `{k}` | {_fmt(v)} |" for k, v in mean.items()])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--last", action="store_true", help="the last shadow step only (default: the mean over all)")
    args = p.parse_args(argv)
    tables = shadow_steps(args.run_dir)
    if not tables:
        print(f"{args.run_dir}: no shadow table (run with --set parity.correction.shadow=true)")
        return 1
    steps = [max(tables)] if args.last else sorted(tables)
    print(f"{args.run_dir}: steps {steps[0]}..{steps[-1]} ({len(steps)} with a shadow table)\n")
    print(markdown(mean_rows([tables[s] for s in steps])))
    print()
    print(raw_summary(args.run_dir, steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
