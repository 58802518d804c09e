"""One record per correction rule: what the recipe loader, the loop and the shadow table need to know about it.

A rule is registered once (``registry.register_rule``) by the module that defines its function. The record holds:

- ``options``: a frozen dataclass whose fields are the rule's own keys under the recipe's
  ``parity.correction.<rule>:`` section, defaults from the rule's source (cited in the dataclass). The options
  validate themselves (``__post_init__`` raising ``OptionError``), standalone or from a recipe.
- ``apply``: the pure function ``(CorrectionInputs, options) -> RuleOutput``.
- ``kind``: ``"weight"`` (an importance weight: at most one per run) or ``"reject"`` (a 0/1 mask: any number,
  multiplied into the weight, as verl's ``rollout_is`` x ``rollout_rs``).
- ``level``: ``"token"`` when a rule's weights may differ between the tokens of one sequence, ``"sequence"`` when
  they are one value per sequence (a sequence-level loss such as RLOO's accepts only those).
- ``needs_advantages``: the rule reads the advantages (DeepSeek-V3.2's off-policy sequence mask).
- ``policy``: whose log-probs the rule's d = lp_t - lp_r takes as lp_t. ``"old"``: pi_old, the trainer's view of
  the behaviour policy, scored once per rollout batch: every rule that corrects the engine/trainer mismatch.
  ``"current"``: the policy being updated, read again at every update of the batch (with ``algorithm.epochs`` x
  ``mini_batches`` > 1 it moves between them): DeepSeek-V3.2's OPSM, whose pi_theta is the current policy (TRL's
  ``get_off_policy_mask`` takes the update's own detached log-probs). Such a rule must be a rejection: a weight
  rule may be batch-normalised, which needs the whole batch's weights before the first update.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal, Optional

import torch

from parity.metrics import _check_finite, _check_mask


class OptionError(ValueError):
    """A rule option out of range: names the rule, the option, its value and what was expected."""

    def __init__(self, owner: str, key: str, value: Any, expected: str) -> None:
        self.owner, self.key, self.value, self.expected = owner, key, value, expected
        super().__init__(f"{owner}.{key} must be {expected}, got {value!r}")


def real(x: Any) -> bool:
    """A finite int or float (not a bool): what every threshold must be."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_options(rule: str, options: Any, rules: Iterable[tuple[bool, str, str]]) -> None:
    """Raise ``OptionError`` for the first (ok, key, expected) that does not hold."""
    for ok, key, expected in rules:
        if not ok:
            raise OptionError(rule, key, getattr(options, key), expected)


def band_rules(o: Any) -> list[tuple[bool, str, str]]:
    """A kept band [low, high] of a ratio that contains 1, so that a perfectly matched token or sequence is kept."""
    return [(real(o.low) and 0 < o.low < 1, "low", "a finite number with 0 < low < 1"),
            (real(o.high) and o.high > 1, "high", "a finite number > 1")]


def cap_rules(o: Any) -> list[tuple[bool, str, str]]:
    """A truncation cap C >= 1, so that a perfectly matched token or sequence keeps weight 1."""
    return [(real(o.cap) and o.cap >= 1, "cap", "a finite number >= 1")]


def max_kl_rules(o: Any) -> list[tuple[bool, str, str]]:
    return [(real(o.max_kl) and o.max_kl > 0, "max_kl", "a finite number > 0 (nats)")]


