"""The MoE engine's cases (moe_engine_cases.py: routes from vLLM, replay in training, compare) in a pytest process
of their own: vLLM's parallel groups are process-wide and made by the first engine, and the session's dense
engine leaves out the expert-parallel group an MoE engine needs."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CASES = Path(__file__).resolve().parent / "moe_engine_cases.py"


@pytest.mark.slow
def test_the_moe_engine_cases_pass_in_their_own_process():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:logging", str(CASES)], cwd=REPO,
                          capture_output=True, text=True, timeout=1500)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]


@pytest.mark.slow
def test_an_moe_engine_beside_a_dense_one_is_refused_with_what_to_do(vllm_engine):
    from rollout.vllm_engine import VLLMEngine
    from trainer.builtin.zoo import ensure_arch_model

    with pytest.raises(RuntimeError, match="cannot start in a process that holds a dense model's vLLM engine"):
        VLLMEngine(ensure_arch_model("qwen3_moe", dtype="bfloat16"), max_model_len=64)
