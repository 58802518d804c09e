"""The recipe's limits on the rollout/trainer mismatch (``parity.max_mae``, ``max_kl_k3``, ``max_mae_ratio``),
checked on a step's ``parity/*`` and on the probe's ``probe/*``: a warning, or with
``parity.on_violation: stop`` the run stops (``ParityLimitExceeded``, exit status 3).
"""
from __future__ import annotations

import warnings

from parity.guards import MaeRatioLimit, threshold_violations
from trainer.config import RunConfig
from trainer.lifecycle.stops import ParityLimitExceeded
from trainer.precision import recipe_for


def ratio_limit_for(cfg: RunConfig) -> MaeRatioLimit:
    """``parity.max_mae_ratio`` with the floor of the run's precision recipe and dtype (its record's ``mae_floor``)."""
    floor = recipe_for(cfg.precision.recipe).mae_floor[cfg.model.dtype]
    return MaeRatioLimit(cfg.parity.max_mae_ratio, floor.mae, judge_start=floor.any_depth,
                         floor_source=f"the {cfg.precision.recipe} recipe's {cfg.model.dtype}")


def enforce_parity_limits(cfg: RunConfig, step: int, m: dict, *, prefix: str = "parity/", when: str = "",
                          ratio: MaeRatioLimit | None = None, start: bool = False) -> None:
    """Warn about, or stop on, every limit the metrics ``m`` (keys under ``prefix``) break.

    ``start``: ``m`` is the probe before training (``MaeRatioLimit.violations``).
    """
    problems = threshold_violations(m, max_mae=cfg.parity.max_mae, max_kl_k3=cfg.parity.max_kl_k3, prefix=prefix)
    problems += ratio.violations(m, prefix, start=start) if ratio is not None else []
    if not problems:
        return
    msg = f"step {step}{when}: " + "; ".join(problems)
    if cfg.parity.on_violation == "stop":
        consequence = ("this step's update was not applied" if prefix == "parity/" else
                       "the engine disagrees with the trainer on the fixed probe prompts; no further rollout was made "
                       "with these weights")
        raise ParityLimitExceeded(f"{msg} (parity.on_violation: stop; {consequence})")
    warnings.warn(msg, stacklevel=2)
