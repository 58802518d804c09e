"""The real-model tier (tests/trainer/commands/realmodel_tier.py) in a process of its own.

Its engines are in-process vLLM engines; closing one tears down vLLM's process-global parallel
state, which the test session's shared tiny-model engine (tests/conftest.py) also uses. So the
tier runs in a separate pytest process and this test reports its result.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_real_model_tier():
    pytest.importorskip("gguf", reason="the realmodel extra (make setup installs it)")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(Path(__file__).with_name("realmodel_tier.py"))],
                          cwd=REPO, env={**os.environ}, capture_output=True, text=True, timeout=3000)
    tail = (proc.stdout + proc.stderr)[-6000:]
    print(tail)
    assert proc.returncode == 0, tail
