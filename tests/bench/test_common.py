"""The CLI and the benchmark infrastructure, on tiny sizes (no timing assertions)."""
import json
import runpy
import sys

import pytest
import torch

from linattn import cli
from linattn.bench import BENCHMARKS, common, ops


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    """Tiny cases are dominated by thread hand-offs on a busy machine: run them on one thread
    (also in the memory worker, through OMP_NUM_THREADS). Nothing here asserts a timing."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(n)


TINY = ["--T", "64", "128", "--repeats", "1", "--warmup", "0", "--min-time", "0", "--matmul-n", "64",
        "--max-T-recurrent", "64", "--max-T-recurrent-bwd", "64", "--quiet"]


def test_parser_knows_every_command():
    parser = cli.build_parser()
    args = parser.parse_args(["bench", "ops", "--T", "64"])
    assert args.command == "bench" and args.name == "ops" and args.args == ["--T", "64"]
    assert parser.parse_args(["demo", "--skip-bench"]).skip_bench
    assert "ops" in BENCHMARKS


@pytest.mark.parametrize("argv, needle", [
    ([], "a command is required"),
    (["nonsense"], "invalid choice"),
    (["bench"], "which benchmark"),
    (["bench", "nosuchbench"], "unknown benchmark"),
    (["bench", "ops", "--T", "x"], "--T"),
    (["bench", "ops", "--T", "0"], "--T"),
    (["bench", "ops", "--families", "linear,bogus"], "--families"),
    (["bench", "ops", "--device", "tpu"], "--device"),
    (["bench", "ops", "--unknown-flag"], "unrecognized"),
])
def test_bad_arguments_exit_2_with_one_line(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("linattn") and "error:" in err
    assert needle in err


def test_bench_ops_end_to_end(tmp_path, capsys):
    out = tmp_path / "o"
    # small heads (K != V, so a formula with the two swapped fails): MesaNet's and TTT's inner loops cost K^2 per token
    assert cli.main(["bench", "ops", *TINY, "--H", "2", "--K", "16", "--V", "8", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    for section in ("results", "skipped", "notes", "targets", "T = 16384"):
        assert section in stdout
    assert {p.name for p in out.iterdir()} == {"ops.json", "ops.png", "ops.txt"}
    report = json.loads((out / "ops.json").read_text())
    assert report["machine"]["torch"] == torch.__version__ and report["matmul"]["gflops"] > 0
    done = {(r["op"], r["mode"], r["pass"], r["T"]) for r in report["results"] if "ms" in r}
    assert ("linear", "chunk", "fwd", 128) in done and ("softmax", "sdpa", "fwdbwd", 128) in done
    assert ("linear", "recurrent", "fwd", 64) in done
    skipped = {(s["op"], s["mode"], s["pass"], s["T"]) for s in report["skipped"]}
    assert ("linear", "recurrent", "fwd", 128) in skipped  # capped, reported, not extrapolated
    lin = next(r for r in report["results"] if r["op"] == "linear" and r["mode"] == "chunk" and r["T"] == 128)
    assert lin["chunk_size"] == 64 and lin["chunk_size_used"] == 64  # elu+1 on the PyTorch path: as asked
    assert lin["flops"] == 4 * 1 * 2 * 128 * 16 * (64 + 8)  # 4*B*H*T*K*(C+V)
    assert report["chunk_size"]["requested"] == 64 and report["chunk_size"]["used"]["linear"] == [64]
    assert lin["peak_bytes"] is None or lin["peak_bytes"] >= 0
    assert len(report["targets"]) >= 3 and all(t["measured"] is None for t in report["targets"])
    assert (out / "ops.png").read_bytes()[:4] == b"\x89PNG"

    # a second run never overwrites: it writes a timestamped name next to the first
    assert cli.main(["bench", "ops", *TINY, "--T", "64", "--families", "softmax", "--passes", "fwd",
                     "--no-memory", "--out", str(out)]) == 0
    assert len(list(out.glob("ops-*.json"))) == 1 and json.loads((out / "ops.json").read_text()) == report


def test_targets_are_computed_from_measurements():
    class A:
        T, families, modes, passes = [16384], ["linear", "delta", "softmax"], ["chunk", "recurrent"], ["fwd"]

    def row(op, mode, ps, ms, gflops=0.0):
        return {"T": 16384, "op": op, "mode": mode, "pass": ps, "ms": ms, "gflops": gflops}

    results = [row("softmax", "sdpa", "fwd", 100.0), row("linear", "chunk", "fwd", 2.0, gflops=50.0),
               row("deltanet", "chunk", "fwd", 10.0), row("deltanet", "recurrent", "fwd", 150.0)]
    t = {x["target"]: x for x in ops.compute_targets(results, [], A, {"gflops": 100.0, "dtype": "float32"})}
    fwd = t["linear elu+1 chunk fwd: softmax time / op time"]
    assert fwd["measured"] == 50.0 and fwd["met"] is True
    assert t["linear elu+1 chunk fwd: achieved / measured float32 matmul rate"]["measured"] == 0.5
    assert t["DeltaNet chunk fwd: softmax time / op time"]["met"] is False  # 10x < 12x
    assert t["DeltaNet chunk fwd: recurrent time / chunk time"]["measured"] == 15.0
    assert t["linear elu+1 chunk fwd+bwd: softmax time / op time"]["met"] is None  # not measured, not guessed


def test_timing_and_table_helpers():
    calls = []
    t = common.time_fn(lambda: calls.append(1), warmup=2, repeats=3, min_time_s=0.0)
    assert t.repeats == 3 and len(calls) == 5 and t.min_ms <= t.q1_ms <= t.median_ms <= t.q3_ms <= t.max_ms
    text = common.format_table(["a", "b"], [["x", 1], ["yy", 22]])
    assert text.splitlines()[0].startswith("a") and len(text.splitlines()) == 4


def test_interleaved_timing_counts_and_errors(monkeypatch):
    built = []

    def maker(tag):
        def make():
            built.append(tag)
            if tag == "bad":
                raise RuntimeError("boom")
            return lambda: None
        return make

    a, bad, b = common.time_interleaved([maker("a"), maker("bad"), maker("b")], warmup=1, repeats=4, min_time_s=0)
    assert a.repeats == b.repeats == 4 and isinstance(bad, RuntimeError)
    assert built[3:] == ["a", "b"] * 4  # after one warm-up build each: rounds alternate the cases
    # the planning from measured durations, on a fake clock: each case's call returns the seconds it "took",
    # so the plan cannot depend on the machine's speed or load (a real 20 ms sleep took 35 ms on a busy one)
    monkeypatch.setattr(common, "_timed_call", lambda fn, sync: fn())
    calls = []

    def case(tag, seconds):
        return lambda: (lambda: calls.append(tag) or seconds)

    t_slow, t_fast = common.time_interleaved([case("s", 0.02), case("f", 1e-6)], warmup=1, repeats=2,
                                             min_time_s=0.05)
    assert t_slow.repeats == 3 and t_fast.repeats == 100  # short calls get more samples, spread over rounds
    assert calls.count("s") == 1 + 3 and calls.count("f") == 1 + 100   # one warm-up call each
    slow_at = [i for i, c in enumerate(calls[2:]) if c == "s"]
    assert [i - n for n, i in enumerate(slow_at)] == [33, 66, 99]   # its rounds: spread evenly over the 100
    assert common._plan_repeats(100.0, 5, 0.2, 100, 30.0) == 1  # one call over the budget: one sample
    assert common._plan_repeats(12.0, 5, 0.2, 100, 30.0) == 3
    assert common._plan_repeats(1e-4, 5, 0.2, 100, 30.0) == 100


def test_output_paths_never_overwrite(tmp_path):
    p = common.output_paths("ops", str(tmp_path))
    assert p["json"] == tmp_path / "ops.json"
    p["txt"].write_text("a user's file")
    q = common.output_paths("ops", str(tmp_path))
    assert q["txt"] != p["txt"] and q["txt"].name.startswith("ops-")
    assert common.output_paths("ops", str(tmp_path), overwrite=True)["txt"] == p["txt"]


def test_cpu_peak_memory_sees_a_known_allocation():
    if common.memory_method("cpu") != "cpu":
        pytest.skip("peak memory on CPU needs Linux /proc")
    spec = {"op": "linear", "mode": "chunk", "pass_": "fwd", "B": 1, "T": 64, "H": 1, "K": 8, "V": 8}
    [m] = common.measure_memory("linattn.bench.ops:build_case", [spec], "cpu")
    assert m["error"] is None and 0 <= m["peak_bytes"] < 64 * 2 ** 20


@pytest.mark.parametrize("module, argv", [("linattn", ["--help"]), ("linattn.bench", ["--help"]),
                                          ("linattn", ["bench", "ops", "--help"]),
                                          ("linattn.bench", ["ops", "--help"]),
                                          ("linattn.experiments", ["--help"])])
def test_python_dash_m_entry_points(module, argv, monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, f"{module}.__main__", raising=False)  # imported by test_structure
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    assert e.value.code == 0 and "usage: linattn" in capsys.readouterr().out


def test_python_dash_m_bench_reports_bad_arguments_on_one_line(monkeypatch, capsys):
    monkeypatch.delitem(sys.modules, "linattn.bench.__main__", raising=False)
    monkeypatch.setattr(sys, "argv", ["linattn.bench", "nosuchbench"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("linattn.bench", run_name="__main__", alter_sys=False)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "unknown benchmark" in err


def test_bench_ops_records_the_chunk_size_actually_used(tmp_path, capsys, monkeypatch):
    """A backend that runs another chunk size than asked: the row, the table, the JSON and the flop
    count all show the size used, never the one asked for."""
    asked = []

    def fake_used(op, q, k, v, *args, **kwargs):
        asked.append((op, kwargs["chunk_size"]))
        return 64 if op == "linear_attention" else 16

    monkeypatch.setattr(ops, "chunk_size_used", fake_used)
    out = tmp_path / "o"
    argv = ["bench", "ops", "--T", "64", "--repeats", "1", "--warmup", "0", "--min-time", "0", "--matmul-n", "64",
            "--modes", "chunk", "--passes", "fwd", "--chunk-size", "48", "--no-memory", "--quiet", "--out", str(out),
            "--families", "linear,delta,softmax"]
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert ("linear_attention", 48) in asked and ("delta_rule", 48) in asked
    assert "--chunk-size 48; used by the chunk forms: linear elu+1 64, DeltaNet 16" in stdout
    assert "64*" in stdout and "16*" in stdout  # the table marks sizes that differ from the request
    report = json.loads((out / "ops.json").read_text())
    rows = {r["op"]: r for r in report["results"] if r["mode"] == "chunk"}
    assert rows["linear"]["chunk_size"] == 48 and rows["linear"]["chunk_size_used"] == 64
    assert rows["linear"]["flops"] == 4 * 1 * 4 * 64 * 64 * (64 + 64)
    K = V = 64
    assert rows["efla"]["chunk_size_used"] == 16
    assert rows["efla"]["flops"] == 1 * 4 * 64 * (6 * 16 * K + 4 * 16 * V + 6 * K * V)
    assert report["chunk_size"] == {"requested": 48, "used": {"linear": [64], "deltanet": [16],
                                                              "gated_deltanet": [16], "efla": [16]}}
    assert "used by the chunk forms" in (out / "ops.txt").read_text()


def test_case_chunk_size_asks_the_operator_with_the_case_arguments():
    spec = dict(B=1, T=40, H=1, K=8, V=8, chunk_size=48)
    assert ops.case_chunk_size("softmax", "sdpa", "fwd", **spec) is None
    assert ops.case_chunk_size("linear", "recurrent", "fwd", **spec) is None
    assert ops.case_chunk_size("linear", "chunk", "fwd", **spec) >= 1
    assert ops.case_chunk_size("efla", "chunk", "fwdbwd", **spec) >= 1
