"""Numerics shared by rollout and training: the fused log-prob kernel and the parity metrics.

``parity`` never imports ``trainer`` or ``rollout``: it is the neutral ground both trust.
"""

from parity.logprobs import fused_logprobs, naive_logprobs
from parity.metrics import compare

__all__ = ["fused_logprobs", "naive_logprobs", "compare"]
