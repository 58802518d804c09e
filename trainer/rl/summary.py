"""The summary a run prints (and sends to wandb) when it ends."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from trainer.io.run_logger import RunLogger


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def print_summary(h: list[dict], final_checkpoint: Optional[Path], logger: RunLogger) -> None:
    """The run's end (``h``: its per-step records): reward at its start and end, its mean mismatch, where its
    checkpoint and metrics are."""
    if not h or not logger.enabled:
        return
    k = max(1, min(5, len(h) // 4))
    first = _mean([r["reward/mean"] for r in h[:k]])
    last = _mean([r["reward/mean"] for r in h[-k:]])
    mae = _mean([r["parity/mae"] for r in h if "parity/mae" in r])
    kl = _mean([r["parity/kl_k3"] for r in h if "parity/kl_k3" in r])
    worst = max((r.get("parity/max_abs", 0.0) for r in h), default=0.0)
    summary = {"summary/reward_first": first, "summary/reward_last": last, "summary/parity_mae_mean": mae,
               "summary/parity_kl_k3_mean": kl}
    logger.summary(summary)
    print("\n=== parityrl run summary ===")
    print(f"reward   first {k} step(s): {first:.3f}   last {k} step(s): {last:.3f}   change {last - first:+.3f}")
    print(f"parity   mean |d| over the run: {mae:.2e}   mean kl_k3: {kl:.2e}   worst token |d|: {worst:.2e}")
    print(f"checkpoint  {final_checkpoint}")
    print(f"metrics     {logger.metrics_path}")
    print(f"wandb       {logger.wandb_location}")
