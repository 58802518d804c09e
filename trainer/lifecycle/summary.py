"""The summary a run prints (and sends to wandb) when it ends: over the whole run, read back from metrics.jsonl
(a resumed process holds only its own steps)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from trainer.io.run_logger import RunLogger
from trainer.lifecycle.run_health import health_warnings
from trainer.models.memory import PEAK_MEMORY_NOTE


def _mean(xs: list) -> float:
    xs = [x for x in xs if isinstance(x, (int, float))]  # metrics.jsonl writes a non-finite value as null
    return sum(xs) / len(xs) if xs else float("nan")


def _last_row_per_step(metrics_path: Path, wanted) -> Optional[dict[int, dict]]:
    """Step -> its last record in ``metrics_path`` among those ``wanted(row)`` accepts (a resume may repeat a step;
    a killed run may leave a partial last line); None when the file cannot be read."""
    try:
        lines = Path(metrics_path).read_text().splitlines()
    except OSError:
        return None
    by_step: dict[int, dict] = {}
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and wanted(row):
            by_step[row["step"]] = row
    return by_step


def whole_run(metrics_path: Path, h: list[dict]) -> list[dict]:
    """Every step's record, step 1 on, from ``metrics_path``; the last record of a step wins (a resume repeats
    the steps after its checkpoint). ``h`` (this process's records) when the file cannot be read."""
    by_step = _last_row_per_step(metrics_path, lambda row: row["step"] >= 1 and "reward/mean" in row)
    if by_step is None:
        return h
    last = h[-1]["step"] if h else None
    rows = [by_step[k] for k in sorted(by_step) if last is None or k <= last]
    return rows or h


def print_summary(h: list[dict], final_checkpoint: Optional[Path], logger: RunLogger, best=None) -> None:
    """The run's end (``h``: this process's per-step records; the summary reads the whole run back from
    metrics.jsonl): reward at its start and end, its mean mismatch, where its checkpoint and metrics are."""
    if not h or not logger.enabled:
        return
    h = whole_run(logger.metrics_path, h)
    k = max(1, min(5, len(h) // 4))
    first = _mean([r["reward/mean"] for r in h[:k]])
    last = _mean([r["reward/mean"] for r in h[-k:]])
    mae = _mean([r["parity/mae"] for r in h if "parity/mae" in r])
    kl = _mean([r["parity/kl_k3"] for r in h if "parity/kl_k3" in r])
    worst = max((r.get("parity/max_abs") or 0.0 for r in h), default=0.0)
    # each record holds its process's peak so far (trainer/models/memory.py): the run's is the largest
    peak = max((r.get("perf/peak_memory_gb") or 0.0 for r in h), default=0.0)
    summary = {"summary/reward_first": first, "summary/reward_last": last, "summary/parity_mae_mean": mae,
               "summary/parity_kl_k3_mean": kl, "summary/peak_memory_gb": peak}
    logger.summary(summary)
    print("\n=== parityrl run summary ===")
    print(f"reward   first {k} step(s): {first:.3f}   last {k} step(s): {last:.3f}   change {last - first:+.3f}")
    print(f"parity   mean |d| over the run: {mae:.2e}   mean kl_k3: {kl:.2e}   worst token |d|: {worst:.2e}")
    for line in (episodes_line(h, k), routing_line(h), distill_line(h, k)):
        if line:
            print(line)
    evals = _last_row_per_step(logger.metrics_path, lambda row: any(k.startswith("eval/") for k in row)) or {}
    held_out = held_out_line(evals)
    if held_out:
        print(held_out)
    probes = _last_row_per_step(logger.metrics_path, lambda row: "probe/mae" in row) or {}
    for line in health_warnings(h, k, evals, {s: r["probe/mae"] for s, r in probes.items()}):
        print(line)
    if peak:  # records written before perf/peak_memory_gb existed have none
        print(f"memory   peak {peak:.2f} GiB ({PEAK_MEMORY_NOTE})")
    print(f"checkpoint  {final_checkpoint}")
    if best is not None and best.metric and best.step is not None:  # checkpoint.best_metric
        where = (f"{Path(final_checkpoint).parent / f'step_{best.step:06d}'}" if best.step and final_checkpoint
                 else "the starting weights (no checkpoint)")
        print(f"best        {best.metric} {best.value:.4g} at step {best.step}: {where}")
    print(f"metrics     {logger.metrics_path}")
    print(f"wandb       {logger.wandb_location}")


def episodes_line(h: list[dict], k: int) -> str:
    """A run of tool-using episodes (docs/episodes.md): tool calls and tool errors per episode over the first and the
    last ``k`` steps (the reward line's), which say whether the policy learnt to use its tools; "" without episodes."""
    calls = [r for r in h if isinstance(r.get("episode/tool_calls"), (int, float))]
    if not calls:
        return ""
    k = min(k, len(calls))

    def change(key: str) -> str:
        return f"{_mean([r.get(key) for r in calls[:k]]):.2f} -> {_mean([r.get(key) for r in calls[-k:]]):.2f}"

    return (f"episodes tool calls per episode {change('episode/tool_calls')}, tool errors "
            f"{change('episode/tool_errors')} (first {k} / last {k} step(s))")


def routing_line(h: list[dict]) -> str:
    """A mixture-of-experts run's routing (docs/moe.md): how often the two sides' routers agree, and on the steps
    scored both ways, the KL with replay against without it; "" for a run without routes."""
    agree = [r["parity/routing_agree"] for r in h if r.get("parity/routing_agree") is not None]
    if not agree:
        return ""
    diff = _mean([r["parity/routing_tokens_any_diff"] for r in h if "parity/routing_tokens_any_diff" in r])
    line = f"routing  routers agree on {_mean(agree):.2%} of (token, layer) choices, {diff:.1%} of tokens differ somewhere"
    both = [r for r in h if r.get("parity/unreplayed/kl_k3") is not None]
    if both:
        with_, without = _mean([r["parity/kl_k3"] for r in both]), _mean([r["parity/unreplayed/kl_k3"] for r in both])
        line += f"; replay: kl_k3 {with_:.2e} vs {without:.2e} without ({len(both)} step(s) scored both ways)"
    return line


def distill_line(h: list[dict], k: int) -> str:
    """A run with a teacher (docs/distillation.md): the per-token reverse KL to it over the first and the last ``k``
    steps (the reward line's), and the mean ``teacher_noise_frac`` where measured; "" for a run without a teacher."""
    rkl = [r["distill/reverse_kl"] for r in h if isinstance(r.get("distill/reverse_kl"), (int, float))]
    if not rkl:
        return ""
    k = min(k, len(rkl))
    first, last = _mean(rkl[:k]), _mean(rkl[-k:])
    line = (f"distill  reverse KL per token, first {k} step(s): {first:+.4f}   last {k} step(s): {last:+.4f}   "
            f"change {last - first:+.4f}")
    noise = [r["distill/teacher_noise_frac"] for r in h if isinstance(r.get("distill/teacher_noise_frac"), (int, float))]
    if noise:
        line += f"; teacher noise frac {_mean(noise):.3f} ({len(noise)} step(s) measured)"
    return line


def held_out_line(by_step: dict[int, dict]) -> str:
    """``held-out`` accuracy at the run's first and last evaluation (trainer/measurement/evaluation.py), or "" without any;
    ``by_step``: step -> its last record holding ``eval/`` figures (as ``whole_run``, a resume's repeat wins)."""
    if not by_step:
        return ""
    first, last = by_step[min(by_step)], by_step[max(by_step)]
    keys = [k for k in first if k.startswith(("eval/mean@", "eval/greedy")) and k.count("/") == 1]

    def shown(row: dict) -> str:
        return "  ".join(f"{k[5:]} {row[k]:.3f}" for k in keys if isinstance(row.get(k), (int, float)))

    return f"held-out step {min(by_step)}: {shown(first)}   step {max(by_step)}: {shown(last)}"
