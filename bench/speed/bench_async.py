"""Serial vs one-step-off-policy rollouts in server mode, in one invocation: step time, tokens/s, reward, parity, staleness.

    PYTHONPATH=. python bench/speed/bench_async.py --steps 30

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
    args = p.parse_args()
    n = os.cpu_count() or 2
    server_core, trainer_cores = str(n - 1), f"0-{max(n - 2, 0)}"
    url = f"http://127.0.0.1:{_free_port()}"
    work = Path(tempfile.mkdtemp(prefix="bench_async-"))
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "WANDB_MODE": "disabled"}
    log = open(work / "server.log", "w")
    server = subprocess.Popen(
        _pin(server_core) + [sys.executable, "-m", "trainer.cli", "serve", args.recipe, "--set",
                             f"rollout.server_url={url}"] + [a for s in args.overrides for a in ("--set", s)],
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
        for staleness in (0, 1):
            run_dir = work / f"staleness{staleness}"
            sets = ["rollout.mode=server", f"rollout.server_url={url}", f"rollout.max_staleness={staleness}",
                    f"train.steps={args.steps}", f"logging.run_dir={run_dir}", "logging.wandb.mode=disabled",
                    "checkpoint.every=0", f"name=bench-async-{staleness}", *args.overrides]
            # as many torch threads as the trainer's cores (more would oversubscribe them)
            subprocess.run(_pin(trainer_cores) + [sys.executable, "-m", "trainer.cli", "train", args.recipe]
                           + [a for s in sets for a in ("--set", s)], check=True, stdout=subprocess.DEVNULL,
                           env={**env, "OMP_NUM_THREADS": str(max(n - 1, 1))})
            hist[staleness] = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                               if "perf/step_s" in r]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    print(f"{args.recipe} {' '.join(args.overrides)}: server on core {server_core}, trainer on {trainer_cores}; "
          f"means over steps 2..{args.steps}")
    print(f"{'':<28}{'serial':>12}{'async':>12}{'async/serial':>14}")
    for k in KEYS:
        a = statistics.mean(r.get(k, 0.0) for r in hist[0][1:])
        b = statistics.mean(r.get(k, 0.0) for r in hist[1][1:])
        print(f"{k:<28}{a:>12.3f}{b:>12.3f}{b / a if a else float('nan'):>14.2f}")
    for s, h in hist.items():
        r = [x["reward/mean"] for x in h]
        print(f"staleness {s}: reward first 5 {statistics.mean(r[:5]):.3f} last 5 {statistics.mean(r[-5:]):.3f}; "
              f"parity/mae mean {statistics.mean(x['parity/mae'] for x in h):.2e}; "
              f"staleness/mae mean {statistics.mean(x['staleness/mae'] for x in h):.2e}")


if __name__ == "__main__":
    main()
