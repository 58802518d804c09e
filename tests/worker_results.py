"""A test's worker script run in a process of its own (a second engine beside the session's, tests/conftest.py), and
what it printed: one ``RESULT <json>`` line per run, each naming its run."""
import json
import os
import subprocess
import sys
from pathlib import Path


def worker_results(script: Path, root: Path, timeout: int) -> dict[str, dict]:
    """``python script root`` with the checkout importable; its results by run name (the worker's exit status must
    be 0, else the assertion shows the tail of its output)."""
    proc = subprocess.run([sys.executable, str(script), str(root)], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {r["run"]: r for r in (json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT "))}
