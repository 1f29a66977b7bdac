"""matplotlib is the optional `plots` extra: without it, benchmarks and experiments write their tables and
JSON and skip the PNG figures with one notice line (tested by blocking the import)."""
import argparse
import subprocess
import sys

import pytest

from linattn.experiments.common import Experiment
from linattn.plotting import MISSING, matplotlib_missing, save_figure


@pytest.fixture
def no_matplotlib(monkeypatch):
    """`import matplotlib` raises ImportError (a None entry in sys.modules blocks the import)."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def _draw(path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1))
    FigureCanvasAgg(fig)
    fig.savefig(path)


def test_save_figure(tmp_path):
    pytest.importorskip("matplotlib")
    assert not matplotlib_missing()
    assert save_figure(tmp_path / "a.png", _draw) == str(tmp_path / "a.png")
    assert (tmp_path / "a.png").read_bytes()[:4] == b"\x89PNG"

    def broken(path):
        raise RuntimeError("no room")

    assert save_figure(tmp_path / "b.png", broken) == "(plot failed: RuntimeError: no room)"


def test_save_figure_without_matplotlib(tmp_path, no_matplotlib):
    assert matplotlib_missing()
    assert save_figure(tmp_path / "a.png", _draw) == MISSING and not (tmp_path / "a.png").exists()


def test_experiment_outputs_without_matplotlib(tmp_path, no_matplotlib, capsys):
    args = argparse.Namespace(out=str(tmp_path / "x"), resume=False, overwrite=False)
    exp = Experiment("demo-exp", args, {"a": 1})
    drawn = []
    paths = exp.write_outputs({"s": 1}, [], "# results", {"one": drawn.append, "two": drawn.append})
    assert drawn == [] and set(paths) == {"markdown", "json"} and not list(exp.root.glob("*.png"))
    md = (exp.root / "results.md").read_text()
    assert md.count(MISSING) == 1 and md.startswith("# results")
    assert capsys.readouterr().err == f"[linattn] {MISSING}\n"


def test_benchmark_without_matplotlib(tmp_path):
    """`linattn bench ops` in a process where matplotlib cannot be imported: the report and the JSON, no PNG,
    and the notice once in the line that lists the files."""
    code = ("import sys; sys.modules['matplotlib'] = None; from linattn.cli import main; "
            "sys.exit(main(['bench', 'ops', '--T', '64', '--repeats', '1', '--warmup', '0', '--min-time', '0', "
            "'--matmul-n', '64', '--families', 'softmax', '--passes', 'fwd', '--no-memory', '--quiet', "
            f"'--out', {str(tmp_path)!r}]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert {p.name for p in tmp_path.iterdir()} == {"ops.json", "ops.txt"}
    assert (run.stdout + run.stderr).count(MISSING) == 1
    assert [ln for ln in run.stdout.splitlines() if MISSING in ln][0].startswith("wrote ")
