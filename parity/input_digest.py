"""One definition of a model input's fingerprint, computed by the engine over what it consumed and by the trainer over
what it scores with: a SHA-256 of the tensor's dtype and bytes.

Two sides that compare fingerprints compare the tensors exactly (a bit anywhere changes it) at the cost of one
pass over the bytes; shape is left out so that one image's pixels hash alike whether a side holds them as
[3, H, W] or as a batch of one [1, 3, H, W]: its values in order are the same.
"""
from __future__ import annotations

import hashlib

import torch


def tensor_digest(t: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """Hex SHA-256 of ``t`` (cast to ``dtype`` first, when given): its dtype's name, then its values' bytes in
    row-major order."""
    if dtype is not None:
        t = t.to(dtype)
    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(str(t.dtype).encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
