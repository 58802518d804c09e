"""One record per algorithm: what the loop and the recipe validator need to know about it.

An algorithm is registered once, as an ``Algorithm`` (``registry.register_algorithm``), by the
module that defines its functions. The record holds:

- ``options``: a dataclass whose fields are the algorithm's own keys under the recipe's
  ``algorithm:`` section and whose defaults are its paper's (cited in the dataclass). The
  recipe loader parses those keys into it, so each algorithm has its own defaults and a key
  that belongs to another algorithm is refused naming the algorithms that have it. The options
  validate themselves (``__post_init__`` raising ``OptionError``), standalone or from a recipe.
- ``advantage`` / ``loss``: the pure functions (``registry`` documents their signatures); both
  receive the options object as ``cfg``.
- capabilities the loop asks for instead of the name: ``critic`` (a learned value head scored
  before the advantages exist), ``min_group_size`` (group-relative estimators need >= 2),
  ``dynamic_sampling`` (DAPO's filter keeps groups whose rewards differ: a group-relative
  criterion), ``token_weights`` (the loss accepts a weight and an advantage per token, not only one per
  sequence), ``teacher`` (the advantage is a teacher's per-token signal: the run needs ``teacher.path``). A
  reference policy is needed when the options' ``kl_coef`` is positive.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from trainer.algorithms.aggregation import AGG_MODES


class OptionError(ValueError):
    """An algorithm option out of range: names the option, its value and what was expected."""

    def __init__(self, owner: str, key: str, value: Any, expected: str, message: str | None = None) -> None:
        self.owner, self.key, self.value, self.expected = owner, key, value, expected
        super().__init__(message or f"{owner}.{key} must be {expected}, got {value!r}")


def check_options(options: Any, rules: Iterable[tuple[bool, str, str]]) -> None:
    """Raise ``OptionError`` for the first rule (ok, key, expected) that does not hold."""
    for ok, key, expected in rules:
        if not ok:
            raise OptionError(type(options).__name__, key, getattr(options, key), expected)


@dataclass(frozen=True)
class Algorithm:
    name: str
    options: type
    advantage: Callable[..., Any]
    loss: Callable[..., Any]
    paper: str  # where the method and its defaults come from
    critic: bool = False
    min_group_size: int = 2
    dynamic_sampling: bool = True
    # False: the loss weighs whole sequences, so its is_weights and advantages must be one value per sequence (RLOO,
    # PMD); a correction whose weights vary inside a sequence, and a per-token distillation term
    # (algorithm.distill_coef), are refused for it (trainer/config/validate.py).
    token_weights: bool = True
    # True: the advantage is the teacher's per-token signal (trainer.algorithms.distill), read from
    # AdvantageInputs.token_rewards; the run needs a teacher (teacher.path).
    teacher: bool = False

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.options):
            raise TypeError(f"Algorithm {self.name!r}: options must be a dataclass type, got {self.options!r}")
        if not (callable(self.advantage) and callable(self.loss)):
            raise TypeError(f"Algorithm {self.name!r}: advantage and loss must be callables")
        if self.min_group_size < 1:
            raise ValueError(f"Algorithm {self.name!r}: min_group_size must be >= 1, got {self.min_group_size}")

    def option_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.options)]

    def uses_reference(self, options: Any) -> bool:
        """Whether the loss needs the reference policy's log-probs (the base, adapter disabled)."""
        return getattr(options, "kl_coef", 0.0) > 0

    def entropy_in_loss(self, options: Any) -> bool:
        """Whether the loss differentiates the policy's entropy (PPO's bonus with ``ent_coef > 0``).

        Otherwise entropy is only logged: the kernel computes it in the same pass without a
        gradient, and the backward keeps its frozen-lm_head shortcut (parity.logprobs).
        """
        return getattr(options, "ent_coef", 0.0) > 0


# Rules several options types share (each message: "<Options>.<key> must be <expected>, got <value>").
def clip_rules(o: Any) -> list[tuple[bool, str, str]]:
    return [(0 <= o.clip_eps_low < 1, "clip_eps_low", "in [0, 1)"),
            (o.clip_eps_high >= 0, "clip_eps_high", ">= 0"),
            (o.kl_coef >= 0, "kl_coef", ">= 0")]


def group_scale_rules(o: Any) -> list[tuple[bool, str, str]]:
    return [(isinstance(o.scale_rewards, bool), "scale_rewards", "a bool"), (o.eps > 0, "eps", "> 0")]


def loss_agg_rule(o: Any) -> tuple[bool, str, str]:
    return (o.loss_agg in AGG_MODES, "loss_agg", "one of " + ", ".join(AGG_MODES))
