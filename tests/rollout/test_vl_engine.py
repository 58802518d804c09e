"""A vision-language model through the vLLM engine (slow tier): prompts with an image go to vLLM as token ids with one
placeholder and the image; vLLM expands the placeholder as Transformers' processor does, what it consumed (pixels,
spans) is what the trainer scores, and its log-probs match the trainer's float32 forward as closely with an image as
without (bench/parity/vl_parity.py in a subprocess: the session already holds an engine, tests/conftest.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
# the float32 goal is 2e-6 (1.3e-6 measured with an image, 1.1e-6 without, on a 2-core AMD EPYC); other
# CPUs' float32 kernels sum in other orders, hence the margin. A dropped or misplaced image moves them by ~1.
FLOAT32_MAE = 5e-6


def test_images_reach_the_engine_expanded_as_the_processor_does_and_match_transformers(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(REPO / "bench" / "parity" / "vl_parity.py"), "--dtypes", "float32", "--prompts", "2",
           "--tokens", "12", "--faults", "--json", str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    print(proc.stdout)
    (row,) = json.loads(out.read_text())
    # one placeholder became the image's 4 tokens between <fake_token_around_image><global-img> and a closing marker
    assert row["expanded_ids_equal"] and row["prompt_tokens_with_image"] == row["prompt_tokens_before_expansion"] + 6
    assert row["tokens_image"] >= 2 * 2 and row["tokens_text"] >= 2 * 2  # 2 prompts x 2 samples, each at least one
    assert row["mae_image"] < FLOAT32_MAE and row["mae_text"] < FLOAT32_MAE
    assert row["mae_image"] < 3 * row["mae_text"]  # an image costs no more parity than text
    # what the engine consumed is what the trainer scored: every image's pixels the same bits, every span in place
    assert row["mm/inputs_equal"] == 1.0 and row["mm/images"] == 2 * 2
    # and a difference is named: the trainer's processor at another size, the engine's request without its image
    assert row["faults"]["other_processor"][0].startswith("sample 0 (prompt 0), image 0: pixel tensors differ "
                                                          "(engine float32 [1, 3, 56, 56]")
    assert row["faults"]["image_dropped"] == ["sample 0 (prompt 0): the engine consumed 0 image(s), the trainer's "
                                              "prompt holds 1"]
