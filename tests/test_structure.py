"""The house rules that keep the code base cheap to extend: no import cycles anywhere in src/
(imports inside functions count too), the Triton kernels never import ops/, and every user-facing
error derives from LinattnError."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "linattn"


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in (SRC / PKG).rglob("*.py")}


def _resolve(current: str, is_pkg: bool, node: ast.ImportFrom, names: Set[str]) -> List[str]:
    base = current if is_pkg else current.rsplit(".", 1)[0]
    if node.level:
        parts = base.split(".")
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts)
        target = f"{base}.{node.module}" if node.module else base
    else:
        target = node.module or ""
    out = []
    if not target.startswith(PKG):
        return out
    for alias in node.names:  # `from . import common` imports the submodule common
        sub = f"{target}.{alias.name}"
        out.append(sub if sub in names else target)
    return out


def import_graph() -> Dict[str, Set[str]]:
    mods = _modules()
    names = set(mods)
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
                node.body = []  # typing-only imports never run
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _resolve(mod, is_pkg, node, names)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith(PKG)]
            else:
                continue
            for t in targets:
                while t not in names and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in names and t != mod:
                    graph[mod].add(t)
    return graph


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _package_edges(graph):
    """Edges from a package's __init__ to its own submodules are re-exports, not cycles."""
    return {m: {t for t in ts if not (t.startswith(m + ".") and m != PKG)} for m, ts in graph.items()}


def test_no_import_cycles():
    graph = import_graph()
    # a submodule importing a sibling through its package is fine; a parent package re-exporting its
    # children is fine; anything else that loops is a cycle
    cycles = _cycles(_package_edges(graph))
    assert not cycles, "import cycles in src/linattn: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_triton_never_imports_ops():
    graph = import_graph()
    bad = {m: sorted(t for t in ts if t.startswith(f"{PKG}.ops")) for m, ts in graph.items()
           if m.startswith(f"{PKG}.triton")}
    assert not any(bad.values()), f"Triton modules import ops/: {bad}"


def test_leaves_import_nothing_heavy():
    graph = import_graph()
    for leaf in (f"{PKG}.errors", f"{PKG}.io"):
        assert graph[leaf] == set(), f"{leaf} must import nothing from linattn, imports {graph[leaf]}"
    assert graph[f"{PKG}.cli_support"] <= {f"{PKG}.errors"}
    for m, ts in graph.items():
        if m.startswith((f"{PKG}.bench", f"{PKG}.experiments", f"{PKG}.demo", f"{PKG}.training")):
            assert f"{PKG}.cli" not in ts, f"{m} imports linattn.cli (use linattn.cli_support)"


def test_errors_share_one_base():
    import linattn
    from linattn.errors import LinattnError

    assert issubclass(LinattnError, ValueError)
    import importlib.util

    no_hf = importlib.util.find_spec("transformers") is None
    for mod_name in _modules():
        if "triton" in mod_name or (no_hf and mod_name.startswith(f"{PKG}.hf")):  # the optional hf extra
            continue
        mod = pytest.importorskip(mod_name)
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == mod_name:
                assert issubclass(obj, LinattnError), f"{mod_name}.{obj.__name__} does not derive from LinattnError"
    assert linattn.LinattnError is LinattnError
