"""A run's correction: the chosen rules combined into one weight per token, as verl combines ``rollout_is`` and
``rollout_rs``.

    w = IS x prod_r M_r

with IS the weight of the one importance-weight rule (``kind == "weight"``; 1 without one) and M_r the 0/1 mask of
each rejection rule (verl/trainer/ppo/rollout_corr_helper.py ``compute_rollout_correction_and_rejection_mask``:
the IS weights and the rejection mask are computed apart and both applied). A rejected token keeps its place in the
loss's denominator (its weight is 0), as TRL's masks and IcePop's M(k) do; verl's rejection instead removes it from
``response_mask``, which also shrinks a token-mean's denominator.

``batch_normalize`` divides the IS weights by their batch mean (over valid tokens for a token-level rule, over
sequences for a sequence-level one; over every data-parallel rank's batch through ``all_sum``), after truncation and
before the masks: verl's ``rollout_is_batch_normalize`` ("only affects IS weight values, not rejection sampling"),
a self-normalised importance sampler. Its mean needs the whole batch before any weight is used, so the loop scores
pi_old first when it is on (one gradient-free forward more per step in the single-update case).

Rules read one of two policies (``Rule.policy``): pi_old, scored once per rollout batch, or the policy being updated
(OPSM), read again at every update. ``part`` splits a plan along that line; since every rule but the importance
weight is a 0/1 mask, the product of the two parts' weights is the whole plan's, and where the two policies are one
(the single on-policy update) it is exactly ``apply``'s.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from parity.corrections.record import CorrectionInputs, Rule, RuleOutput
from parity.corrections.registry import get_rule, rule_names

# verl's guard: a batch whose IS weights are all (about) 0 is not normalised (its mean would explode them).
NORM_FLOOR = 1e-8


class PlanError(ValueError):
    """A combination of rules that cannot run: names the key (``rule`` or ``batch_normalize``) and the expectation."""

    def __init__(self, key: str, value: Any, expected: str) -> None:
        self.key, self.value, self.expected = key, value, expected
        super().__init__(f"{key} = {value!r}: expected {expected}")


@dataclass
class PlanOutput:
    """weights [B, T] float64 (0 on padding); clipped / masked bool [B, T] over every rule; each rule's own output;
    the batch normaliser (the IS weights' batch mean) when ``batch_normalize`` is on, else None."""

    weights: torch.Tensor
    clipped: torch.Tensor
    masked: torch.Tensor
    per_rule: dict[str, RuleOutput]
    norm_factor: Optional[float] = None


@dataclass(frozen=True)
class CorrectionPlan:
    """The rules a run applies (in the order given), their options, and whether the IS weights are batch-normalised.

    ``options``: rule name -> its options object; a chosen rule missing from it runs on its defaults.
    Raises ``PlanError`` for an unknown or repeated name, two importance-weight rules, or ``batch_normalize``
    without one, and TypeError for options of the wrong type or of a rule not chosen.
    """

    rules: tuple[str, ...] = ()
    options: dict[str, Any] = field(default_factory=dict)
    batch_normalize: bool = False

    def __post_init__(self) -> None:
        names = tuple(self.rules)
        object.__setattr__(self, "rules", names)
        for name in names:
            if name not in rule_names():
                raise PlanError("rule", name, f"a correction rule: one of {', '.join(rule_names())}")
        if len(set(names)) != len(names):
            raise PlanError("rule", list(names), "each rule at most once")
        weights = [n for n in names if get_rule(n).kind == "weight"]
        if len(weights) > 1:
            raise PlanError("rule", list(names), f"at most one importance-weight rule (got {', '.join(weights)}); "
                            "any number of rejection rules may join it")
        if self.batch_normalize and not weights:
            raise PlanError("batch_normalize", True, "false without an importance-weight rule (it normalises the "
                            "IS weights: " + ", ".join(n for n in rule_names() if get_rule(n).kind == "weight") + ")")
        full = {}
        for name, opts in self.options.items():
            if name not in names:
                raise TypeError(f"options of {name!r} given, but {name!r} is not among the rules {list(names)}")
            rule = get_rule(name)
            if not isinstance(opts, rule.options):
                raise TypeError(f"options of {name!r}: expected a {rule.options.__name__}, got {type(opts).__name__}")
        for name in names:
            full[name] = self.options[name] if name in self.options else get_rule(name).options()
        object.__setattr__(self, "options", full)

    @property
    def records(self) -> list[Rule]:
        return [get_rule(n) for n in self.rules]

    @property
    def weight_rule(self) -> Optional[Rule]:
        return next((r for r in self.records if r.kind == "weight"), None)

    @property
    def level(self) -> str:
        """``token`` when some rule's weights may differ inside a sequence, else ``sequence`` (also when empty)."""
        return "token" if any(r.level == "token" for r in self.records) else "sequence"

    @property
    def needs_advantages(self) -> bool:
        return any(r.needs_advantages for r in self.records)

    @property
    def reads_current_policy(self) -> bool:
        """Whether some rule reads the policy being updated (``Rule.policy == "current"``): its weights are then
        computed again at every update of a batch, from that update's own log-probs."""
        return any(r.policy == "current" for r in self.records)

    def part(self, policy: str) -> "CorrectionPlan":
        """The rules of this plan that read ``policy`` (``"old"`` or ``"current"``), with their options. The batch
        normalisation goes with the importance weight, which reads pi_old (``Rule`` refuses it on the current
        policy)."""
        if policy not in ("old", "current"):
            raise ValueError(f"policy = {policy!r}: expected 'old' or 'current'")
        names = tuple(n for n in self.rules if get_rule(n).policy == policy)
        return CorrectionPlan(names, {n: self.options[n] for n in names},
                              batch_normalize=self.batch_normalize and policy == "old")

    @property
    def batch_level(self) -> bool:
        """Whether a weight depends on the whole batch (not only on its own sequence): the loop then scores pi_old
        before the update instead of taking it from the update's own forward."""
        return self.batch_normalize

    def __bool__(self) -> bool:
        return bool(self.rules)

    def describe(self) -> str:
        """``token_tis(cap=2) x seq_mean_k3(max_kl=0.01), batch-normalised``: the plan in one line (6 digits)."""
        if not self.rules:
            return "none"
        parts = [f"{n}({', '.join(f'{k}={v:.6g}' for k, v in vars(self.options[n]).items())})" for n in self.rules]
        return " x ".join(parts) + (", batch-normalised" if self.batch_normalize else "")

    def apply(self, inputs: CorrectionInputs,
              all_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> PlanOutput:
        """The combined weights of ``inputs``; ``all_sum`` pools the batch normaliser over data-parallel ranks
        (None: these rows are the whole batch). Without rules every valid token weighs 1."""
        mask = inputs.mask
        w = mask.double()
        clipped, masked = torch.zeros_like(mask), torch.zeros_like(mask)
        per_rule: dict[str, RuleOutput] = {}
        norm = None
        for rule in self.records:
            out = rule.run(inputs, self.options[rule.name])
            per_rule[rule.name] = out
            rw = out.weights
            if rule.kind == "weight" and self.batch_normalize:
                rw, norm = _normalise(inputs, rw, rule.level, all_sum)
            w = w * rw
            clipped |= out.clipped
            masked |= out.masked
        # a token both truncated by the weight rule and rejected by a mask counts as masked: its weight is 0
        masked &= mask
        return PlanOutput(weights=w, clipped=clipped & mask & ~masked, masked=masked, per_rule=per_rule,
                          norm_factor=norm)


def _normalise(inputs: CorrectionInputs, w: torch.Tensor, level: str, all_sum) -> tuple[torch.Tensor, float]:
    """(w / its batch mean, the mean): over valid tokens (token level) or over sequences (sequence level)."""
    if level == "token":
        total = torch.stack([w.sum(), inputs.mask.double().sum()])
    else:
        has = inputs.lengths > 0
        total = torch.stack([inputs.seq_mean(w)[has].sum(), has.double().sum()])
    if all_sum is not None:
        total = all_sum(total)
    mean = float(total[0] / total[1]) if float(total[1]) > 0 else 0.0
    if mean <= NORM_FLOOR:
        return w, 1.0
    return w / mean, mean
