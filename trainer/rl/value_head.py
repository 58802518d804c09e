"""PPO's critic: a scalar value head on the policy's own last hidden states (shared trunk).

Choice: one trunk, two heads -- the LoRA policy's final hidden state h_t feeds both the
lm_head (log-probs) and a float32 ``Linear(H, 1)`` (values), as in the StackLLaMA
write-up (TRL's ``AutoModelForCausalLMWithValueHead``) and Ziegler et al. (arXiv 1909.08593).
Why not a separate critic adapter: with a frozen base, a second adapter means a second
forward over every token (the base cannot be shared between two adapters in one pass),
doubling the trainer's compute for the one number per token PPO needs. The cost of
sharing: the value loss's gradient also moves the policy's LoRA weights, so ``vf_coef``
(TRL's 0.1 by default) keeps it from dominating the policy gradient; set it to 0 to
see the policy alone. The weight sync is unaffected: the head is not part of the model
the engine runs.

V(s_t) is read at the hidden state that predicts completion token t, i.e. the state
before emitting it. Zero-initialised, so every value starts at 0 and the first
advantages are the (whitened) returns themselves.
"""
from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    """V = h W^T + b in float32 (the trunk's bf16 hidden states are upcast first)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> values [...] (float32)."""
        return self.linear(hidden.float()).squeeze(-1)
