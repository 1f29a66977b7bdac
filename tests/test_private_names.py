"""No private name crosses a module boundary in src/ (issue 38): what one module uses from another is public
(`from .x import _y` and `x._y` on an imported linattn module are refused). Tests may still reach private names."""
import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(path: Path):
    """(line, text) of each private name `path` takes from another linattn module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules, found = set(), []   # local names bound to linattn modules
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("linattn")):
            for a in node.names:
                if _private(a.name):
                    found.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import {a.name}"))
                elif node.module is None or a.name[:1].islower():   # `from . import common`, `from .. import ckpt`
                    modules.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            modules.update(a.asname for a in node.names if a.name.startswith("linattn") and a.asname)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in modules):
            found.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return found


def test_no_private_names_across_modules():
    bad = [f"{p.relative_to(SRC)}:{line}: {text}" for p in sorted((SRC / "linattn").rglob("*.py"))
           for line, text in private_uses(p)]
    assert not bad, "\n".join(bad)


def test_the_check_finds_both_forms(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from .common import _cdt, cdt\nfrom .. import checkpoint as ckpt\nckpt._no_checkpoint_error(1)\n"
                 "ckpt.load_checkpoint(1)\n")
    assert [t for _, t in private_uses(f)] == ["from .common import _cdt", "ckpt._no_checkpoint_error"]
