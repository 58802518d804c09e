"""The Triton backend module (``parity.logprobs_triton``), or None where triton does not import."""

from __future__ import annotations

try:
    from parity import logprobs_triton
except ImportError:  # triton is optional: without it every device uses the torch path
    logprobs_triton = None
