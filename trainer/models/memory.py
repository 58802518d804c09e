"""``perf/peak_memory_gb``: the most memory this process has held so far, in GiB (2**30 bytes).

On CUDA: ``torch.cuda.max_memory_allocated`` of the training device, the peak of the tensors
torch's caching allocator handed out (a colocated vLLM engine allocates through it too; the
allocator's cached-but-free blocks and the CUDA context are not counted: ``nvidia-smi`` shows
more). On the CPU: the process's peak resident set size (``resource.getrusage(RUSAGE_SELF).ru_maxrss``),
everything the process ever held in RAM at once: the Python runtime, the model, the engine's KV
cache, activations. Neither is reset between steps: the value at step N is the run's peak up to N
(as verl's ``perf/max_memory_allocated_gb``), so the last step's value is the run's.
"""
from __future__ import annotations

import resource
import sys

import torch

GIB = 2**30
# How the figure is measured, for the run's summary line.
PEAK_MEMORY_NOTE = "CUDA: torch.cuda.max_memory_allocated; CPU: the process's peak RSS"


def peak_memory_gb(device: torch.device | str = "cpu") -> float:
    """The process's peak memory so far on ``device``'s kind (module docstring), in GiB."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in KiB on Linux, in bytes on macOS (getrusage(2) of each)
    return rss / GIB if sys.platform == "darwin" else rss * 1024 / GIB
