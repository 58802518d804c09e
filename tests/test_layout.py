"""The package layout's rules (README "Where things are"), checked from the source.

- No import cycles between modules of ``trainer``, ``rollout`` and ``parity``. Every
  import counts, including the ones inside functions: a lazy import hides a cycle from
  Python's import machinery but not from a reader.
- ``parity`` imports neither ``trainer`` nor ``rollout`` (shared/DESIGN.md: the neutral
  ground both sides trust); ``rollout`` does not import ``trainer``.
- Every module of ``trainer`` lives in a subpackage whose name says its role, except the
  entry points.

Run ``python tests/test_layout.py`` to print the module graph's cycles, if any.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "rollout", "parity")
ENTRY_POINTS = {"trainer/__init__.py", "trainer/__main__.py", "trainer/cli.py", "trainer/train.py"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The project module an imported dotted name refers to (a module, or the package holding an attribute)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    pkg = mod if is_pkg else mod.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}".strip(".")
                # `from pkg import sub` names the submodule when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                dep = _resolve(t, modules)
                if dep and dep != mod:
                    graph[mod].add(dep)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph(project_modules()))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_layers():
    graph = import_graph(project_modules())
    bad = [(m, d) for m, deps in graph.items() for d in deps
           if (m.startswith("parity") and d.split(".")[0] in ("trainer", "rollout"))
           or (m.startswith("rollout") and d.startswith("trainer"))]
    assert not bad, f"imports across layers: {bad}"


def test_every_trainer_module_is_in_a_subpackage():
    loose = [str(p.relative_to(REPO)) for p in (REPO / "trainer").glob("*.py")
             if str(p.relative_to(REPO)) not in ENTRY_POINTS]
    assert not loose, f"modules outside a subpackage: {loose}"


if __name__ == "__main__":
    for c in cycles(import_graph(project_modules())):
        print(" <-> ".join(c))
