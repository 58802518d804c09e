"""Rows of bench/gpu/gpu_check.py for off-policy rollouts on CUDA (issue 58): ``rollout.max_staleness`` k = 3 with
the colocated vLLM engine, where prefix caching is live (16-token KV blocks, unlike the CPU engine's 128) and the
stale-KV alarm (rollout/stale_kv.py) checks every update.

- ``staleness_row``: ``recipes/grpo_tiny.yaml`` for 5 steps on the tiny model, k = 3, ``algorithm.off_policy:
  m2po``. Pass: exit 0 (no stale-KV alarm), ``staleness/lag`` 0, 1, 2, 3, 3; ``parity/mae`` below 1e-2 every step
  (bf16 numerics) and ``staleness/kl_k3`` > 0 from step 2; the M2PO metrics logged from step 2; ``timeline.png``
  written. Printed: parity/mae and staleness/mae by lag.
- ``in_flight_row`` (2 GPUs, vLLM's CUDA build): ``parityrl serve`` on one GPU (NCCL weight transfer, a ``keep``
  server: no prefix caching, one sequence at a time so that a generation outlasts a step's update) and ``parityrl
  train`` in server mode on the other, ``recipes/grpo_tiny.yaml`` for 5 steps at k = 2 with ``rollout.in_flight:
  keep``: every sync pauses the server, pushes over NCCL and resumes it (rollout/server_engine/in_flight.py). Pass:
  exit 0; ``parity/mae`` below 1e-2 every step, each token against its own version's forward (bf16 numerics); and at
  least one batch holding tokens of two versions, the proof that a push landed inside a generation (without one the
  row measured nothing in flight). Printed: per step the lag shares, parity/mae, the share of tokens over older KV
  and their mae apart (``parity/stale_kv/*``), and the sync time.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

from gpu_rows_common import need_vllm_cuda, tail, train
from gpu_rows_server import need_server_gpus, train_on_nccl_server

LAGS = [0.0, 1.0, 2.0, 3.0, 3.0]
PARITY_BOUND = 1e-2  # bf16 numerics on the tiny model: the other CUDA rows' bound
# the recipe for the in-flight row, on both sides: the server's prefix caching off (keep) and one sequence at a time
IN_FLIGHT = ["rollout.mode=server", "rollout.max_staleness=2", "rollout.in_flight=keep", "rollout.lora_sync=merged",
             "rollout.max_num_seqs=1"]


def _fmt(values) -> str:
    return ", ".join(f"{v:.2e}" for v in values)


def staleness_row(tiny) -> str:
    need_vllm_cuda()
    with tempfile.TemporaryDirectory(prefix="gpu_check_staleness_") as tmp:
        proc, rows = train("grpo_tiny.yaml", [f"model.path={tiny()}", "train.steps=5", "eval.every=0",
                                              "rollout.max_staleness=3", "algorithm.off_policy=m2po", "name=stale"],
                           Path(tmp), cap_s=300)
        timeline = (Path(tmp) / "stale" / "timeline.png").is_file()
    if proc.returncode != 0 or len(rows) < 5:
        raise AssertionError(f"exit {proc.returncode}, {len(rows)}/5 steps: {tail(proc)}")
    lags = [r.get("staleness/lag", math.nan) for r in rows]
    parity = [r.get("parity/mae", math.nan) for r in rows]
    stale = [r.get("staleness/mae", math.nan) for r in rows]
    kl = [r.get("staleness/kl_k3", math.nan) for r in rows]
    masked = [r.get("staleness/m2po_masked_frac", math.nan) for r in rows[1:]]
    figure = (f"tiny model, k = 3, m2po, 5 steps: lags {lags}; parity/mae {_fmt(parity)}; staleness/mae {_fmt(stale)}; "
              f"m2po masked {_fmt(masked)}; timeline.png {'written' if timeline else 'missing'}")
    if lags != LAGS or not all(p < PARITY_BOUND for p in parity) or not all(k > 0 for k in kl[1:]) \
            or any(math.isnan(x) for x in masked) or not timeline:
        raise AssertionError(f"{figure}; expected lags {LAGS}, parity/mae < 1e-2, staleness/kl_k3 > 0 from step 2, "
                             "the m2po metrics from step 2 and the timeline")
    return figure


def _lag_shares(row: dict) -> dict[int, float]:
    """The batch's share of sampled tokens at each lag (``staleness/lag_<j>/share``), those above 0."""
    out = {}
    for key, value in row.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "staleness" and parts[1].startswith("lag_") and parts[2] == "share":
            if parts[1][4:].isdigit() and value > 0:
                out[int(parts[1][4:])] = value
    return dict(sorted(out.items()))


def in_flight_row(dense_dir) -> str:
    need_server_gpus()
    rows, _, _ = train_on_nccl_server(f"model.path={dense_dir()}", IN_FLIGHT, [*IN_FLIGHT, "name=in_flight"], 5,
                                      "gpu_check_in_flight_")
    shares = [_lag_shares(r) for r in rows]
    parity = [r.get("parity/mae", math.nan) for r in rows]
    stale_share = [r.get("parity/stale_kv/share", math.nan) for r in rows]
    stale_mae = [r.get("parity/stale_kv/mae", math.nan) for r in rows]
    sync = [r.get("perf/sync_s", math.nan) for r in rows]
    steps = "; ".join(
        f"step {r['step']}: lags {' '.join(f'{j}:{v:.0%}' for j, v in sh.items()) or '-'}, parity/mae {p:.2e}, "
        f"stale-KV {ss:.1%} (mae {sm:.2e}), sync {t:.2f} s"
        for r, sh, p, ss, sm, t in zip(rows, shares, parity, stale_share, stale_mae, sync))
    figure = f"tiny model, k = 2, keep, NCCL: {steps}"
    if not all(p < PARITY_BOUND for p in parity):
        raise AssertionError(f"{figure}; expected parity/mae < {PARITY_BOUND} every step")
    if not any(len(sh) >= 2 for sh in shares):
        raise AssertionError(f"{figure}; no batch held tokens of two versions: no push landed inside a generation, "
                             "so nothing in flight was measured")
    return figure
