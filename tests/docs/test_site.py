"""The documentation site (mkdocs.yml, docs/): `mkdocs build --strict` passes (a warning, such as a broken link, a
page missing from the build or a docstring griffe cannot parse, fails it), the key pages and the API page of
`linattn.delta_rule` exist, every internal link and anchor of the built site resolves, the site loads nothing
from the network, and no internal issue number leaks into the results pages or the README."""
from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="mkdocs / mkdocstrings are not installed (pip install -e '.[docs]'; `make test` installs them)")


class _Links(HTMLParser):
    """The ids and the outgoing href / src of one HTML page."""

    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for key in ("href", "src"):
            if a.get(key) is not None:
                self.links.append((tag, a[key]))


def _parse(path: Path) -> _Links:
    p = _Links()
    p.feed(path.read_text(encoding="utf-8"))
    return p


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-f", str(ROOT / "mkdocs.yml"),
                        "-d", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


@needs_mkdocs
def test_key_pages_and_the_delta_rule_api_page_exist(site):
    for page in ("index.html", "getting_started/index.html", "concepts/index.html", "delta_rule/index.html",
                 "mixers/index.html", "results/index.html", "results/mad/index.html", "stability/index.html",
                 "changelog/index.html", "fla_import/index.html", "api/index.html", "search/search_index.json"):
        assert (site / page).is_file(), page
    api = _parse(site / "api/delta_rule/index.html")
    assert "linattn.delta_rule" in api.ids          # mkdocstrings' anchor of the function's heading
    html = (site / "api/delta_rule/index.html").read_text(encoding="utf-8")
    for section in ("Parameters:", "Returns:"):     # the Google-style sections rendered, not left as text
        assert section in html, section
    # an operator whose module has its name (ops/comba.py's comba) must render as the function, not the module
    for page in ("linear_attention", "delta_rule", "test_time", "softmax_family"):
        assert "doc-symbol-module" not in (site / "api" / page / "index.html").read_text(encoding="utf-8"), page
    # the changelog page includes CHANGELOG.md itself (a snippet), not a copy
    assert "Keep a Changelog" in (site / "changelog/index.html").read_text(encoding="utf-8")


@needs_mkdocs
def test_every_internal_link_and_anchor_resolves(site):
    # 404.html is served at any depth, so mkdocs writes its links absolute (from the site root): skip it
    pages = {p: _parse(p) for p in site.rglob("*.html") if p.name != "404.html" or p.parent != site}
    broken = []
    for page, parsed in pages.items():
        for tag, link in parsed.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
                continue
            target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {link}")
                continue
            if parts.fragment and target.suffix == ".html" and tag == "a":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{page.relative_to(site)}: {link} (no such anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken[:40])


@needs_mkdocs
def test_the_site_loads_nothing_from_the_network(site):
    external = re.compile(r"<(?:script|link|img)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.I)
    offenders = [str(p.relative_to(site)) for p in site.rglob("*.html") if external.search(p.read_text("utf-8"))]
    assert not offenders, f"pages that load a script, style or image from the network: {offenders[:10]}"
    assert not any("fonts.googleapis" in p.read_text("utf-8") for p in site.rglob("*.html"))


def test_no_internal_issue_numbers_in_the_results_pages_or_the_readme():
    pattern = re.compile(r"\bissues? #?\d+|(?<![\w/&])#\d{1,3}\b", re.I)
    files = [ROOT / "README.md", *sorted((ROOT / "docs" / "results").glob("*.md"))]
    assert len(files) > 10
    hits = [f"{f.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for f in files
            for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)


def test_links_into_the_old_results_page_are_gone():
    """docs/results.md became docs/results/ (a summary page, then one page per study): nothing may point at it."""
    assert not (ROOT / "docs" / "results.md").exists()
    stale = []
    for top in ("src", "tests", "docs"):
        for f in (ROOT / top).rglob("*"):
            if f.suffix in (".py", ".md") and "records" not in f.parts and f.name != "test_site.py":
                if "docs/results.md" in f.read_text(encoding="utf-8", errors="replace"):
                    stale.append(str(f.relative_to(ROOT)))
    for f in ("README.md", "CONTRIBUTING.md", "mkdocs.yml"):
        if "results.md" in (ROOT / f).read_text(encoding="utf-8").replace("`results.md`", ""):
            stale.append(f)
    assert not stale, stale


def test_results_pages_and_their_links_carry_no_old_section_numbers():
    """The results pages were once one numbered page (1-16, with gaps): their titles, headings, nav entries and
    the links to them name what they are, not a number (a paper's "section 5.2" stays)."""
    heading = re.compile(r"^#{1,4} \d{1,2}[a-e]?\. ", re.M)
    reference = re.compile(r"\b(?:[Ss]ections?|results) \d{1,2}[a-e]?\b(?![.\d])|\[\d{1,2}[a-e]?\]\(|\(\d{1,2}[a-e]\)")
    hits = []
    for f in sorted((ROOT / "docs").rglob("*.md")):
        if "records" in f.parts:
            continue
        text = f.read_text(encoding="utf-8")
        hits += [f"{f.relative_to(ROOT)}: {m.group(0)!r}" for m in heading.finditer(text)]
        hits += [f"{f.relative_to(ROOT)}: {m.group(0)!r}" for m in reference.finditer(text)]
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    hits += [f"mkdocs.yml: {line.strip()}" for line in nav.splitlines() if re.match(r"\s*- \d+[a-e]?\. ", line)]
    assert not hits, "\n".join(hits)


def _environment_reads(path: Path) -> set:
    """The environment variables a module reads: `os.environ.get(X)`, `os.environ[X]` (loading), `X in os.environ`,
    `os.getenv(X)`, where X is a string, a module-level string constant or the variable of a `for` over a tuple
    of strings. (Variables set for a child process, `dict(os.environ, X=...)`, are not reads.)"""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
              and isinstance(n.value.value, str) for t in n.targets if isinstance(t, ast.Name)}
    loops = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.For) and isinstance(n.target, ast.Name) and isinstance(n.iter, (ast.Tuple, ast.List)):
            loops[n.target.id] = [e.value for e in n.iter.elts if isinstance(e, ast.Constant)]

    def values(arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return [arg.value]
        if isinstance(arg, ast.Name):
            return [consts[arg.id]] if arg.id in consts else loops.get(arg.id, [])
        return []

    def is_environ(n):  # os.environ, or a parameter named environ that defaults to it
        return (isinstance(n, ast.Attribute) and n.attr == "environ") or (isinstance(n, ast.Name) and n.id == "environ")

    found = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args and (
                (n.func.attr == "get" and is_environ(n.func.value)) or n.func.attr == "getenv"):
            found.update(values(n.args[0]))
        elif isinstance(n, ast.Subscript) and is_environ(n.value) and isinstance(n.ctx, ast.Load):
            found.update(values(n.slice))
        elif isinstance(n, ast.Compare) and any(is_environ(c) for c in n.comparators):
            found.update(values(n.left))
    return found


def test_the_switches_page_documents_every_variable_the_code_reads_and_only_those():
    """docs/environment.md names every environment variable src/linattn reads, and every `LINATTN_*` variable
    it names is read by src/linattn (fla's `FLA_*` ones by the installed fla, when there is one)."""
    page = (ROOT / "docs" / "environment.md").read_text(encoding="utf-8")
    read = set().union(*(_environment_reads(f) for f in (ROOT / "src" / "linattn").rglob("*.py")))
    assert {"LINATTN_CPU_KERNELS", "LINATTN_CACHE_DIR", "LINATTN_CHECKS", "TRITON_INTERPRET", "CC"} <= read, read
    assert not [v for v in sorted(read) if f"`{v}`" not in page], "read by src/linattn, missing from the page"
    documented = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)`", page, re.M))
    documented |= set(re.findall(r"`(LINATTN_[A-Z0-9_]+)", page))
    assert not [v for v in sorted(documented) if v.startswith("LINATTN_") and v not in read], "documented, never read"
    spec = importlib.util.find_spec("fla")
    if spec is not None and spec.origin:
        fla_files = Path(spec.origin).parent.rglob("*.py")
        fla_src = " ".join(p.read_text(encoding="utf-8", errors="replace") for p in fla_files)
        assert not [v for v in sorted(documented) if v.startswith("FLA_") and f'"{v}"' not in fla_src]


