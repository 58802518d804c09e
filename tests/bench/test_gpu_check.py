"""bench/gpu/gpu_check.py on a machine without CUDA: runs what the CPU can, says what needs a GPU, exits 0."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
GPU = "needs a CUDA GPU"
VLLM = "needs a CUDA GPU and vLLM's CUDA build"
TWO_GPUS = "needs 2 CUDA GPUs (0 visible)"
# Issue 44's rows (items 1-11) and the reason each gives on a machine without CUDA.
ISSUE_44_ROWS = {
    "DP collectives, NCCL + gloo, 2 ranks": ("44.1", TWO_GPUS),
    "DP collectives, NCCL + gloo, 1 rank": ("44.1", GPU),
    "DP collectives under ZeRO-2, 2 ranks": ("44.1", TWO_GPUS),
    "DP collectives under ZeRO-2, 1 rank": ("44.1", GPU),
    "capacity check reads the rank's GPU": ("44.2", GPU),
    "each rank on its own GPU, 2 ranks (torch)": ("44.2", TWO_GPUS),
    "each rank's vLLM engine on its own GPU, 2 ranks": ("44.2", TWO_GPUS),
    "serve on CUDA refuses routes": ("44.3", GPU),
    "MoE routes from the colocated engine": ("44.3", VLLM),
    "FP8 act quantizer: CUDA, Triton = CPU": ("44.5", GPU),
    "FP8 act quantizer = vLLM's CUDA op": ("44.5", VLLM),
    "FP8 engine: every decoder linear on CUTLASS": ("44.5", VLLM),
    "FP8 engine: activation quantizer = ours": ("44.5", VLLM),
    "FP8 engine: weights read back after a sync = ours": ("44.5", VLLM),
    "colocated vLLM, precision fp8_rollout": ("44.5", VLLM),
    "colocated vLLM, precision fp8_unified": ("44.5", VLLM),
    "FP8 engine: Phi3, fused qkv/gate_up stay BF16": ("44.6", VLLM),
    "FP8 engine: OLMoE, router and experts stay BF16": ("44.6", VLLM),
    "vLLM's GPU memory >= the capacity rule's bound": ("44.7", VLLM),
    "sleep / wake around the trainer's update": ("44.7", VLLM),
    "sleep mode in training, on vs off": ("44.7", VLLM),
    "CUDA graphs: weights in place across a sync": ("44.8", VLLM),
    "CUDA graphs vs eager: generation speed": ("44.8", VLLM),
    "NCCL push waits for the trainer's stream": ("44.9", GPU),
    "server with NCCL weight transfer": ("44.9", TWO_GPUS),
    "CUDA driver as parityrl reads it": ("44.10", GPU),
    "serve on CUDA: server and trainer GPUs apart": ("44.11", GPU),
    "two engines at the default GPU share": ("44.11", VLLM),
    "float32 engine vs trainer (TF32 attention)": ("44.11", VLLM),
}
OLDER_GPU_ROWS = {"log-prob kernel speed": GPU, "FP8 GEMM verify": GPU, "FP8 GEMM speed": GPU,
                  "GRPO steps, HF engine": GPU, "gradient checkpointing memory": GPU,
                  "colocated vLLM, precision bf16": VLLM}


def _run(tmp_path, *args):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "gpu_check.py"), "--json", str(out), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour (on a GPU the check trains for minutes)")
def test_gpu_check_on_cpu_prints_one_table_and_skips_the_gpu_rows(tmp_path):
    proc, report = _run(tmp_path)
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("check ") for line in lines) == 1  # one table
    rows = {line.split("  ")[0].strip(): line for line in lines if "  " in line}
    assert "pass" in rows["device"] and "no CUDA device" in rows["device"]
    assert "pass" in rows["version torch"] and torch.__version__ in rows["version torch"]
    assert " pass " in rows["log-prob kernel accuracy"]
    assert " pass " in rows["python (make setup's check)"] and " 44.4 " in rows["python (make setup's check)"]
    for gpu_row, reason in OLDER_GPU_ROWS.items():
        assert " skipped " in rows[gpu_row] and reason in rows[gpu_row], rows[gpu_row]
    for row, (item, reason) in ISSUE_44_ROWS.items():
        assert row in rows, f"missing row {row!r}"
        assert f" {item} " in rows[row] and " skipped " in rows[row] and reason in rows[row], rows[row]
    assert "0 fail" in proc.stdout and "GiB" not in proc.stdout  # no GPU figure on a CPU
    # the JSON holds the same rows, finished, with the issue items 1-9 (and 10, 11) all covered
    assert report["finished"] is True and report["cuda"] is False and report["gpus"] == 0
    header = next(i for i, line in enumerate(lines) if line.startswith("check "))
    assert [r["check"] for r in report["rows"]] == [line.split("  ")[0].strip() for line in lines[header + 2:]
                                                    if "  " in line]
    by_name = {r["check"]: r for r in report["rows"]}
    for row, (item, reason) in ISSUE_44_ROWS.items():
        assert by_name[row]["item"] == item and by_name[row]["status"] == "skipped" and reason in by_name[row]["figure"]
    assert {f"44.{i}" for i in range(1, 12)} <= {r["item"] for r in report["rows"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour")
def test_only_runs_the_named_item(tmp_path):
    _, report = _run(tmp_path, "--only", "44.6", "--only", "driver")
    names = [r["check"] for r in report["rows"] if not r["check"].startswith(("device", "version "))]
    assert names == ["CUDA driver as parityrl reads it", "FP8 engine: Phi3, fused qkv/gate_up stay BF16",
                     "FP8 engine: OLMoE, router and experts stay BF16"]
