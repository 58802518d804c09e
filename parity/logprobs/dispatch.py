"""Which implementation runs: the Triton kernels on CUDA once they passed their check there, else the torch path."""

from __future__ import annotations

import warnings

import torch

from parity.logprobs.optional_triton import logprobs_triton
from parity.logprobs.self_check_process import isolated_self_check
from parity.logprobs.torch_path import _ChunkedLogProbs


def _backend_for(hidden: torch.Tensor):
    """The autograd Function implementing the kernel for ``hidden``'s device and dtype.

    CUDA tensors in a dtype the Triton kernels handle (not float64) go to
    ``parity.logprobs_triton.TritonLogProbs`` when triton imports and the kernels passed their
    check on that device and dtype (``_triton_ready``); everything else to the chunked torch
    implementation. Both take the same apply() arguments.
    """
    if (hidden.is_cuda and logprobs_triton is not None and logprobs_triton.supports(hidden.dtype)
            and _triton_ready(hidden.device, hidden.dtype)):
        return logprobs_triton.TritonLogProbs
    return _ChunkedLogProbs


# (device, dtype) -> None when the Triton kernels passed their self-check there, else why not
_TRITON_CHECKED: dict = {}
# (device, dtype) whose check ran out of memory: not a verdict on the kernels, so it is tried again on the next call
_TRITON_CHECK_OOM: set = set()



def _triton_ready(device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels may run on ``device`` in ``dtype``: checked once per process against the torch
    path. A kernel that does not compile for this GPU, or computes something else, would otherwise fail or
    mislead every step; then the torch path (correct, slower) runs instead, with one warning saying why.
    A check that ran out of memory decides nothing: this call takes the torch path and the next one checks again.
    The check runs in a child process (``self_check_process``): a kernel that faults on this GPU poisons the CUDA
    context it ran in, and the torch path could not run in that one either."""
    key = (str(device), dtype)
    if key not in _TRITON_CHECKED:
        outcome = isolated_self_check(device, dtype)
        if "oom" in outcome:
            if key not in _TRITON_CHECK_OOM:
                _TRITON_CHECK_OOM.add(key)
                warnings.warn(f"parity.logprobs: the Triton log-prob kernels' check on {device} in {dtype} ran out of "
                              f"memory ({outcome['oom']}); the chunked torch path runs until a later call can check "
                              "them", stacklevel=3)
            return False
        verdict = outcome["verdict"]
        _TRITON_CHECKED[key] = verdict
        if verdict is not None:
            warnings.warn(f"parity.logprobs: the Triton log-prob kernels failed their check on {device} in {dtype} "
                          f"({verdict}); the chunked torch path runs instead (same results, slower)",
                          stacklevel=3)
    return _TRITON_CHECKED[key] is None
