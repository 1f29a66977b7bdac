"""`linattn bench gpu` (issues 32, 44): the prepared GPU run.

The dry run does every step on CPU under Triton's interpreter, in a child process in which the
packages a bare GPU machine lacks (tqdm, safetensors, tokenizers, matplotlib, transformers) cannot
be imported, started the way the runbook starts it (`PYTHONPATH=src python -m linattn bench gpu`).
The budget logic (a step cut short, a step that fails, reports rewritten after every step) is tested
in-process with stand-in steps, so nothing here depends on the machine's speed.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from linattn.bench import BENCHMARKS, gpu
from linattn.cli_support import UsageError

ROOT = Path(__file__).resolve().parents[2]
SRC = str(ROOT / "src")
MISSING_ON_GPU_BOX = ("tqdm", "safetensors", "tokenizers", "matplotlib", "transformers")

# sys.modules[name] = None makes `import name` raise ImportError and find_spec(name) return None,
# as on a machine where the package is not installed
CHILD = f"""
import sys, runpy
for name in {MISSING_ON_GPU_BOX!r}:
    sys.modules[name] = None
sys.argv = ["linattn"] + sys.argv[1:]
runpy.run_module("linattn", run_name="__main__")
"""


def _bench_gpu(*argv, timeout=600):
    env = dict(os.environ, PYTHONPATH=SRC)
    env.pop("TRITON_INTERPRET", None)  # the command itself must turn the interpreter on
    return subprocess.run([sys.executable, "-c", CHILD, "bench", "gpu", *argv], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_registered():
    assert BENCHMARKS["gpu"][0] == "linattn.bench.gpu"


def test_dry_run_every_step_without_optional_packages(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "gpu"
    # a generous budget: the test checks that every step runs and passes, not how fast (a loaded machine's
    # interpreter may need far more than the default's shares; the budget logic has its own tests). The wheels
    # are the committed ones, imported without installing them (what the GPU machine does).
    r = _bench_gpu("--out", str(out), "--dry-run", "--quiet", "--budget-min", "60", "--steps", *gpu.STEPS,
                   "--wheels", str(ROOT / "wheels"), timeout=3600)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads((out / "gpu.json").read_text())
    assert d["status"] == "finished" and d["config"]["dry_run"]
    assert {n: s["status"] for n, s in d["steps"].items()} == {n: "done" for n in gpu.STEPS}, d["steps"]
    notes = d["config"]["notes"]
    assert "fla ops: 0.6.0; ops import" in notes and any(n.startswith("fla models: not importable") for n in notes)
    m = d["steps"]["machine"]
    assert m["info"]["versions"]["triton"] and m["matmul"]["bfloat16"]["gflops"] > 0 and m["copy"]["GB_per_s"] > 0
    # every kernel family ran against the PyTorch forms, within the documented tolerances; what a backend does
    # not take is listed as not covered, with its reason, never passed
    cases = d["steps"]["correctness"]["cases"]
    assert {c["case"].split()[0] for c in cases} == set(gpu.OPS) | set(gpu.GVA_OPS) | set(gpu.GROUPED_OPS)
    ok = [c for c in cases if c["status"] == "ok"]
    uncovered = [c for c in cases if c["status"] == "not covered"]
    assert len(ok) + len(uncovered) == len(cases) and all(c["max_err"] <= c["tol"] for c in ok)
    assert {c["case"].split()[0] for c in uncovered if "[triton]" in c["case"]} == {"gla-chunk"}
    assert all("falling back" in c["note"] or "CUDA" in c["note"] or "device" in c["note"] for c in uncovered)
    assert d["counts"] == {"passed": len(ok) + 1, "failed": 0, "not_covered": len(uncovered), "errors": 0}
    assert any("varlen" in c["case"] for c in ok) and any("no-gate" in c["case"] for c in ok)
    assert any(k.startswith("d") for c in ok for k in c["errors"])  # gradients were compared
    assert [x["run"] for x in d["steps"]["sanitizer"]["runs"]] == ["script (no sanitizer)"]
    tim = d["steps"]["timing"]["cases"]
    ran = {(c["op"], c["impl"]) for c in tim if c["status"] == "ok"}
    for op in ("linear", "deltanet", "gated-deltanet", "efla", "kda"):
        assert {(op, "triton"), (op, "auto")} <= ran
    assert ("sdpa", "sdpa") in ran and d["steps"]["timing"]["targets"]["rows"]
    assert all(c["fwd_ms"] > 0 and c["fwdbwd_ms"] > 0 for c in tim if c["status"] == "ok")
    lm = {c["model"]: c for c in d["steps"]["lm"]["cases"]}
    assert [k for k, c in lm.items() if c["status"] == "ok"] == [k for k, m in gpu.LM_ROWS if m is not None]
    assert lm["fla GatedDeltaNet"]["status"] == "skipped" and "transformers" in lm["fla GatedDeltaNet"]["note"]
    scaling = d["steps"]["cpu-scaling"]["cases"]
    assert {(c["op"], c["threads"]) for c in scaling} >= {("linear", 1), ("gated-deltanet", 1)}
    assert all(c["status"] == "ok" and c["fwd_ms"] > 0 for c in scaling)
    assert (out / "triton-cache.tar.gz").is_file() and "packed" in d["config"]["triton_cache"]
    md = (out / "gpu.md").read_text()
    for name in gpu.STEPS:
        assert f". {name}:" in md
    # the command never overwrites a report unless told to
    with pytest.raises(UsageError, match="--overwrite"):
        gpu.run(_Args(out, steps=["machine"]))


def test_bad_arguments(tmp_path):
    bad = ((dict(steps=["machine", "warp"]), "--steps"), (dict(budget_min=0.0), "--budget-min"),
           (dict(budget_min=float("nan")), "--budget-min"))
    for kw, word in bad:
        with pytest.raises(UsageError, match=word):
            gpu.run(_Args(tmp_path / "x", **kw))
    if not torch.cuda.is_available():
        args = _Args(tmp_path / "y")
        args.dry_run = False
        with pytest.raises(UsageError, match="--dry-run"):
            gpu.run(args)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_gpu_plan_covers_the_issue_grid():
    from linattn.ops.backend import BACKENDS

    plan = gpu.gpu_plan()
    assert plan["backends"][-1] == "triton" and ("fla" in plan["backends"]) == ("fla" in BACKENDS)
    cases = gpu.correctness_cases(plan)
    plain = [c for c in cases if not c["varlen"] and c["gate"] and c["state"]]
    for be in plan["backends"]:
        for op in gpu.OPS:
            grid = {(c["K"], c["dtype"], c["T"]) for c in plain if c["op"] == op and c["backend"] == be}
            Ts = (1, 65, 2048)  # decoding forms too: up to rec_max_T = 2048
            want = {(128, dt, T) for dt in (torch.float32, torch.bfloat16) for T in Ts}
            want |= {(64, dt, T) for dt in (torch.float32, torch.bfloat16) for T in Ts if T != 1}
            assert grid == want, (op, be)
            assert any(c["varlen"] and c["op"] == op and c["backend"] == be for c in cases)
        for op in gpu.GVA_OPS:  # grouped value heads through the public API, both dtypes, packed too
            assert {(c["dtype"], c["varlen"]) for c in cases if c["op"] == op and c["backend"] == be} == {
                (dt, vl) for dt in (torch.float32, torch.bfloat16) for vl in (False, True)}
    assert all(c["T"] <= plan["rec_max_T"] for c in cases if c["op"].endswith("recurrent"))
    for op in gpu.GROUPED_OPS:  # the Triton entry points' grouped heads
        assert {(c["backend"], c["dtype"], c["varlen"]) for c in cases if c["op"] == op} == {
            ("triton", dt, vl) for dt in (torch.float32, torch.bfloat16) for vl in (False, True)}
    lens = plan["varlen"]
    assert min(lens) == 1 and len(set(lens)) == len(lens) and plan["B"] == 4 and plan["H"] == 16
    # the cheapest round first: every kernel of every backend compiles before the long sequences run
    first = len(gpu.OPS) * len(plan["backends"]) * 2
    assert {(c["op"], c["backend"]) for c in cases[:first]} == {(o, b) for o in gpu.OPS for b in plan["backends"]}
    assert cases[0]["T"] == 65 and max(c["T"] for c in cases[:first]) == 65
    tp = plan["time"]
    assert (tp["B"] * tp["H"], tp["K"], tp["V"], tp["dtype"]) == (64, 128, 128, torch.bfloat16)
    assert tp["Ts"][0] == 8192 and sorted(tp["Ts"]) == [2048, 8192, 32768]
    impls = {(c["op"], c["impl"]) for c in gpu.timing_cases(plan)}
    for op, fn in (("linear", "chunk_simple_gla"), ("deltanet", "chunk_delta_rule"),
                   ("gated-deltanet", "chunk_gated_delta_rule"), ("kda", "chunk_kda")):
        assert {(op, "auto"), (op, f"fla:{fn}"), (op, "triton")} <= impls
    assert ("sdpa", "flash") in impls
    lm = plan["lm"]
    assert (lm["n_layers"], lm["d_model"], lm["T"]) == (12, 1024, 8192)
    assert [m for _, m in gpu.LM_ROWS[:3]] == ["gated-deltanet", "softmax", None]
    cp = plan["cpu"]
    assert (cp["T"], cp["B"], cp["H"], cp["threads"]) == (16384, 1, 16, (1, 2, 4, 8, 16))
    assert gpu.STEPS[:5] == ("machine", "correctness", "timing", "lm", "cpu-scaling")
    assert "sanitizer" not in gpu.DEFAULT_STEPS


def test_chunk_flops():
    # linear: 2C(K+V) + 4KV per token and head; the delta rule adds 2C(2K+V) + 2KV; SDPA causal T^2 (K+V)
    assert gpu.chunk_flops("linear", 1, 10, 1, 2, 3, C=4) == 10 * (2 * 4 * 5 + 4 * 6)
    assert gpu.chunk_flops("delta", 1, 10, 1, 2, 3, C=4) == 10 * (2 * 4 * 5 + 4 * 6 + 2 * 4 * 7 + 2 * 6)
    assert gpu.chunk_flops("sdpa", 2, 10, 3, 4, 4) == 2 * 3 * 100 * 8


class _Args:
    def __init__(self, out, steps=gpu.STEPS, budget_min=1.0):
        self.out, self.steps, self.budget_min = str(out), list(steps), budget_min
        self.dry_run, self.overwrite, self.quiet, self.wheels, self.triton_cache = True, False, True, None, None


def test_budget_failures_and_reports_after_every_step(tmp_path, monkeypatch):
    """A failing step is recorded and the run goes on; a step cut by the budget stops the run, and the
    steps after it are listed as skipped with the reason; the files are rewritten after every step."""
    seen = []

    def machine(ctx, rec, deadline):
        rec["table"] = {"headers": ["what", "value"], "rows": [["device", "stand-in"]]}

    def correctness(ctx, rec, deadline):
        # the report on disk already shows the previous step done, and this one running
        d = json.loads((tmp_path / "gpu.json").read_text())
        seen.append((d["steps"]["machine"]["status"], d["steps"]["correctness"]["status"]))
        raise RuntimeError("kernel exploded")

    def timing(ctx, rec, deadline):
        rec["partial"] = True  # its share ran out: the step says so and the run goes on

    def lm(ctx, rec, deadline):
        raise gpu.BudgetExceeded("the run's budget of 60 s ran out")

    def never(ctx, rec, deadline):
        raise AssertionError("must not run after the budget ran out")

    monkeypatch.setattr(gpu, "STEP_FNS", {"machine": machine, "correctness": correctness, "timing": timing,
                                          "lm": lm, "cpu-scaling": never, "sanitizer": never})
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    rc = gpu.run(_Args(tmp_path))
    assert rc == 1
    assert seen == [("done", "running")]
    d = json.loads((tmp_path / "gpu.json").read_text())
    st = {n: s["status"] for n, s in d["steps"].items()}
    assert st == {"machine": "done", "correctness": "error", "timing": "partial", "lm": "cut",
                  "cpu-scaling": "skipped", "sanitizer": "skipped"}
    assert "kernel exploded" in d["steps"]["correctness"]["error"]
    assert "budget" in d["steps"]["sanitizer"]["reason"] and d["status"] == "cut short"
    assert d["counts"] == {"passed": 0, "failed": 0, "not_covered": 0, "errors": 1}
    md = (tmp_path / "gpu.md").read_text()
    assert "kernel exploded" in md and "status **cut short**" in md and "| device | stand-in |" in md


def test_steps_outside_the_budget_are_skipped(tmp_path, monkeypatch):
    """--steps selects steps; a budget already spent skips the rest, each with its reason."""
    calls = []
    fns = {n: (lambda ctx, rec, deadline, n=n: calls.append(n)) for n in gpu.STEPS}
    monkeypatch.setattr(gpu, "STEP_FNS", fns)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    assert gpu.run(_Args(tmp_path / "a", steps=["machine", "lm"])) == 0
    d = json.loads((tmp_path / "a" / "gpu.json").read_text())
    assert calls == ["machine", "lm"]
    assert d["steps"]["timing"] == {"status": "skipped", "reason": "not in --steps"}
    calls.clear()
    assert gpu.run(_Args(tmp_path / "b", budget_min=0.001)) == 0  # 0.06 s: nothing fits, nothing failed
    d = json.loads((tmp_path / "b" / "gpu.json").read_text())
    assert d["status"] == "incomplete" and calls == [] and all(s["status"] == "skipped" and "did not fit" in s["reason"]
                               for s in d["steps"].values())


def test_fla_ops_import_without_fla_init(tmp_path, monkeypatch):
    """fla/__init__.py imports transformers (absent on the GPU machine): the bench imports fla's op
    modules without running it, and reports the ops that do not import, each with its reason."""
    root = tmp_path / "fla"
    (root / "ops" / "simple_gla").mkdir(parents=True)
    (root / "__init__.py").write_text("import transformers_is_not_here\n")
    (root / "ops" / "__init__.py").write_text("")
    (root / "ops" / "simple_gla" / "__init__.py").write_text(
        "def chunk_simple_gla(q, k, v, g=None, **kw):\n    return v * 2, None\n")
    (root / "ops" / "kda.py").write_text("import einops_is_not_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        fns = gpu.fla_fns()
        assert fns["chunk_simple_gla"](None, None, 3)[0] == 6
        assert isinstance(fns["chunk_kda"], ImportError) and "einops_is_not_here" in str(fns["chunk_kda"])
        assert isinstance(fns["chunk_delta_rule"], ImportError)
        assert "ops import" not in gpu.versions()["fla"] and "einops_is_not_here" in gpu.versions()["fla"]
    finally:
        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            del sys.modules[name]


def test_wheels_unpacked_onto_sys_path(tmp_path, monkeypatch):
    """--wheels DIR: pure-Python wheels used without installing them (the GPU machine has no network)."""
    import zipfile

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "linattn_fake_dep-0.1-py3-none-any.whl", "w") as z:
        z.writestr("linattn_fake_dep/__init__.py", "ANSWER = 42\n")
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert gpu.use_wheels(str(wheels)) == ["linattn_fake_dep-0.1-py3-none-any.whl"]
    import linattn_fake_dep

    assert linattn_fake_dep.ANSWER == 42
    del sys.modules["linattn_fake_dep"]
    with pytest.raises(UsageError, match="no \\*.whl"):
        gpu.use_wheels(str(tmp_path))
