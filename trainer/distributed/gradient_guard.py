"""A gradient that is not finite never reaches the weights: its update is skipped and said, naming the parameters.

AdamW given one NaN gradient writes NaN into the moments and the weights it touches, and the policy is lost for the
rest of the run; what shows it is whatever reads the weights next (the probe's "log-probs are not finite" one step
later, naming no cause). So before the clip, every trainable parameter's gradient is checked (one device sync for
all of them); where any is not finite the optimizer does not step, the gradients are dropped, and the console says
which step and which parameters (their names point at the layer, and the adapter side, where it began). The step's
``train/grad_norm`` is then NaN or inf and ``train/skipped_updates`` counts it; the run's summary counts such steps
(``trainer/lifecycle/run_health.py``), so a run that skipped its updates does not pass for one that learned.

Skipped rather than stopped: one batch's overflow should not end a long run, and verl's actor does the same
(``verl/workers/actor/dp_actor.py``: "grad_norm is not finite ... skip"). Under DeepSpeed the engine clips and
steps inside ``engine.step()``; its norm is reported after the fact, and a non-finite one is said there, not
skipped (``trainer/distributed/deepspeed.py``).
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

NAMES_SHOWN = 4


def nonfinite_gradients(named: Iterable[tuple[str, nn.Parameter]]) -> list[str]:
    """The names of the parameters whose gradient holds a NaN or an infinity ([] when all are finite)."""
    with_grad = [(n, p.grad) for n, p in named if p.grad is not None]
    if not with_grad:
        return []
    flags = torch.stack([torch.isfinite(g).all().to(with_grad[0][1].device) for _, g in with_grad])
    if bool(flags.all()):  # the one sync: almost every step ends here
        return []
    return [n for (n, _), ok in zip(with_grad, flags.tolist()) if not ok]


def skipped_update_message(names: list[str], norm: Optional[float], step: Optional[int] = None) -> str:
    where = f"step {step}: " if step is not None else ""
    shown = ", ".join(names[:NAMES_SHOWN]) + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN
                                              else "")
    return (f"warning: {where}the gradient is not finite (norm {norm}) in {len(names)} parameter(s): {shown}; "
            "this update was skipped and the weights are as before it (docs/troubleshooting.md, 'A gradient that "
            "is not finite')")
