"""rollout.cuda_driver and preflight's check: a CUDA build of torch that reaches no GPU where vLLM sees NVIDIA GPUs.

On CPU: torch.version.cuda and torch.cuda.is_available are monkeypatched; vLLM's own platform check
(``vllm.platforms.cuda_platform_plugin``) runs as it is, on a fake NVML, with the CPU wheel's "built for CPU" test
switched off (it would rule CUDA out here whatever NVML says).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rollout.cuda_driver import unusable_cuda_problem
from trainer.lifecycle.preflight import inspect_recipe

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "grpo_tiny.yaml"


def fake_host(monkeypatch, *, built="13.0", available=False, gpus=8, driver="550.54.15", cuda=12040):
    import vllm.platforms
    import vllm.utils.import_utils

    nvml = SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: gpus,
                           nvmlSystemGetDriverVersion=lambda: driver, nvmlSystemGetCudaDriverVersion_v2=lambda: cuda)
    monkeypatch.setattr(vllm.utils.import_utils, "import_pynvml", lambda: nvml)
    monkeypatch.setattr(vllm.platforms, "vllm_version_matches_substr", lambda substr: False)  # a CUDA wheel of vLLM
    monkeypatch.setattr(torch.version, "cuda", built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_a_driver_too_old_for_the_wheels_cuda_is_named(monkeypatch):
    fake_host(monkeypatch)
    problem = unusable_cuda_problem()
    assert "is built for CUDA 13.0 but finds no usable GPU (torch.cuda.is_available() is False)" in problem
    assert "sees 8 NVIDIA GPU(s) (NVML: driver 550.54.15, which runs CUDA up to 12.4)" in problem
    assert "The driver is too old for CUDA 13.0: the CUDA 13 wheels need driver >= 580" in problem
    assert problem.endswith("install torch and vLLM built for CUDA 12.4")


def test_preflight_refuses_it_with_the_recipe(monkeypatch):
    fake_host(monkeypatch, built="12.8", cuda=12020, driver="535.104.05")
    _, lines = inspect_recipe(RECIPE, model=False)
    (line,) = [line for line in lines if "NVIDIA" in line] or [lines]
    assert line.startswith(f"{RECIPE}: torch ") and "the CUDA 12 wheels need driver >= 525" in line, line


def test_gpus_hidden_on_purpose_or_unreachable_are_not_blamed_on_the_driver(monkeypatch):
    fake_host(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES='' hides every GPU from torch (not from NVML)" in unusable_cuda_problem()
    fake_host(monkeypatch, cuda=13000, driver="580.65.06")
    assert "so it is not too old: the GPUs are not reachable from this process" in unusable_cuda_problem()


@pytest.mark.parametrize("case", [dict(built=None), dict(available=True), dict(gpus=0)])
def test_nothing_to_refuse(monkeypatch, case):
    """A CPU build of torch, a GPU torch reaches, a machine without NVIDIA GPUs."""
    fake_host(monkeypatch, **case)
    assert unusable_cuda_problem() is None
