"""The exact-mode tier (tests/trainer/rl/exact_tier.py) in a process of its own.

Its tests start and close their own in-process vLLM engines (exact mode's, the architecture matrix's);
closing one tears down vLLM's process-global parallel state, which the test session's shared tiny-model
engine (tests/conftest.py) also uses. So the tier runs in a separate pytest process and this test reports it.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_exact_tier():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(__file__).with_name("exact_tier.py"))],
                          cwd=REPO, env={**os.environ}, capture_output=True, text=True, timeout=1800)
    tail = (proc.stdout + proc.stderr)[-6000:]
    print(tail)
    assert proc.returncode == 0, tail
