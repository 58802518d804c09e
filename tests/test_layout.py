"""The package layout's rules (docs/architecture.md), checked from the source.

- No import cycles between modules of ``trainer``, ``rollout`` and ``parity``. Every
  import counts, including the ones inside functions: a lazy import hides a cycle from
  Python's import machinery but not from a reader.
- ``parity`` imports neither ``trainer`` nor ``rollout`` (the neutral ground both sides
  trust); ``rollout`` does not import ``trainer``.
- Arrows one way inside ``trainer``: a subpackage imports only subpackages below it in
  ``TRAINER_ORDER``, so a reader can learn the packages bottom up.
- Imports of project modules sit at the top of the file, so its top says what it depends
  on. An import inside a function carries a ``# late:`` comment saying why (an optional
  heavy dependency such as vLLM or DeepSpeed behind it, or a command-line start that must
  stay fast).
- Every module of ``trainer`` lives in a subpackage (a room) whose name says its role, except the
  entry points; no room holds more than 15 modules.

Run ``python tests/test_layout.py`` to print the module graph's cycles, if any.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "rollout", "parity")
ENTRY_POINTS = {"trainer/__init__.py", "trainer/__main__.py", "trainer/cli.py", "trainer/train.py"}
# The rooms of trainer/, highest first; a room imports only rooms after it (docs/architecture.md draws them).
# commands: thin entry points, one per subcommand; doctor: `parityrl doctor`'s battery, one file per check (a room of
# its own beside `diagnostics`: the two together would be over the rooms' size); diagnostics: `parityrl compare`, its
# inputs and report; rl: one RL step -- the loop and its phases, the run record, the update passes, the
# learner, the critic; measurement: how a batch is measured -- the trainer's scoring and micro-batches, the probe,
# the parity limits and breakdowns, routing parity, held-out evaluation; sampling: how a batch is drawn -- the
# sampling round, episodes and their turn tokens, dynamic sampling, the one-step-off prefetch, the recipe's
# engine and its weight sync; lifecycle: a run from start to end, shared with the supervised commands where they
# can -- the run directory's state, stops and exit statuses, preemption, preflight, capacity, the summary, the
# samples table, the truncation warning; builtin: the models the project builds itself (the warm start runs the
# supervised stage); supervised: SFT and reward-model training; environments: multi-turn environments, tools and
# the recipe's env: resolved; rewards: reward functions and the reward-model scorer; precision: the precision
# recipes' records (the trainer's model transform, the engine's options, their rules); models: loading and running
# a policy; vision: a vision-language batch's images and their features merged into the decoder's input; io: run
# directories, checkpoints, logs; data: prompt datasets and tasks; distributed: process groups,
# DDP, DeepSpeed, the launch line; config: the recipes' schema (it reads the algorithms' option types); algorithms:
# pure tensor functions and their records.
TRAINER_ORDER = ("commands", "doctor", "diagnostics", "rl", "teacher", "measurement", "sampling", "lifecycle", "builtin", "supervised",
                 "environments", "rewards", "precision", "models", "vision", "io", "data", "distributed", "config", "off_policy",
                 "algorithms")


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


def trainer_package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "trainer" and len(parts) > 2 else None


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    rank = {name: i for i, name in enumerate(TRAINER_ORDER)}
    bad = []
    for mod, deps in graph.items():
        src = trainer_package(mod)
        if src is None:
            continue
        for dep in deps:
            dst = trainer_package(dep)
            if dst is not None and dst != src and rank.get(dst, -1) <= rank.get(src, len(rank)):  # unknown: flagged
                bad.append((mod, dep))
    return sorted(bad)


def test_upward_import_finder_sees_one():
    assert upward_imports({"trainer.config.load": {"trainer.models.policy", "trainer.algorithms.record"}}) == \
        [("trainer.config.load", "trainer.models.policy")]
    assert upward_imports({"trainer.rl.loop": {"trainer.models.policy"}}) == []
    assert upward_imports({"trainer.newpkg.x": {"trainer.models.policy"}}) == [("trainer.newpkg.x", "trainer.models.policy")]


def test_every_trainer_package_has_its_place_in_the_order():
    packages = {p.name for p in (REPO / "trainer").iterdir() if (p / "__init__.py").exists()}
    assert packages == set(TRAINER_ORDER), f"packages not in TRAINER_ORDER (or gone): {packages ^ set(TRAINER_ORDER)}"


def test_trainer_packages_import_only_downwards():
    bad = upward_imports(import_graph(project_modules()))
    assert not bad, "imports against TRAINER_ORDER: " + "; ".join(f"{m} -> {d}" for m, d in bad)


def late_project_imports(path: Path) -> list[str]:
    """Imports of project modules inside a function without a ``# late:`` reason on or just above them."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for fn in ast.walk(ast.parse(source, str(path))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            if not any(n.split(".")[0] in PACKAGES for n in names):
                continue
            i = node.lineno - 1
            reasoned = "# late:" in lines[i]
            while not reasoned and i > 0:  # up through the block of imports and comments it belongs to
                i -= 1
                text = lines[i].strip()
                if not (text.startswith(("#", "from ", "import ")) or text.startswith(")")):
                    break
                reasoned = "# late:" in text
            if not reasoned:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_late_import_finder(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    f = tmp_path / "m.py"
    f.write_text("def a():\n    from trainer.x import y\n    return y\n\n"
                 "def b():\n    # late: vllm is optional\n    from rollout.vllm_engine import V\n    import json\n")
    assert late_project_imports(f) == ["m.py:2"]


def test_project_imports_are_at_the_top():
    found = [hit for p in project_modules().values() for hit in late_project_imports(p)]
    assert not found, "imports of project modules inside functions without a '# late:' reason: " + ", ".join(found)


MAX_MODULES_PER_ROOM = 15  # a newcomer reads a room's file names at a glance


def test_no_room_holds_more_than_15_modules():
    crowded = {p.name: n for p in (REPO / "trainer").iterdir() if (p / "__init__.py").exists()
               for n in [sum(1 for _ in p.rglob("*.py"))] if n > MAX_MODULES_PER_ROOM}
    assert not crowded, f"rooms of trainer/ over {MAX_MODULES_PER_ROOM} modules (split them by role): {crowded}"


def test_every_trainer_module_is_in_a_subpackage():
    loose = [str(p.relative_to(REPO)) for p in (REPO / "trainer").glob("*.py")
             if str(p.relative_to(REPO)) not in ENTRY_POINTS]
    assert not loose, f"modules outside a subpackage: {loose}"


if __name__ == "__main__":
    for c in cycles(import_graph(project_modules())):
        print(" <-> ".join(c))


def test_test_modules_have_unique_basenames():
    # tests/ has no __init__.py files, so pytest imports each test module by its basename: a second module of
    # the same name stops the whole collection ("import file mismatch") before any test runs
    seen: dict[str, list[str]] = {}
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        seen.setdefault(path.name, []).append(str(path.relative_to(REPO)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules sharing a basename (rename one): {clashes}"
