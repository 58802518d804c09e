"""Rows of bench/gpu/gpu_check.py that train (``parityrl train`` in a subprocess, vLLM's CUDA build; issue 44 items 3, 7).

- ``routes_row``: ``recipes/grpo_tiny.yaml`` for 2 steps on a small random Qwen3-MoE (the zoo's, 128-divisible
  sizes) with ``parity.routing_replay: on`` and ``parity.unreplayed_every: 1``: the colocated engine returns routes
  through vLLM's own capture (prefix caching on). Pass: exit 0, both steps logged, ``parity/routing_unrouted`` 0
  every step (every routed position came back), ``parity/routing_agree`` above 0.9.
- ``sleep_training_row``: the same recipe for 2 steps on the Qwen2.5-0.5B-shaped model, ``rollout.sleep_mode`` true
  and false (eager, so the two engines start alike). Pass: both exit 0; every step's ``rollout/*`` and ``reward/*``
  metrics and the samples table's completions identical, parity/mae within 1e-6; the peak memory
  (``perf/peak_memory_gb``) with sleep no higher than without (1% slack), both printed.
- ``demo_hf_row`` (CUDA; no vLLM needed): the demo's recipe, ``recipes/grpo_tools_tiny.yaml``, for 4 steps with
  ``rollout.engine=hf`` and a held-out evaluation every 2. Pass: exit 0, 4 steps, no update skipped for a
  non-finite gradient (``train/skipped_updates`` 0) and the probe finite every step: the case bench/RESULTS.md
  "On an H200" leaves open (the trainer's log-probs NaN after update 3 on CUDA, clean on CPU).
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from gpu_rows_common import KV_BYTES, need_cuda, need_vllm_cuda, tail, train

AGREE_FLOOR = 0.9


def _fmt(values, spec: str = ".2e") -> str:
    return ", ".join(format(v, spec) for v in values)


def routes_row(moe_dir) -> str:
    need_vllm_cuda()
    with tempfile.TemporaryDirectory(prefix="gpu_check_routes_") as tmp:
        proc, rows = train("grpo_tiny.yaml", [f"model.path={moe_dir()}", "train.steps=2", "eval.every=0",
                                              "parity.routing_replay=on", "parity.unreplayed_every=1"],
                           Path(tmp), cap_s=420)
    if proc.returncode != 0 or len(rows) < 2:
        raise AssertionError(f"exit {proc.returncode}, {len(rows)}/2 steps: {tail(proc)}")
    unrouted = [r.get("parity/routing_unrouted", math.nan) for r in rows]
    agree = [r.get("parity/routing_agree", math.nan) for r in rows]
    replayed = [r.get("parity/mae", math.nan) for r in rows]
    unreplayed = [r.get("parity/unreplayed/mae", math.nan) for r in rows]
    figure = (f"Qwen3-MoE (8 experts, top 2), 2 steps: routing_unrouted {unrouted}, routing_agree {_fmt(agree, '.4f')}; "
              f"parity/mae {_fmt(replayed)} with replay, {_fmt(unreplayed)} without")
    if any(u != 0 for u in unrouted) or not all(a > AGREE_FLOOR for a in agree):
        raise AssertionError(f"{figure}; expected routing_unrouted 0 and routing_agree > {AGREE_FLOOR}")
    return figure


def _samples(run_root: Path) -> list[tuple]:
    return [(r["step"], r.get("completion"), r.get("length"))
            for path in sorted(run_root.glob("*/samples.jsonl")) for r in map(json.loads, path.read_text().splitlines())]


def sleep_training_row(shaped) -> str:
    need_vllm_cuda()
    runs = {}
    with tempfile.TemporaryDirectory(prefix="gpu_check_sleep_") as tmp:
        for sleep in (True, False):
            root = Path(tmp) / f"sleep_{sleep}"
            proc, rows = train("grpo_tiny.yaml", [f"model.path={shaped()}", "train.steps=2", "eval.every=0",
                                                  f"rollout.sleep_mode={str(sleep).lower()}", "rollout.enforce_eager=true",
                                                  f"rollout.kv_cache_memory_bytes={KV_BYTES}", "logging.samples_every=1"],
                               root, cap_s=420)
            if proc.returncode != 0 or len(rows) < 2:
                raise AssertionError(f"sleep_mode {sleep}: exit {proc.returncode}, {len(rows)}/2 steps: {tail(proc)}")
            runs[sleep] = (rows, _samples(root))
    (on, on_samples), (off, off_samples) = runs[True], runs[False]
    bad = []
    for a, b in zip(on, off):
        keys = sorted(k for k in set(a) | set(b) if k.startswith(("rollout/", "reward/")))
        diff = [k for k in keys if a.get(k) != b.get(k)]
        if diff:
            bad.append(f"step {a['step']}: {diff[:4]} differ")
        if not abs(a.get("parity/mae", math.nan) - b.get("parity/mae", math.nan)) <= 1e-6:
            bad.append(f"step {a['step']}: parity/mae {a.get('parity/mae')} vs {b.get('parity/mae')}")
    if on_samples != off_samples or not on_samples:
        bad.append(f"the samples tables differ ({len(on_samples)} vs {len(off_samples)} rows)")
    peak_on = max(r.get("perf/peak_memory_gb") or 0.0 for r in on)
    peak_off = max(r.get("perf/peak_memory_gb") or 0.0 for r in off)
    if peak_on > 1.01 * peak_off:
        bad.append("the peak with sleep is higher")
    sync_s = _fmt([r.get("perf/sync_s", math.nan) for r in on], ".2f")
    figure = (f"Qwen2.5-0.5B shape, 2 steps with and without sleep mode: samples and rollout/reward metrics "
              f"{'identical' if not bad else 'compared'}; perf/peak_memory_gb {peak_on:.2f} with sleep, "
              f"{peak_off:.2f} without; perf/sync_s {sync_s} with sleep")
    if bad:
        raise AssertionError(f"{figure}: " + "; ".join(bad[:4]))
    return figure


def demo_hf_row() -> str:
    need_cuda()
    steps = 4
    with tempfile.TemporaryDirectory(prefix="gpu_check_demo_hf_") as tmp:
        proc, rows = train("grpo_tools_tiny.yaml", ["rollout.engine=hf", f"train.steps={steps}", "eval.every=2"],
                           Path(tmp), cap_s=300)
    skipped = [r["step"] for r in rows if (r.get("train/skipped_updates") or 0) > 0]
    probe = [r.get("probe/mae", math.nan) for r in rows]
    figure = (f"{len(rows)}/{steps} steps, probe/mae {_fmt(probe)}, updates skipped at steps {skipped or 'none'}, "
              f"reward {_fmt([r.get('reward/mean', math.nan) for r in rows], '.3f')}")
    if proc.returncode != 0 or len(rows) < steps or skipped or not all(math.isfinite(p) for p in probe):
        raise AssertionError(f"exit {proc.returncode}, {figure}: {tail(proc)}")
    return figure
