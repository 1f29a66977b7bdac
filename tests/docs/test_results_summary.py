"""The results summary (docs/results/index.md) cannot go stale: every measured number on it is on the study page
it links to, and its CPU-speed numbers are those of the newest committed benchmark records
(docs/records/bench-cpu-*/), recomputed here from the record tables. A new record folder, or a study page
re-measured without its summary line, fails these tests until the summary is brought up to date."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
RECORDS = ROOT / "docs" / "records"
SUMMARY = RESULTS / "index.md"

# a measured value: has a decimal point or an exponent (plain integers are sizes, counts and dates)
MEASURED = re.compile(r"(?<![\w.])\d+\.\d+(?:e[-+]?\d+)?|(?<![\w.])\d+e[-+]?\d+")
LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")
# the summary's row label -> the op's name in `linattn bench ops` tables
CPU_OPS = {"linear attention (elu+1)": "linear elu+1", "DeltaNet": "DeltaNet", "Gated DeltaNet": "Gated DeltaNet",
           "EFLA": "EFLA"}


def _blocks(text: str):
    """(text, links) per paragraph, list item and table row; a table row without links of its own takes the
    links of the paragraph just above its table."""
    out, above = [], []
    for para in re.split(r"\n\s*\n", text):
        lines = para.strip().splitlines()
        if lines and all(line.lstrip().startswith("|") for line in lines):
            for row in lines:
                out.append((row, LINK.findall(row) or above))
        else:
            above = LINK.findall(para)
            out.append((para, above))
    return out


def _section(text: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"the summary has no section {title!r}"
    return m.group(1)


def test_every_measured_number_of_the_summary_is_on_the_page_it_links():
    text = SUMMARY.read_text(encoding="utf-8")
    missing = []
    for title in ("Every claim's verdict", "Headline numbers"):
        for block, links in _blocks(_section(text, title)):
            numbers = MEASURED.findall(block)
            if not numbers:
                continue
            assert links, f"a block of measured numbers with no study page linked: {block[:120]!r}"
            pages = " ".join((RESULTS / link).read_text(encoding="utf-8") for link in links)
            missing += [f"{n} (in {block.strip()[:70]!r}..., pages {links})" for n in numbers
                        if not re.search(rf"(?<![\d.]){re.escape(n)}(?!\d)", pages)]
    assert not missing, "numbers of the summary that are not on their study page:\n" + "\n".join(missing)


def _newest_cpu_records() -> Path:
    folders = sorted(p for p in RECORDS.glob("bench-cpu-*") if p.is_dir())
    assert folders, f"no bench-cpu-* records under {RECORDS}"
    return folders[-1]


def _header(table: str, key: str) -> str:
    m = re.search(rf"^{key}\s+(.*)$", table, re.M)
    assert m, f"no {key!r} line in a record's header"
    return m.group(1)


def _ops_ratios(folder: Path, T: int = 16384) -> dict:
    """(op, pass) -> the speed-ups over SDPA (as printed) of the compiled CPU kernels at T, in every 1-thread
    `bench ops` record of the folder, at the shape the summary states."""
    ratios = {}
    for f in sorted(folder.glob("ops-*.txt")):
        table = f.read_text(encoding="utf-8")
        if " 1 threads" not in _header(table, "torch") or not _header(table, "shape").startswith("B=1 H=4 K=64 V=64 "):
            continue
        for m in re.finditer(rf"^{T}\s+(.+?) chunk \[cpu\]\s+(fwd\+bwd|fwd)\s.*?\s(\d+(?:\.\d+)?)x\s", table, re.M):
            ratios.setdefault((m.group(1).strip(), m.group(2)), []).append(m.group(3))
    return ratios


def _span(values) -> str:
    lo, hi = min(values, key=float), max(values, key=float)
    return f"{lo}x" if float(lo) == float(hi) else f"{lo}-{hi}x"


def _cpu_paragraph(text: str) -> str:
    section = _section(text, "Headline numbers")
    m = re.search(r"^\*\*Speed on one CPU thread.*?(?=^\*\*(?!Speed))", section, re.M | re.S)
    assert m, "the summary's headline numbers have no 'Speed on one CPU thread' part"
    return m.group(0)


def test_the_summary_cites_the_newest_cpu_records():
    newest = _newest_cpu_records()
    assert f"docs/records/{newest.name}/" in _cpu_paragraph(SUMMARY.read_text(encoding="utf-8")), (
        f"{newest.name} is the newest CPU benchmark record: bring the summary's CPU numbers up to date with it")


def test_the_summary_cpu_table_is_the_newest_records():
    rows = {}
    for line in _cpu_paragraph(SUMMARY.read_text(encoding="utf-8")).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0] in CPU_OPS:
            rows[cells[0]] = cells[1:]
    assert set(rows) == set(CPU_OPS), f"the CPU table's rows: {sorted(rows)}"
    ratios = _ops_ratios(_newest_cpu_records())
    for label, op in CPU_OPS.items():
        for cell, pass_ in zip(rows[label], ("fwd", "fwd+bwd")):
            assert (op, pass_) in ratios, f"no 1-thread T = 16384 record of {op} {pass_}"
            assert cell == _span(ratios[(op, pass_)]), (label, pass_, cell, ratios[(op, pass_)])


def test_the_summary_decode_and_training_numbers_are_the_newest_records():
    folder, para = _newest_cpu_records(), _cpu_paragraph(SUMMARY.read_text(encoding="utf-8"))
    assert (folder / "decode.txt").is_file() and list(folder.glob("train*.txt")), (
        f"{folder.name} has no decode.txt / train*.txt: a CPU record folder holds every table the summary quotes")
    decode = (folder / "decode.txt").read_text(encoding="utf-8")
    # the whole-model step of every linear mixer: softmax and the per-block / PyTorch comparison rows left out
    rows = [line.split() for line in decode.splitlines() if re.match(r"^[a-z][\w.+-]*(\s+\S+){7}\s*$", line)]
    steps = [row[-2] for row in rows if row[1].isdigit() and row[0] != "softmax"
             and not row[0].endswith(("+block", "+torch"))]
    assert steps, "no decode rows in the record"
    assert f"{_span(steps)} the matrix-vector floor" in para, _span(steps)
    for f in sorted(folder.glob("train*.txt")):
        table = f.read_text(encoding="utf-8")
        seq = re.search(r"seq (\d+)", _header(table, "models")).group(1)
        ratio = {line.split()[0]: line.split()[-1] for line in table.splitlines() if line.endswith("x")}
        expected = (f"seq {seq}: Gated DeltaNet {ratio['gated-deltanet']}, linear attention {ratio['linear-elu+1']}"
                    + (f", a mixer that does nothing {ratio['free-mixer']}" if "free-mixer" in ratio else ""))
        assert expected in " ".join(para.split()), expected


@pytest.mark.parametrize("values, expected", [(["42.5", "60.8", "44.8"], "42.5-60.8x"), (["7.0", "7.0"], "7.0x"),
                                              (["9.5", "10.1"], "9.5-10.1x")])
def test_span_is_the_range_as_printed(values, expected):
    assert _span(values) == expected
