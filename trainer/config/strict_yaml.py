"""YAML for recipes: a key given twice in one mapping is an error (PyYAML keeps the last one silently)."""
from __future__ import annotations

from typing import Any

import yaml


class DuplicateKey(ValueError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    pass


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise DuplicateKey(f"key {key!r} appears twice in one section: line {seen[key]} and line {line} "
                               "(YAML would keep only the last); remove one")
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load_unique(text: str) -> Any:
    """``yaml.safe_load`` that raises ``DuplicateKey`` (naming the key and both lines) for a repeated key."""
    return yaml.load(text, Loader=_UniqueKeyLoader)