@dataclass(frozen=True)
class CorrectionInputs:
    """What a rule sees: one batch (or micro-batch) of whole sequences, in float64.

    d: [B, T] lp_t - lp_r, the trainer's minus the engine's log-prob of each sampled token; exactly 0 on padding.
    mask: [B, T] bool, True on valid (sampled) completion tokens.
    advantages: [B, T] the step's advantages (0 on padding), or None when the caller has none.
    lengths: [B] the number of valid tokens of each row.
    Build with ``CorrectionInputs.of`` (it checks shapes and finiteness and never reads padding).
    """

    d: torch.Tensor
    mask: torch.Tensor
    advantages: Optional[torch.Tensor]
    lengths: torch.Tensor

    @classmethod
    def of(cls, train_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
           advantages: Optional[torch.Tensor] = None) -> "CorrectionInputs":
        """From [B, T] log-probs (``train_logprobs`` may require grad: only its value is read), mask and advantages.

        Raises ValueError naming the argument for a bad shape, a mask that is not 0/1, or a non-finite value at a
        valid position; values at padding are never read (they may be inf/NaN).
        """
        if not isinstance(train_logprobs, torch.Tensor) or train_logprobs.dim() != 2:
            raise ValueError(f"train_logprobs: expected a [B, T] tensor, got "
                             f"{tuple(getattr(train_logprobs, 'shape', ()))}")
        shape = train_logprobs.shape
        for name, x in (("rollout_logprobs", rollout_logprobs), ("advantages", advantages)):
            if x is not None and (not isinstance(x, torch.Tensor) or x.shape != shape):
                raise ValueError(f"{name}: expected shape {tuple(shape)} (as train_logprobs), got "
                                 f"{tuple(getattr(x, 'shape', ()))}")
        mask = _check_mask(mask, shape)
        _check_finite(train_logprobs, mask, "train_logprobs")
        _check_finite(rollout_logprobs, mask, "rollout_logprobs")
        zero = torch.zeros((), dtype=torch.float64, device=train_logprobs.device)

        def valid(x: torch.Tensor) -> torch.Tensor:  # zeroed before any arithmetic: inf - inf = NaN
            return torch.where(mask, x.detach().double(), zero)

        adv = None
        if advantages is not None:
            _check_finite(advantages, mask, "advantages")
            adv = valid(advantages)
        return cls(d=valid(train_logprobs) - valid(rollout_logprobs), mask=mask, advantages=adv,
                   lengths=mask.double().sum(-1))

    # Per-sequence reductions of a [B, T] statistic over the valid tokens ([B]; 0 for a row without any).
    def seq_sum(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask, x, torch.zeros_like(x)).sum(-1)

    def seq_mean(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq_sum(x) / self.lengths.clamp(min=1)

    def seq_max(self, x: torch.Tensor) -> torch.Tensor:
        m = torch.where(self.mask, x, torch.full_like(x, -math.inf)).amax(-1) if x.shape[-1] else self.lengths * 0
        return torch.where(self.lengths > 0, m, torch.zeros_like(m))

    def per_token(self, seq: torch.Tensor) -> torch.Tensor:
        """A [B] per-sequence value (or bool) broadcast to the row's valid tokens, 0 (False) on padding."""
        return seq.unsqueeze(-1).expand_as(self.d) & self.mask if seq.dtype == torch.bool else \
            torch.where(self.mask, seq.unsqueeze(-1).expand_as(self.d), torch.zeros_like(self.d))


@dataclass
class RuleOutput:
    """What a rule did: weights [B, T] float64 (0 on padding), and which valid tokens it truncated / set to 0.

    clipped: bool [B, T], valid tokens whose weight the rule truncated (a cap); masked: bool [B, T], valid tokens
    the rule gave weight 0. A token is at most one of the two.
    """

    weights: torch.Tensor
    clipped: torch.Tensor
    masked: torch.Tensor


@dataclass(frozen=True)
class Rule:
    name: str
    kind: Literal["weight", "reject"]
    level: Literal["token", "sequence"]
    options: type
    apply: Callable[[CorrectionInputs, Any], RuleOutput]
    formula: str  # one line, for the docs and error messages
    source: str  # where the rule and its defaults come from
    needs_advantages: bool = False
    policy: Literal["old", "current"] = "old"

    def __post_init__(self) -> None:
        if not (dataclasses.is_dataclass(self.options) and self.options.__dataclass_params__.frozen):
            raise TypeError(f"Rule {self.name!r}: options must be a frozen dataclass type, got {self.options!r}")
        if self.kind not in ("weight", "reject") or self.level not in ("token", "sequence"):
            raise ValueError(f"Rule {self.name!r}: kind must be weight|reject and level token|sequence, got "
                             f"{self.kind!r}, {self.level!r}")
        if not callable(self.apply):
            raise TypeError(f"Rule {self.name!r}: apply must be a callable")
        if self.policy not in ("old", "current"):
            raise ValueError(f"Rule {self.name!r}: policy must be old|current, got {self.policy!r}")
        if self.policy == "current" and self.kind != "reject":
            raise ValueError(f"Rule {self.name!r}: a rule on the current policy must be a rejection (kind 'reject'): "
                             "an importance weight may be batch-normalised, which needs the whole batch's weights "
                             "before the first update")

    def option_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self.options)]

    def run(self, inputs: CorrectionInputs, options: Any = None) -> RuleOutput:
        """``apply`` with ``options`` (None: the defaults), after checking they are this rule's type."""
        options = self.options() if options is None else options
        if not isinstance(options, self.options):
            raise TypeError(f"Rule {self.name!r}: options must be a {self.options.__name__}, got "
                            f"{type(options).__name__}")
        if self.needs_advantages and inputs.advantages is None:
            raise ValueError(f"{self.name}: needs the advantages (CorrectionInputs.advantages is None)")
        return self.apply(inputs, options)


def kept(inputs: CorrectionInputs, keep: torch.Tensor) -> RuleOutput:
    """A rejection's output: weight 1 on the valid tokens ``keep`` holds, 0 on the others (masked)."""
    keep = keep & inputs.mask
    return RuleOutput(weights=keep.double(), clipped=torch.zeros_like(keep), masked=inputs.mask & ~keep)
