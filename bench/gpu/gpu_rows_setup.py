"""Rows of bench/gpu/gpu_check.py on the machine's setup: the interpreter (issue 44 item 4) and the CUDA driver (item 10).

- ``python_row``: ``scripts/check_python.py`` (what ``make setup`` runs first) accepts this interpreter. Runs on CPU too.
- ``driver_row``: what ``rollout.cuda_driver`` reads from NVML on a working GPU machine agrees with the machine:
  no problem reported (``unusable_cuda_problem``), the driver version nvidia-smi prints, torch's GPU count, a CUDA
  version at least torch's, and a driver at least ``MIN_DRIVER`` of torch's CUDA major (the refusal's threshold:
  a machine that runs must pass it).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import torch
from gpu_rows_common import REPO, Skip, need_cuda

from rollout.cuda_driver import MIN_DRIVER, nvidia_driver, unusable_cuda_problem


def python_row() -> str:
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "check_python.py")], capture_output=True, text=True,
                          timeout=60)
    have = ".".join(map(str, sys.version_info[:3]))
    if proc.returncode != 0:
        raise AssertionError(f"Python {have}: {proc.stderr.strip()[:300]}")
    return f"Python {have} ({sys.executable}) is within pyproject.toml's requires-python"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2])


def driver_row() -> str:
    need_cuda()
    problem = unusable_cuda_problem()
    count, driver, supports = nvidia_driver()
    if driver is None:
        raise Skip("NVML not readable here: rollout.cuda_driver reads it through vLLM or nvidia-ml-py (pip install "
                   "nvidia-ml-py)")
    bad = [] if problem is None else [f"unusable_cuda_problem(): {problem}"]
    smi = shutil.which("nvidia-smi")
    smi_driver = None
    if smi:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
        smi_driver = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None
        if smi_driver is not None and smi_driver != driver:
            bad.append(f"NVML's driver {driver} != nvidia-smi's {smi_driver}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None and count != torch.cuda.device_count():
        bad.append(f"NVML counts {count} GPUs, torch {torch.cuda.device_count()}")
    built = torch.version.cuda
    if supports is None or _version(supports) < _version(built):
        bad.append(f"the driver runs CUDA up to {supports}, torch is built for {built}")
    need = MIN_DRIVER.get(int(built.split(".")[0]))
    if need is not None and int(driver.split(".")[0]) < need:
        bad.append(f"driver {driver} is below MIN_DRIVER {need} for CUDA {built}, yet this machine runs")
    figure = (f"driver {driver} (nvidia-smi: {smi_driver or 'not found'}), {count} GPU(s) by NVML, "
              f"{torch.cuda.device_count()} by torch" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible else "")
              + f", CUDA up to {supports}, torch built for {built}")
    if bad:
        raise AssertionError(f"{figure}: " + "; ".join(bad))
    return f"{figure}; no problem reported"
