"""`linattn bench threads --quick` end to end, with and without the busy core (no timing assertions)."""
import json
import os
import shutil

import pytest

from linattn.cli import main

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "").strip() or "cc") is None,
                                reason="no C compiler: the compiled CPU kernels cannot build")


@pytest.mark.parametrize("busy", [None, "free", "pinned"])
def test_bench_threads_quick(tmp_path, capsys, busy):
    pin = min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    args = ["bench", "threads", "--quick", "--out", str(tmp_path), "--quiet"] + (["--busy-core"] if busy else []) \
        + (["--busy-pin", str(pin)] if busy == "pinned" else [])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and ("busy-loop process held a core" in out) == bool(busy)
    assert (f"pinned to CPU {pin}" in out) == (busy == "pinned") and ("not pinned" in out) == (busy == "free")
    data = json.loads((tmp_path / "threads.json").read_text())
    assert data["busy_core"] == bool(busy) and data["machine"]["loadavg_1_5_15min"] is not None
    assert data["busy_pin"] == (pin if busy == "pinned" else None)
    cases = {(r["level"], r["op"], r["pass"]) for r in data["records"]}
    assert cases == {(lv, op, ps) for lv in ("op", "kernel") for op in ("linear", "gated_deltanet")
                     for ps in ("fwd", "fwd+bwd")}
    for r in data["records"]:
        assert set(r["median_ms"]) == {"1", "2"} and all(len(v) == 2 for v in r["ms"].values())
        s = r["spread"]["2"]
        assert s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"] and s["n"] == 2
        assert s["median"] == r["speedup"]["2"]
        for n in ("1", "2"):
            calls = r["calls"][n]
            assert len(calls) == 2 and all(c["kernel_ms"] > 0 for c in calls)
            # the kernels run inside the call; at the kernel level they are the whole call
            assert all(c["kernel_ms"] <= ms * 1.001 for c, ms in zip(calls, r["ms"][n]))
            if os.path.exists("/proc/self/task"):
                assert all(c["cpu_ms"] > 0 and c["ran"] for c in calls)
            assert all(isinstance(c["faults"], int) and c["faults"] >= 0 for c in calls)
            if busy and os.path.exists("/proc/self/task"):
                assert all(c["busy_cpu"] == pin for c in calls) if busy == "pinned" else all(
                    c["busy_cpu"] >= 0 for c in calls)
        for n in ("1", "2"):
            assert 0 <= r["around_ms"][n] <= r["median_ms"][n] * 1.001 or r["level"] == "kernel"
        p = r["placement"]["2"]
        assert p["apart"] + p["shared"] <= 2


def test_minor_faults_count_first_touches():
    """bench threads' `faults` column: touching fresh anonymous memory raises the process's minor fault count."""
    import mmap

    from linattn.bench.threads import minor_faults

    if minor_faults() == 0:
        pytest.skip("no getrusage fault counts here")
    buf = mmap.mmap(-1, 8 << 20)
    before = minor_faults()
    for i in range(0, len(buf), mmap.PAGESIZE):
        buf[i] = 1
    assert minor_faults() > before
    buf.close()


def test_call_record_counts_cpu_time_wait_and_placement():
    """What a call cost, from two /proc readings (tid -> (ns run, ns waiting, last CPU)): the threads that ran, their
    CPU and wait time; two threads that did most of the work and ended on one CPU ran "shared"."""
    from linattn.bench.threads import call_record

    before = {"1": (1_000_000, 0, 0), "2": (0, 0, 1), "3": (5_000_000, 0, 1)}
    after = {"1": (11_000_000, 2_000_000, 0), "2": (9_000_000, 500_000, 0), "3": (5_000_000, 0, 1),
             "4": (100_000, 0, 1)}  # 3 did not run; 4 started during the call and ran little
    rec = call_record(before, after)
    assert rec["cpu_ms"] == pytest.approx(19.1) and rec["wait_ms"] == pytest.approx(2.5)
    assert sorted(map(tuple, rec["ran"])) == [(0, 0, 10.0), (1, 0, 9.0), (1, 1, 0.1)]
    assert rec["threads"] == 2 and rec["cpus"] == 1  # 1 and 2 ended on CPU 0
    after["2"] = (9_000_000, 500_000, 1)
    assert call_record(before, after)["cpus"] == 2


def test_bench_threads_bad_thread_list_exits_2(capsys):
    assert main(["bench", "threads", "--quick", "--threads", "0,2"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_bench_threads_busy_pin_needs_busy_core(tmp_path, capsys):
    assert main(["bench", "threads", "--quick", "--busy-pin", "0", "--out", str(tmp_path)]) == 2
    assert "--busy-pin" in capsys.readouterr().err


def test_gdn_forward_kernel_level_is_the_fused_scan(monkeypatch):
    """The kernel level of Gated DeltaNet's forward times what delta_rule runs without a gradient: the scan on the raw
    rows with prep (no preparation pass: the pass functions fail if called), with delta_rule's bits; its
    forward+backward the custom ops with that prep (no pass either), as delta_rule with a gradient."""
    from types import SimpleNamespace

    import torch

    from linattn.bench.threads import make_case, make_kernel_case
    from linattn.cpu import available, delta as cdelta

    if not available("delta"):
        pytest.skip("compiled delta kernels unavailable")
    a = SimpleNamespace(B=1, T=70, H=2, K=8, V=5, seed=3)
    preps = []
    forward = cdelta._forward

    def spy(*args):
        preps.append(args[9] if len(args) > 9 else None)
        return forward(*args)

    def no_pass(*args, **kw):
        raise AssertionError("the preparation pass ran")

    monkeypatch.setattr(cdelta, "_forward", spy)
    monkeypatch.setattr(cdelta, "delta_prepare_raw_a", no_pass)
    monkeypatch.setattr(cdelta, "delta_prepare", no_pass)
    o = make_kernel_case("gated_deltanet", "fwd", a)()
    assert preps == [(cdelta.PREP_RAW, a.K ** -0.5, 0.0)]
    # the op level's inputs and bits
    with torch.no_grad():
        ref = make_case("gated_deltanet", "fwd", a)()
    assert torch.equal(o, ref.reshape(o.shape))
    preps.clear()
    o = make_kernel_case("gated_deltanet", "fwd+bwd", a)()
    assert preps == [(cdelta.PREP_RAW, a.K ** -0.5, 0.0)]
    assert torch.equal(o, ref.reshape(o.shape))