@needs_mkdocs
def test_contributing_and_the_switches_page_are_on_the_site_and_code_blocks_wrap(site):
    contributing = (site / "contributing/index.html").read_text(encoding="utf-8")
    for heading in ("House rules", "Recipes", "A new operator", "A new mixer"):    # CONTRIBUTING.md itself, included
        assert heading in contributing, heading
    switches = (site / "environment/index.html").read_text(encoding="utf-8")
    assert "LINATTN_CPU_KERNELS" in switches and "Troubleshooting" in switches
    # long code lines wrap rather than run out of a 1280 px window (column-aligned blocks opt out, and scroll)
    assert 'href="../stylesheets/extra.css"' in switches
    css = (site / "stylesheets/extra.css").read_text(encoding="utf-8")
    assert re.search(r"\.md-typeset pre > code \{[^}]*white-space: pre-wrap", css)
    assert re.search(r"\.md-typeset \.scroll pre > code \{[^}]*white-space: pre;", css)
    index = (site / "search/search_index.json").read_text(encoding="utf-8")
    assert '"location":"environment/' in index.replace(" ", "")


def test_every_markdown_list_starts_after_a_blank_line():
    """Python-Markdown (unlike GitHub) renders a list that follows a paragraph line directly as text of that
    paragraph, with its `*` markers visible."""
    marker = re.compile(r"^(\* |- |\d+\. )")
    bad = []
    for f in [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"]:
        if "records" in f.parts:
            continue
        fence, prev = False, ""
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if re.match(r"\s*(```|~~~)", line):
                fence = not fence
            elif (not fence and marker.match(line) and prev.strip() and not marker.match(prev.lstrip())
                  and not prev.startswith(("  ", "|", "#", "!!!", "<", ">"))):
                bad.append(f"{f.relative_to(ROOT)}:{i}: {line[:60]}")
            prev = line
    assert not bad, "lists glued to the paragraph above (add a blank line):\n" + "\n".join(bad)


def test_the_tested_transformers_versions_have_one_source():
    """docs/transformers.md states which transformers versions are tested; the README and pyproject.toml repeat
    exactly those, and no other page or docstring names tested versions of its own."""
    stated = re.compile(r"tested with (?:transformers )?(\d+\.\d+(?:\.\d+)?(?:(?:, | and )\d+\.\d+(?:\.\d+)?)*)", re.I)

    def versions(text):
        return [tuple(re.findall(r"\d+\.\d+(?:\.\d+)?", m.group(1))) for m in stated.finditer(text)]

    source = versions((ROOT / "docs" / "transformers.md").read_text(encoding="utf-8"))
    assert len(source) == 1 and len(source[0]) >= 1, source
    for f in ("README.md", "pyproject.toml"):
        assert versions((ROOT / f).read_text(encoding="utf-8")) == source, f
    others = [f for f in [*(ROOT / "docs").rglob("*.md"), *(ROOT / "src").rglob("*.py")]
              if "records" not in f.parts and f.name != "transformers.md" and versions(f.read_text(encoding="utf-8"))]
    assert not others, [str(f.relative_to(ROOT)) for f in others]
