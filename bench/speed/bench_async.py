"""Serial vs off-policy rollouts in server mode, in one invocation: step time, tokens/s, reward, parity, staleness.

    PYTHONPATH=. python bench/speed/bench_async.py --steps 30
    PYTHONPATH=. python bench/speed/bench_async.py --runs 0 1 2 1:keep 2:keep 2:recompute

``--runs``: each run's ``rollout.max_staleness`` k, with ``:keep`` or ``:recompute`` for ``rollout.in_flight``
(the syncs push into the running generation). With any in-flight run every run syncs merged weights (in-flight
needs them: the same sync for all), and with ``keep`` the one server runs without prefix caching for all of them.

Starts one vLLM server (`parityrl serve`) bound to the last core (``VLLM_CPU_OMP_THREADS_BIND``)
and runs the recipe twice against it from a trainer bound to the other cores (``taskset``):
``rollout.max_staleness`` 0 (generate, then train) and 1 (the server generates the next batch
while the trainer trains). Each run re-syncs the server to its own policy at start. Means over
steps 2..N (step 1 has no batch to overlap with); reward as first-5 / last-5 means.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KEYS = ["perf/step_s", "perf/rollout_s", "perf/train_s", "perf/prefetch_wait_s", "perf/sync_s",
        "perf/rollout_tokens_per_s"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pin(cores: str) -> list[str]:
    return ["taskset", "-c", cores] if shutil.which("taskset") else []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="recipes/grpo_tiny.yaml")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--runs", nargs="+", default=["0", "1"], help="k or k:keep / k:recompute, one per run")
    args = p.parse_args()
    runs = [(int(r.split(":")[0]), r.split(":")[1] if ":" in r else "off") for r in args.runs]
    if runs[0] != (0, "off"):
        raise SystemExit("--runs: the first run is the serial baseline, 0")
    modes = {m for _, m in runs}
    if modes - {"off"}:
        args.overrides.append("rollout.lora_sync=merged")
    server_sets = ["rollout.mode=server", "rollout.max_staleness=1", "rollout.in_flight=keep"] if "keep" in modes else []
    n = os.cpu_count() or 2
    server_core, trainer_cores = str(n - 1), f"0-{max(n - 2, 0)}"
    url = f"http://127.0.0.1:{_free_port()}"
    work = Path(tempfile.mkdtemp(prefix="bench_async-"))
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "WANDB_MODE": "disabled"}
    log = open(work / "server.log", "w")
    server = subprocess.Popen(
        _pin(server_core) + [sys.executable, "-m", "trainer.cli", "serve", args.recipe, "--set",
                             f"rollout.server_url={url}"] + [a for s in [*args.overrides, *server_sets]
                                                             for a in ("--set", s)],
        env={**env, "VLLM_CPU_OMP_THREADS_BIND": server_core}, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True)
    try:
        import httpx

        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start; see {work / 'server.log'}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        hist = {}
        for staleness, mode in runs:
            name = f"k{staleness}" + ("" if mode == "off" else f"-{mode}")
            run_dir = work / name
            sets = ["rollout.mode=server", f"rollout.server_url={url}", f"rollout.max_staleness={staleness}",
                    f"rollout.in_flight={mode}", f"train.steps={args.steps}", f"logging.run_dir={run_dir}",
                    "logging.wandb.mode=disabled", "checkpoint.every=0", f"name=bench-async-{name}", *args.overrides]
            # as many torch threads as the trainer's cores (more would oversubscribe them)
            subprocess.run(_pin(trainer_cores) + [sys.executable, "-m", "trainer.cli", "train", args.recipe]
                           + [a for s in sets for a in ("--set", s)], check=True, stdout=subprocess.DEVNULL,
                           env={**env, "OMP_NUM_THREADS": str(max(n - 1, 1))})
            hist[name] = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                               if "perf/step_s" in r]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    print(f"{args.recipe} {' '.join(args.overrides)}: server on core {server_core}, trainer on {trainer_cores}; "
          f"means over steps 2..{args.steps}")
    names = list(hist)
    print(f"{'':<28}" + "".join(f"{n:>14}" for n in names) + "   (each / k0 for perf/step_s)")
    for k in KEYS:
        means = [statistics.mean(r.get(k, 0.0) for r in hist[n][1:]) for n in names]
        print(f"{k:<28}" + "".join(f"{v:>14.3f}" for v in means))
    base = statistics.mean(r["perf/step_s"] for r in hist[names[0]][1:])
    print(f"{'step time / serial':<28}" + "".join(
        f"{statistics.mean(r['perf/step_s'] for r in hist[n][1:]) / base:>14.2f}" for n in names))
    for n, h in hist.items():
        r = [x["reward/mean"] for x in h]
        stale = [x["parity/stale_kv/share"] for x in h if "parity/stale_kv/share" in x]
        lag = [x["staleness/lag_mean"] for x in h if "staleness/lag_mean" in x]
        print(f"{n}: reward first 5 {statistics.mean(r[:5]):.3f} last 5 {statistics.mean(r[-5:]):.3f}; "
              f"parity/mae mean {statistics.mean(x['parity/mae'] for x in h):.2e} max "
              f"{max(x['parity/mae'] for x in h):.2e}; staleness/mae mean "
              f"{statistics.mean(x['staleness/mae'] for x in h):.2e}"
              + (f"; lag_mean {statistics.mean(lag):.2f}" if lag else "")
              + (f"; stale-KV share {statistics.mean(stale):.3f}" if stale else ""))


if __name__ == "__main__":
    main()
