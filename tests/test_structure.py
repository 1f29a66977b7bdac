"""The house rules that keep the code base cheap to extend: no import cycles anywhere in src/
(imports inside functions count too), the Triton kernels never import ops/, and every user-facing
error derives from LinattnError."""
from __future__ import annotations

from typing import Dict, List, Set

import pytest

from tests.helpers import PKG, import_graph_once, src_modules


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
    graph = import_graph_once()
    # a submodule importing a sibling through its package is fine; a parent package re-exporting its
    # children is fine; anything else that loops is a cycle
    cycles = _cycles(_package_edges(graph))
    assert not cycles, "import cycles in src/linattn: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_triton_never_imports_ops():
    graph = import_graph_once()
    bad = {m: sorted(t for t in ts if t.startswith(f"{PKG}.ops")) for m, ts in graph.items()
           if m.startswith(f"{PKG}.triton")}
    assert not any(bad.values()), f"Triton modules import ops/: {bad}"


def test_leaves_import_nothing_heavy():
    graph = import_graph_once()
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
    for mod_name in src_modules():
        if "triton" in mod_name or (no_hf and mod_name.startswith(f"{PKG}.hf")):  # the optional hf extra
            continue
        mod = pytest.importorskip(mod_name)
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == mod_name:
                assert issubclass(obj, LinattnError), f"{mod_name}.{obj.__name__} does not derive from LinattnError"
    assert linattn.LinattnError is LinattnError


def test_tests_mirror_src_and_share_code_through_helpers():
    """tests/<folder>/ mirrors src/linattn/<folder>/ and every folder of test modules is a package (so two modules
    may share a basename, and tests/triton/ can never be imported as `triton`); a test file never imports another
    test file: what several use lives in tests/helpers.py (or tests/fla_cpu.py)."""
    import ast
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    folders = {p.parent for p in tests.rglob("test_*.py")}
    assert not [str(f) for f in folders if not (f / "__init__.py").is_file()], "a test folder without __init__.py"
    src_folders = {p.name for p in (tests.parent / "src" / PKG).iterdir() if (p / "__init__.py").is_file()}
    extra = sorted(f.name for f in folders if f != tests and f.parent == tests and f.name not in src_folders | {"docs"})
    assert not extra, f"test folders that mirror no package of src/linattn: {extra}"
    bad = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or "", *(a.name for a in node.names)] if isinstance(node, ast.ImportFrom)
                     else [])   # `from tests import test_x` too
            bad += [f"{path.relative_to(tests)}: {n}" for n in names if n.rsplit(".", 1)[-1].startswith("test_")]
    assert not bad, f"test files importing test files: {bad}"


def _longest_chain(graph: Dict[str, Set[str]], package: str) -> List[str]:
    """The longest chain of imports between the modules of `package` (its __init__ left out: it re-exports)."""
    inside = {m for m in graph if m.startswith(package + ".")}
    best: Dict[str, List[str]] = {}

    def walk(m: str) -> List[str]:
        if m not in best:
            tails = [walk(t) for t in graph[m] if t in inside]
            best[m] = [m] + max(tails, key=len, default=[])
        return best[m]

    return max((walk(m) for m in inside), key=len, default=[])


# the import levels a subpackage may stack; layers/: registry and cache, packing, common, the fast decoding step,
# base, a mixer, a mixer built on another (delta_family on delta), one spare
CHAIN_LIMITS = {"layers": 8}
DEFAULT_CHAIN_LIMIT = 6


def test_import_chains_inside_subpackages_stay_short():
    """A helper two sibling modules share moves down (layers/common.py, a module of its own), rather than one
    sibling importing the other: that keeps each subpackage a few levels deep."""
    graph = _package_edges(import_graph_once())
    packages = sorted({m.rsplit(".", 1)[0] for m in graph if m.count(".") >= 2})
    long = {}
    for package in packages:
        chain = _longest_chain(graph, package)
        limit = CHAIN_LIMITS.get(package.split(".", 1)[1], DEFAULT_CHAIN_LIMIT)
        if len(chain) > limit:
            long[package] = f"{len(chain)} > {limit}: " + " -> ".join(chain)
    assert not long, f"import chains too long: {long}"


def test_longest_chain_follows_the_imports():
    graph = {"p.a": {"p.b", "q.x"}, "p.b": {"p.c"}, "p.c": set(), "p.d": {"p.c"}, "q.x": set()}
    assert _longest_chain(graph, "p") == ["p.a", "p.b", "p.c"]


def test_no_issue_history_notes_in_the_source():
    """What a reader needs goes to the docs page of the area; "issue N" history notes in the source go stale."""
    import re
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / PKG
    pattern = re.compile(r"\bissues? \d+", re.IGNORECASE)
    found = [f"{p.relative_to(src)}:{i}" for p in sorted(src.rglob("*")) if p.suffix in (".py", ".c", ".h")
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not found, f"history notes in the source: {found[:10]}"
