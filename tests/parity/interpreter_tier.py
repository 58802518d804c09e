"""Runs a test file of Triton kernels under Triton's CPU interpreter, in a fresh process.

``TRITON_INTERPRET=1`` must be set before the kernels are defined (``@triton.jit`` reads it then),
so those files skip themselves in this session and run here in a child pytest.
"""
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_interpreter_tier(test_file: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / test_file)]
    out = subprocess.run(cmd, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=600)
    tail = (out.stdout + out.stderr)[-6000:]
    assert out.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail, tail
