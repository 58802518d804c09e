"""The AMX permission asked for when a CPU engine starts (rollout/cpu_amx.py): asked where the CPU has AMX tiles,
not elsewhere; and, where the host has AMX, a fresh bf16 engine's first prompt of one token does not kill it."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rollout import cpu_amx

REPO = Path(__file__).resolve().parents[2]


def test_nothing_is_asked_on_a_cpu_without_amx_tiles(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(1) or True)
    assert cpu_amx.request_amx_permission() is False and asked == []


def test_the_tiles_are_asked_for_where_the_cpu_has_them(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(1) or True)
    assert cpu_amx.request_amx_permission() is True and asked == [1]


FIRST_PROMPT_OF_ONE_TOKEN = textwrap.dedent("""
    import sys
    from rollout.types import SamplingSpec
    from rollout.vllm_engine import VLLMEngine
    engine = VLLMEngine(sys.argv[1], dtype="bfloat16", max_model_len=128, seed=0,
                        kv_cache_memory_bytes=64 * 1024**2, enforce_eager=True)
    out = engine.generate([[5]], SamplingSpec(n=1, temperature=1.0, max_new_tokens=4))
    print("generated", len(out.completion_ids[0]))
""")


@pytest.mark.slow
@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="the SIGILL this guards against needs a CPU with AMX tiles")
def test_a_fresh_bf16_engine_survives_a_first_prompt_of_one_token(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-c", FIRST_PROMPT_OF_ONE_TOKEN, tiny_model_dir], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and "generated" in proc.stdout, (proc.returncode, proc.stderr[-3000:])
