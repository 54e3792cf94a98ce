"""The import graph of retiarii has no cycle, and the IR core imports only downward.

Every module of ``retiarii/`` is parsed with ``ast``; every import counts, function-local ones
included (they are how cycles hide), relative imports resolved. Importing a submodule is an
edge to that submodule only: its parent packages' ``__init__`` run first, but that is Python's
doing, not a dependency the module chose. The layers are the ones docs/architecture.md draws.
"""
from __future__ import annotations

import ast
import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "retiarii")

# The IR core, bottom to top: a module imports only modules of lower layers.
LAYERS = [
    {"retiarii.codec"},
    {"retiarii.modspec"},
    {"retiarii.graph_operation", "retiarii.graph_hash"},  # what a node computes; hashes
    {"retiarii.graph", "retiarii.ops"},
    {"retiarii.interpreter", "retiarii.trace", "retiarii.match"},
    {"retiarii.codegen"},
    {"retiarii.shapes", "retiarii.mutator"},
    # inline choices: the user's classes and the mutators they compile to; mutators: the
    # package and its files
    {"retiarii.choices", "retiarii.choice_mutators", "retiarii.mutators"},
    {"retiarii.choice_tracing"},  # trace hooks of inline choices -> choice_mutators
    {"retiarii.space", "retiarii.nn"},
]

# Edges that point up on purpose, each documented next to the import (NOTE: [The one upward
# import] in graph.py): Graph.to_module/to_source are the IR's public convenience.
ALLOWED_UPWARD = {("retiarii.graph", "retiarii.codegen")}


def _modules() -> dict[str, str]:
    """module name -> file path, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                parts = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                found[".".join(parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the retiarii modules it imports anywhere in its body."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_package = path.endswith("__init__.py")
        package = name if is_package else name.rpartition(".")[0]
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                # ``from pkg import sub`` imports the submodule ``pkg.sub``
                subs = [f"{origin}.{a.name}" for a in node.names if f"{origin}.{a.name}" in modules]
                targets = subs if len(subs) == len(node.names) else subs + [origin]
            for target in targets:
                while target and target not in modules:  # ``import retiarii.engine.x as y``
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges[name].add(target)
    return edges


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _without_allowed(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in ts if (m, t) not in ALLOWED_UPWARD} for m, ts in edges.items()}


def test_no_import_cycle():
    cycle = find_cycle(_without_allowed(import_graph()))
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def _placed(module: str) -> tuple[int, str] | None:
    """(layer index, the LAYERS entry) of a module or of the package holding it."""
    m = module
    while m:
        for i, layer in enumerate(LAYERS):
            if m in layer:
                return i, m
        m = m.rpartition(".")[0]
    return None


def test_ir_core_imports_only_downward():
    def points_up(m: str, t: str) -> bool:
        pm, pt = _placed(m), _placed(t)
        if pm is None or pt is None or pm[1] == pt[1]:  # (inside one package: its business)
            return False
        return pt[0] >= pm[0]

    upward = {(m, t) for m, ts in import_graph().items() for t in ts if points_up(m, t)}
    assert upward == ALLOWED_UPWARD, (
        f"imports that do not point down the layers {LAYERS}: "
        f"{sorted(upward - ALLOWED_UPWARD)}; allowed but gone (remove them from "
        f"ALLOWED_UPWARD): {sorted(ALLOWED_UPWARD - upward)}")


def test_every_ir_module_has_a_layer():
    """A new module of the IR core is placed in LAYERS (and in docs/architecture.md)."""
    modules = _modules()
    core = {"retiarii.codec", "retiarii.graph", "retiarii.trace", "retiarii.codegen",
            "retiarii.mutator", "retiarii.choices", "retiarii.choice_mutators",
            "retiarii.choice_tracing", "retiarii.space"}
    placed = set().union(*LAYERS)
    assert core <= placed and placed - {"retiarii.mutators"} <= set(modules)


@pytest.mark.parametrize("edges, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"a"}}, ["a", "a"]),
])
def test_find_cycle_finds_cycles(edges, cycle):
    assert find_cycle(edges) == cycle


def test_local_and_relative_imports_are_edges(tmp_path, monkeypatch):
    pkg = tmp_path / "retiarii"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from .high import g\n")
    (pkg / "high.py").write_text("from . import low\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "leaf.py").write_text("import retiarii.high as h\nfrom ..low import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(pkg))
    edges = import_graph()
    assert edges["retiarii.low"] == {"retiarii.high"}
    assert edges["retiarii.high"] == {"retiarii.low"}
    assert edges["retiarii.sub.leaf"] == {"retiarii.high", "retiarii.low"}
    assert find_cycle(edges) == ["retiarii.high", "retiarii.low", "retiarii.high"]


# ---- every module: one stated role, its own names, a size read in one sitting -------------------

MAX_LINES = 500
# Modules still over MAX_LINES, each at most the lines it has now: the list only shrinks (the
# job-wing redraw splits them by idea); a module not listed must stay within MAX_LINES.
OVER: dict[str, int] = {}


def _private_imports(modules: dict[str, str]) -> list[str]:
    """``module: from X import _name`` for every import of another retiarii module's private
    name (a leading underscore, dunders aside)."""
    found = []
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 0 and not (node.module or "").startswith("retiarii"):
                continue
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{name}: from {'.' * node.level}{node.module or ''} "
                                 f"import {alias.name}")
    return found


def test_no_module_imports_another_modules_private_names():
    """What a module shares it names without an underscore; a private name stays private."""
    assert _private_imports(_modules()) == []


def test_every_module_states_its_role_and_reads_in_one_sitting():
    modules = _modules()
    silent, long = [], []
    for name, path in sorted(modules.items()):
        with open(path) as f:
            text = f.read()
        doc = ast.get_docstring(ast.parse(text, path))
        if not (doc and doc.strip().splitlines()[0].strip()):
            silent.append(name)
        lines = text.count("\n")
        if lines > OVER.get(name, MAX_LINES):
            long.append(f"{name} ({lines} lines, limit {OVER.get(name, MAX_LINES)})")
    assert not silent, f"modules without a docstring stating their role: {silent}"
    assert not long, f"modules over their limit (split by idea, not mechanically): {long}"
    shrunk = {m: n for m, n in OVER.items() if m in modules and
              open(modules[m]).read().count("\n") <= MAX_LINES}
    assert not shrunk, f"now within {MAX_LINES} lines: remove from OVER: {sorted(shrunk)}"


def test_the_checks_find_what_they_forbid(tmp_path, monkeypatch):
    pkg = tmp_path / "retiarii"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "a.py").write_text('"""A."""\ndef _hidden():\n    pass\n')
    (pkg / "b.py").write_text("from .a import _hidden\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", str(pkg))
    assert _private_imports(_modules()) == ["retiarii.b: from .a import _hidden"]


def test_the_store_imports_nothing_of_the_runner():
    """The store keeps what the runner decides (plans, journal); it never imports the runner
    (what both read, such as GroupMemory, lives in engine/jobs/contract.py)."""
    upward = sorted(f"{m} -> {t}" for m, ts in import_graph().items()
                    if m.startswith("retiarii.engine.storage.") for t in ts
                    if t.startswith(("retiarii.engine.runner", "retiarii.engine.driver")))
    assert upward == []
