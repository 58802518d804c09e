"""The correction rules by name: one ``record.Rule`` per name, a duplicate refused, a miss answered with the names.

A new rule is one module: its options dataclass, its pure function and one ``register_rule(Rule(...))``; the
package's ``__init__`` imports it. The recipe loader, the loop and the shadow table look rules up here and ask
the record, never the name.
"""
from __future__ import annotations

from parity.corrections.record import Rule

_RULES: dict[str, Rule] = {}


def register_rule(rule: Rule) -> Rule:
    """Register ``rule`` under its name; a name already taken is refused (an import order must not pick one)."""
    if not isinstance(rule, Rule):
        raise ValueError(f"correction registry: expected a record.Rule, got {rule!r}")
    if not rule.name or rule.name in ("none",) or not rule.name.isidentifier():
        raise ValueError(f"correction registry: {rule.name!r} is not a usable rule name (an identifier, not 'none')")
    if rule.name in _RULES:
        raise ValueError(f"correction registry: name {rule.name!r} is already registered "
                         f"(by {_RULES[rule.name].apply.__module__})")
    _RULES[rule.name] = rule
    return rule


def get_rule(name: str) -> Rule:
    """The rule registered as ``name``; ValueError listing the valid names otherwise."""
    try:
        return _RULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown correction rule {name!r}; valid names: {', '.join(rule_names())}") from None


def _order(rule: Rule) -> tuple:
    # importance weights first, then rejections; token level before sequence level; then by name. Independent of
    # the import order (the order of the docs and of the shadow table's rows).
    return rule.kind != "weight", rule.level != "token", rule.name


def rules() -> list[Rule]:
    """Every registered rule: weights, then rejections; token level first."""
    return sorted(_RULES.values(), key=_order)


def rule_names() -> list[str]:
    return [r.name for r in rules()]


def is_rule(name: object) -> bool:
    return name in _RULES
