"""Rows of bench/gpu/gpu_check.py for off-policy rollouts on CUDA (issue 58): ``rollout.max_staleness`` k = 3 with
the colocated vLLM engine, where prefix caching is live (16-token KV blocks, unlike the CPU engine's 128) and the
stale-KV alarm (rollout/stale_kv.py) checks every update.

- ``staleness_row``: ``recipes/grpo_tiny.yaml`` for 5 steps on the tiny model, k = 3, ``algorithm.off_policy:
  m2po``. Pass: exit 0 (no stale-KV alarm), ``staleness/lag`` 0, 1, 2, 3, 3; ``parity/mae`` below 1e-2 every step
  (bf16 numerics) and ``staleness/kl_k3`` > 0 from step 2; the M2PO metrics logged from step 2; ``timeline.png``
  written. Printed: parity/mae and staleness/mae by lag.
"""
from __future__ import annotations

import math
import tempfile
from pathlib import Path

from gpu_rows_common import need_vllm_cuda, tail, train

LAGS = [0.0, 1.0, 2.0, 3.0, 3.0]


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
    if lags != LAGS or not all(p < 1e-2 for p in parity) or not all(k > 0 for k in kl[1:]) \
            or any(math.isnan(x) for x in masked) or not timeline:
        raise AssertionError(f"{figure}; expected lags {LAGS}, parity/mae < 1e-2, staleness/kl_k3 > 0 from step 2, "
                             "the m2po metrics from step 2 and the timeline")
    return figure
