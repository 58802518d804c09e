"""Every recipe key the schema defines, and which of them the key tables of docs/recipe-keys.md document.

    python -m trainer.config.reference [train|sft|train-rm]   # keys, type, default; undocumented ones marked

The schema (``trainer/config/schema.py``, the algorithms' and correction rules' option dataclasses) is the one source of
keys; ``tests/trainer/config/test_reference.py`` fails when a key is missing from docs/recipe-keys.md's table of
its command ("parityrl train", "parityrl sft", "parityrl train-rm").
"""
from __future__ import annotations

import dataclasses
import re
import sys
import typing
from pathlib import Path

from parity.corrections import rules as correction_rules
from trainer.algorithms.registry import ALGORITHMS
from trainer.config.schema import AlgorithmConfig, CorrectionSection, RunConfig, recipe_key
from trainer.config.supervised import RMConfig, SFTConfig

KEYS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "recipe-keys.md"
SECTION = "## parityrl train"


# command -> (docs/recipe-keys.md heading of its key table, its recipe's schema)
TABLES = {
    "train": (SECTION, RunConfig),
    "sft": ("## parityrl sft", SFTConfig),
    "train-rm": ("## parityrl train-rm", RMConfig),
}


def recipe_keys(command: str = "train") -> dict[str, tuple[str, object]]:
    """{dotted key: (type, default)} of every key of ``command``'s recipe: the sections' fields (and, for
    ``train``, every algorithm's options and every correction rule's)."""
    root = TABLES[command][1]
    out: dict[str, tuple[str, object]] = {}

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints.get(f.name, f.type)
            key = f"{prefix}{recipe_key(f.name)}"
            if cls in (AlgorithmConfig, CorrectionSection) and f.name == "options":
                continue
            if dataclasses.is_dataclass(tp):
                walk(tp, key + ".")
                continue
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            out[key] = (getattr(tp, "__name__", str(tp)).replace("typing.", ""), default)

    walk(root, "")
    if command != "train":
        return out
    for name in ALGORITHMS.names():
        options = ALGORITHMS.get(name).options
        for f in dataclasses.fields(options):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
            out.setdefault(f"algorithm.{f.name}", (str(f.type), default))
    for rule in correction_rules():
        for f in dataclasses.fields(rule.options):
            out[f"parity.correction.{rule.name}.{f.name}"] = (str(f.type), f.default)
    return out


def documented_keys(page: str | None = None, section: str = SECTION) -> set[str]:
    """The keys named in the first cell of each row of a key table of docs/recipe-keys.md.

    A cell lists keys in backticks, comma-separated; a key without a dot takes the section of the
    cell's first key (`parity.probe_first`, `probe_every`), and ``a.{x,y}`` / ``a.b_{x,y}`` expand.
    """
    text = KEYS_PAGE.read_text() if page is None else page
    lines = text.split(section + "\n", 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| key |"))
    keys: set[str] = set()
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cell = line.split("|")[1]
        prefix = ""
        for token in re.findall(r"`([^`]+)`", cell):
            for key in _expand(token):
                if "." in key:
                    prefix = key.rsplit(".", 1)[0] + "."
                    keys.add(key)
                else:  # a leaf of the cell's section, or a top-level key (`name`)
                    keys.add(prefix + key)
    return keys


def _expand(token: str) -> list[str]:
    m = re.match(r"^(.*)\{([^}]*)\}(.*)$", token)
    if not m:
        return [token]
    head, alts, tail = m.groups()
    return [f"{head}{a.strip()}{tail}" for a in alts.split(",")]


def main(argv: list[str] | None = None) -> int:
    """``[train|sft|train-rm]``: that recipe's keys (default train), undocumented ones marked; exit 1 if any."""
    command = (argv if argv is not None else sys.argv[1:] or ["train"])[0]
    if command not in TABLES:
        print(f"usage: python -m trainer.config.reference [{'|'.join(TABLES)}]", file=sys.stderr)
        return 2
    docs = documented_keys(section=TABLES[command][0])
    keys = recipe_keys(command)
    for key, (tp, default) in sorted(keys.items()):
        print(f"{key:<44} {tp:<24} {default!r:<30} {'' if key in docs else 'UNDOCUMENTED'}")
    return 0 if set(keys) <= docs else 1


if __name__ == "__main__":
    sys.exit(main())
