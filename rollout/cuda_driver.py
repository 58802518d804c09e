"""A CUDA build of torch that reaches no GPU on a machine where vLLM sees NVIDIA GPUs.

torch decides with the CUDA runtime (``torch.cuda.is_available()``: False when the driver is older than the runtime
the wheel was built for), vLLM with NVML (``vllm/platforms/__init__.py``, ``cuda_platform_plugin``: any NVIDIA GPU
the driver lists, whatever its version). With a driver too old for the wheels' CUDA, vLLM starts its CUDA platform
while every ``torch.cuda.is_available()`` branch of parityrl takes its CPU side (the CPU memory rule, CPU-only
recipes allowed): a run that fails late, or worse, half runs. ``unusable_cuda_problem`` says so up front.

Minimum Linux driver per CUDA major version (NVIDIA's CUDA Toolkit release notes, "Minimum Required Driver Version
for CUDA Minor Version Compatibility"): CUDA 12.x needs >= 525, CUDA 13.x >= 580.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

MIN_DRIVER = {12: 525, 13: 580}


def vllm_sees_nvidia_gpus() -> bool:
    """vLLM's own platform check: would it start its CUDA platform here? False without vLLM."""
    try:
        from vllm.platforms import cuda_platform_plugin  # late: vLLM takes seconds to load; asked only on failure
    except ImportError:
        return False
    return cuda_platform_plugin() is not None


def nvidia_driver() -> tuple[Optional[int], Optional[str], Optional[str]]:
    """(GPUs, driver version, highest CUDA version the driver runs) from NVML; None where NVML cannot say."""
    try:
        try:
            from vllm.utils.import_utils import import_pynvml  # late: as above

            nvml = import_pynvml()
        except ImportError:  # no vLLM: nvidia-ml-py itself (what vLLM's import_pynvml returns)
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: nothing to report
        return None, None, None
    try:
        def ask(fn):
            try:
                value = fn()
            except Exception:  # noqa: BLE001 - an NVML call this driver lacks
                return None
            return value.decode() if isinstance(value, bytes) else value

        count = ask(nvml.nvmlDeviceGetCount)
        driver = ask(nvml.nvmlSystemGetDriverVersion)
        cuda = ask(nvml.nvmlSystemGetCudaDriverVersion_v2)  # e.g. 12040 for 12.4
        return count, driver, (None if cuda is None else f"{cuda // 1000}.{cuda % 1000 // 10}")
    finally:
        nvml.nvmlShutdown()


def unusable_cuda_problem() -> Optional[str]:
    """What is wrong when torch is built for CUDA, finds no GPU, and vLLM sees NVIDIA GPUs; None otherwise."""
    if torch.version.cuda is None or torch.cuda.is_available() or not vllm_sees_nvidia_gpus():
        return None
    count, driver, supports = nvidia_driver()
    built = torch.version.cuda
    major = int(built.split(".")[0])
    head = (f"torch {torch.__version__} is built for CUDA {built} but finds no usable GPU (torch.cuda.is_available() "
            f"is False), while vLLM's platform check sees {count if count is not None else 'the'} NVIDIA GPU(s) "
            f"(NVML: driver {driver or 'version unknown'}"
            + (f", which runs CUDA up to {supports}" if supports else "") + "); parityrl would take its CPU paths "
            "on a GPU machine")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return (f"{head}. CUDA_VISIBLE_DEVICES={visible!r} hides every GPU from torch (not from NVML): unset it to "
                "train on the GPUs, or install the CPU build (make setup TARGET=cpu) to train on the CPU")
    need = MIN_DRIVER.get(major)
    if supports is not None and _version(supports) >= _version(built):
        return (f"{head}. The driver runs CUDA {built}, so it is not too old: the GPUs are not reachable from this "
                "process (a container started without GPU access, or a driver updated without a reboot: "
                "nvidia-smi says which)")
    return (f"{head}. The driver is too old for CUDA {built}: the CUDA {major} wheels need driver >= "
            + (f"{need}" if need else f"one that runs CUDA {built}")
            + f". Update the NVIDIA driver, or install torch and vLLM built for CUDA {supports or 'your driver runs'}")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:2])
