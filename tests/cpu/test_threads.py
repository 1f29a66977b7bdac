"""How the compiled CPU kernels share a call among threads (csrc/chains.h, linear.c, delta.c): one pass per
(sequence, head), chains of runs within the sequences when there are few (sequence, head) units per thread, and
linear attention's two-half split when there are fewer units than threads (linear attention's chains run an aligned
group of heads side by side). Every way gives the same bits as one
thread, forward and backward, with and without gates, packed sequences and initial states, at 1, 2 and 3 threads
and in a build without OpenMP (where the one thread runs each schedule's claims in turn). The sequences are long
enough for several runs per unit (linear: 8 chunks of 64 rows, the delta scan: 512 tokens) and not a multiple of
either. Skips without a C compiler."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from linattn import delta_rule, linear_attention
from linattn.cpu import build as cbuild
from linattn.models.registry import unregister_mixer

HAVE_CC = shutil.which(os.environ.get("CC", "").strip() or "cc") is not None
pytestmark = pytest.mark.skipif(not HAVE_CC or not cbuild.enabled(),
                                reason="no C compiler (cc / $CC) or LINATTN_CPU_KERNELS=0")

T_LONG = 1100   # > 2 runs of a unit in both kernels, and not a whole number of chunks
CHUNK = 64


@pytest.fixture(autouse=True)
def _every_call_threaded(monkeypatch):
    """These calls are small: without this the kernels would get one thread (cpu.threads' grain)."""
    from linattn.cpu import delta as cdelta, linear as clinear

    monkeypatch.setattr(clinear, "GRAIN", 1.0)
    monkeypatch.setattr(cdelta, "GRAIN", 1.0)
    monkeypatch.setattr(cdelta, "PREP_GRAIN", 1.0)


def _lin_inputs(B, T, H, dtype, gate, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(B, T, H, 16, generator=g, dtype=dtype), "k": torch.randn(B, T, H, 16, generator=g,
                                                                                      dtype=dtype),
         "v": torch.randn(B, T, H, 8, generator=g, dtype=dtype)}
    if gate:
        x["g"] = -0.1 * torch.rand(B, T, H, generator=g, dtype=dtype)
    return x


def _delta_inputs(B, T, H, dtype, gate, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = {"q": F.normalize(torch.randn(B, T, H, 16, generator=g, dtype=dtype), dim=-1),
         "k": F.normalize(torch.randn(B, T, H, 16, generator=g, dtype=dtype), dim=-1),
         "v": torch.randn(B, T, H, 8, generator=g, dtype=dtype),
         "beta": torch.rand(B, T, H, generator=g, dtype=dtype)}
    if gate:
        x["g"] = -0.1 * torch.rand(B, T, H, generator=g, dtype=dtype)
    return x


def _run(op, x, threads, backend="cpu", cu_seqlens=None, S0=None, counts=None):
    """(outputs..., gradients...) of one call with autograd at `threads` torch threads (`counts`: a list that
    receives torch's thread count after the call and after its backward)."""
    n0 = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
        if op == "linear":
            o, s = linear_attention(leaves["q"], leaves["k"], leaves["v"], feature_map="elu+1", normalize=True,
                                    g=leaves.get("g"), mode="chunk", chunk_size=CHUNK, backend=backend,
                                    cu_seqlens=cu_seqlens, initial_state=S0, output_final_state=True)
            outs = (o, s.kv, s.z)
        else:
            o, s = delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], g=leaves.get("g"), mode="chunk",
                              backend=backend, cu_seqlens=cu_seqlens, initial_state=S0, output_final_state=True)
            outs = (o, s)
        if counts is not None:
            counts.append(torch.get_num_threads())
        w = torch.Generator().manual_seed(5)
        loss = sum((t * torch.randn(t.shape, generator=w, dtype=t.dtype)).sum() for t in outs)
        grads = torch.autograd.grad(loss, list(leaves.values()))
        if counts is not None:
            counts.append(torch.get_num_threads())
        return tuple(t.detach() for t in outs) + tuple(grads)
    finally:
        torch.set_num_threads(n0)


def _same_bits(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape and torch.equal(x, y), f"tensor {i} differs: max |diff| {(x - y).abs().max()}"


# (B, H): units = B * H; at 2 and 3 threads these are chains (1 <= units per thread < 4) or, for linear attention,
# the split (fewer units than threads), or one pass per unit (many units)
SHAPES = [(1, 1), (1, 2), (1, 4), (2, 3), (3, 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_linear_same_bits_at_every_thread_count(shape, gate, dtype):
    B, H = shape
    x = _lin_inputs(B, T_LONG, H, dtype, gate)
    one = _run("linear", x, 1)
    for threads in (2, 3):
        _same_bits(_run("linear", x, threads), one)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_delta_same_bits_at_every_thread_count(shape, gate, dtype):
    B, H = shape
    x = _delta_inputs(B, T_LONG, H, dtype, gate)
    one = _run("delta", x, 1)
    for threads in (2, 3):
        _same_bits(_run("delta", x, threads), one)


@pytest.mark.parametrize("op", ["linear", "delta"])
def test_packed_sequences_and_initial_state_same_bits(op):
    """cu_seqlens with a 1-token and a long sequence, an initial state: every unit's runs in order."""
    lens = [700, 1, 650]
    cu = torch.tensor([0, 700, 701, 1351])
    H = 2
    if op == "linear":
        x = _lin_inputs(1, sum(lens), H, torch.float32, True, seed=3)
        p = _lin_inputs(3, 5, H, torch.float32, True, seed=4)  # a state as a call leaves it
        _, S0 = linear_attention(p["q"], p["k"], p["v"], feature_map="elu+1", normalize=True, g=p["g"],
                                 output_final_state=True)
    else:
        x = _delta_inputs(1, sum(lens), H, torch.float32, True, seed=3)
        S0 = torch.randn(3, H, 16, 8, generator=torch.Generator().manual_seed(4))
    one = _run(op, x, 1, cu_seqlens=cu, S0=S0)
    for threads in (2, 3):
        _same_bits(_run(op, x, threads, cu_seqlens=cu, S0=S0), one)


@pytest.mark.parametrize("op", ["linear", "delta"])
def test_threaded_schedules_match_the_pytorch_forms(op):
    """The chains and the split (2, 3 threads at B * H = 2) against the PyTorch chunk form, outputs and gradients
    (fp64: the formulas, not only self-consistency)."""
    x = (_lin_inputs if op == "linear" else _delta_inputs)(1, 300, 2, torch.float64, True, seed=7)
    want = _run(op, x, 1, backend="torch")
    for threads in (2, 3):
        got = _run(op, x, threads)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, rtol=1e-9, atol=1e-10), (a - b).abs().max()


def test_same_bits_without_openmp(monkeypatch):
    """A build without -fopenmp (the build's fallback) runs a 2-thread call's schedule on its one thread: the
    same bits as the OpenMP build at 1 and 2 threads."""
    cases = [("linear", _lin_inputs(1, T_LONG, 2, torch.float32, True)),
             ("linear", _lin_inputs(1, T_LONG, 1, torch.float32, False)),
             ("delta", _delta_inputs(1, T_LONG, 2, torch.float32, True))]
    with_omp = [(_run(op, x, 1), _run(op, x, 2)) for op, x in cases]
    if cbuild.load_library("probe").linattn_probe_threads(2) != 2:
        pytest.skip("the default build has no OpenMP here")
    default = {name: cbuild.build(name) for name in ("linear", "delta")}
    # the fallback a compiler that refuses -fopenmp gets (-march=native kept: the same instructions, FMA included),
    # built into the session's kernel cache: the cache key hashes FLAG_SETS, so the variant gets its own folder and a
    # later run loads it instead of compiling linear.c, delta.c and probe.c again
    monkeypatch.setattr(cbuild, "FLAG_SETS", (("-march=native", "-fopenmp-simd"),))
    monkeypatch.setattr(cbuild, "_LOADED", {})
    no_omp = [_run(op, x, 2) for op, x in cases]
    assert cbuild.load_library("probe").linattn_probe_threads(2) == 1
    for name in ("linear", "delta"):  # (a fresh build or a cached one: LAST_BUILD names the library that was loaded)
        assert cbuild.LAST_BUILD[name]["path"] != str(default[name])
        assert cbuild.LAST_BUILD[name]["path"] == str(cbuild.build(name))
    for (one, two), none in zip(with_omp, no_omp):
        _same_bits(two, one)
        _same_bits(none, one)


def test_small_calls_get_fewer_threads(monkeypatch):
    """A thread per grain of work: a short call runs on one thread (forking costs more than it saves, and on a busy
    machine a descheduled thread would hold it back), a long one on all of torch's."""
    from linattn.cpu import delta as cdelta, linear as clinear, threads

    monkeypatch.undo()
    n0 = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        st = torch.tensor([0, 256])
        assert clinear._plan(st, 256, 1, 4, 64, 64, 64, True, 0, 1.0, -1.0).nthreads == 1
        assert clinear._plan(st, 16384, 1, 4, 64, 64, 64, True, 0, 1.0, -1.0).nthreads == 3
        q = torch.empty(16384, 4, 64)
        assert cdelta._plan(q[:256], 64, st, st, None).nthreads == 1
        assert cdelta._plan(q, 64, st, st, None).nthreads == 3
        assert cdelta._prep_threads(256 * 4, 192) == 1 and cdelta._prep_threads(16384 * 4, 192) == 3
        assert threads() == 3 and threads(5.0, 2.0) == 2 and threads(1.0, 2.0) == 1
    finally:
        torch.set_num_threads(n0)


def test_torch_on_one_thread_keeps_the_kernels_count():
    """Inside the block torch runs on one thread and `threads()` gives the count from before; nested blocks keep
    it; the count comes back after (a count set inside is kept); at one thread nothing changes."""
    from linattn.cpu import threads, torch_on_one_thread

    n0 = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        with torch_on_one_thread():
            assert torch.get_num_threads() == 1 and threads() == 3 and threads(5.0, 2.0) == 2
            with torch_on_one_thread():
                assert torch.get_num_threads() == 1 and threads() == 3
            assert torch.get_num_threads() == 1 and threads() == 3
        assert torch.get_num_threads() == 3 and threads() == 3
        with pytest.raises(RuntimeError):
            with torch_on_one_thread():
                raise RuntimeError("boom")
        assert torch.get_num_threads() == 3 and threads() == 3
        with torch_on_one_thread():
            torch.set_num_threads(2)   # the caller's own setting, made inside: kept
        assert torch.get_num_threads() == 2 and threads() == 2
        torch.set_num_threads(1)
        with torch_on_one_thread():
            assert torch.get_num_threads() == 1 and threads() == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(n0)


@pytest.mark.parametrize("op", ["linear", "delta"])
def test_public_calls_run_torch_on_one_thread_around_the_kernels(op, monkeypatch):
    """linear_attention (elu+1, a map inside the kernels) and delta_rule (Gated DeltaNet) on the CPU backend: every
    kernel call, forward and backward, gets the caller's 3 threads while torch's count is 1 (its operators around the
    kernels on one thread); afterwards torch's count is 3 again. The values are those of the PyTorch forms."""
    from linattn.cpu import bindings

    seen = []
    real = bindings.require

    def spy(name):
        bound = real(name)

        def call(fn, *args):
            seen.append((name, fn, torch.get_num_threads(), _plan_threads(args)))
            return bound(fn, *args)
        return call

    def _plan_threads(args):
        plan = getattr(args[1], "_obj", None) if len(args) > 1 else None   # ctypes.byref(plan)
        return getattr(plan, "nthreads", args[-1])   # the plan's count, or deltaprep's last argument

    x = (_lin_inputs if op == "linear" else _delta_inputs)(1, T_LONG, 2, torch.float64, True, seed=11)
    want = _run(op, x, 1, backend="torch")
    monkeypatch.setattr(bindings, "require", spy)
    counts = []
    got = _run(op, x, 3, counts=counts)
    assert counts == [3, 3]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-9, atol=1e-10), (a - b).abs().max()
    fns = {fn for _, fn, _, _ in seen}
    assert any(f.endswith("_fwd") for f in fns) and any(f.endswith("_bwd") for f in fns), fns
    for name, fn, torch_threads, plan_threads in seen:
        assert torch_threads == 1 and plan_threads == 3, (name, fn, torch_threads, plan_threads)


def test_scoped_steps_match_the_torch_lines():
    """floor_log_gate and write_strength (prepare_delta's gate floor and rescaled beta on the compiled path) give
    the bits of the torch lines they replace, values and gradients, at the floor, below it, NaN included."""
    from linattn.cpu.delta import floor_log_gate, write_strength

    for dtype in (torch.float32, torch.float64):
        g = torch.tensor([0.0, -1.5, -1e4, -1e4 - 1, -3e38, float("nan"), -0.0], dtype=dtype)
        dy = torch.linspace(-1, 1, g.numel(), dtype=dtype)
        a, b = g.clone().requires_grad_(), g.clone().requires_grad_()
        ya, yb = floor_log_gate(a, 1e4), b.clamp_min(-1e4)
        ya.backward(dy), yb.backward(dy)
        assert torch.equal(ya.nan_to_num(7.0), yb.nan_to_num(7.0)) and torch.equal(a.grad, b.grad)
        beta = torch.rand(50, generator=torch.Generator().manual_seed(2), dtype=dtype)
        lam = torch.rand(50, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
        lam[0], lam[1] = 1.0, float("inf")
        a, b = beta.clone().requires_grad_(), beta.clone().requires_grad_()
        ya, yb = write_strength(a, lam), (b * lam.clamp_min(1.0)).to(dtype)
        dy = torch.randn(50, generator=torch.Generator().manual_seed(4), dtype=dtype)
        ya.backward(dy), yb.backward(dy)
        assert ya.dtype == dtype and torch.equal(ya, yb) and torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("case", ["taylor2 map", "clamp norm"])
def test_calls_with_torch_work_keep_torch_threads(case, monkeypatch):
    """Where torch computes the features (a map outside the kernels) or the preparation (qk_l2norm="clamp"), its
    work is large: it runs at the caller's count, not inside torch_on_one_thread (the linear kernel then too)."""
    from linattn.cpu import bindings
    from linattn.ops import delta_core

    seen = []
    real_require, real_l2norm = bindings.require, delta_core.l2norm

    def spy(name):
        bound = real_require(name)

        def call(fn, *args):
            seen.append((fn, torch.get_num_threads()))
            return bound(fn, *args)
        return call

    def l2norm_spy(x, mode):
        seen.append(("l2norm", torch.get_num_threads()))
        return real_l2norm(x, mode)

    monkeypatch.setattr(bindings, "require", spy)
    monkeypatch.setattr(delta_core, "l2norm", l2norm_spy)
    n0 = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        if case == "taylor2 map":
            x = _lin_inputs(1, 200, 2, torch.float64, False, seed=2)
            linear_attention(x["q"], x["k"], x["v"], feature_map="taylor2", mode="chunk", backend="cpu")
            watched = "linattn_linear_fwd"
        else:
            x = _delta_inputs(1, 200, 2, torch.float64, True, seed=2)
            delta_rule(x["q"], x["k"], x["v"], x["beta"], g=x["g"], qk_l2norm="clamp", backend="cpu")
            watched = "l2norm"
    finally:
        torch.set_num_threads(n0)
    counts = [n for fn, n in seen if fn == watched]
    assert counts and all(n == 3 for n in counts), seen


@pytest.mark.parametrize("op", ["linear", "delta"])
def test_chains_back_to_back_calls_same_bits(op):
    """Many short chain calls in a row, forward and backward, alternating 2 and 3 threads, give one thread's bits
    every time (a thread of one call left inside the next, or shared chain state not reset, would change them)."""
    x = (_lin_inputs if op == "linear" else _delta_inputs)(1, 200, 4, torch.float32, True, seed=3)
    one = _run(op, x, 1)
    for i in range(40):
        _same_bits(_run(op, x, 2 + i % 2), one)


def test_linear_chains_heads_side_by_side_split_and_apart_same_bits(monkeypatch):
    """linear.c's chains claim an aligned group of heads at one position and run them side by side (B = 1, H = 4 on
    2 threads: two pairs); beside a waiting thread a claim takes one head, after which a group's heads stand at
    different positions and are claimed apart. A build in which every other claim takes one head
    (LA_CHAINS_SPLIT_GROUPS) goes through both ways in every call: one thread's bits of the default build, forward
    and backward, gates, 2 and 3 threads, heads in groups of 2 and 3."""
    cases = [_lin_inputs(1, T_LONG, 4, torch.float32, True), _lin_inputs(2, T_LONG, 3, torch.float64, False)]
    want = [_run("linear", x, 1) for x in cases]
    for x, w in zip(cases, want):  # the default build's schedules first
        _same_bits(_run("linear", x, 2), w)
    if cbuild.load_library("probe").linattn_probe_threads(2) != 2:
        pytest.skip("the default build has no OpenMP here")
    default = cbuild.build("linear")
    # into the session's kernel cache (its key hashes FLAG_SETS: a folder of the variant's own)
    monkeypatch.setattr(cbuild, "FLAG_SETS", (("-march=native", "-fopenmp", "-DLA_CHAINS_SPLIT_GROUPS"),
                                              ("-fopenmp", "-DLA_CHAINS_SPLIT_GROUPS")))
    monkeypatch.setattr(cbuild, "_LOADED", {})
    for x, w in zip(cases, want):
        for threads in (2, 3):
            _same_bits(_run("linear", x, threads), w)
    assert cbuild.LAST_BUILD["linear"]["path"] != str(default)
    assert cbuild.LAST_BUILD["linear"]["path"] == str(cbuild.build("linear"))


def _affinities():
    """Every thread of this process: its allowed CPUs as /proc lists them."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                out[tid] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("Cpus_allowed_list"))
        except (OSError, StopIteration):
            pass
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/task") or len(os.sched_getaffinity(0)) < 2,
                    reason="Linux with at least 2 CPUs allowed")
def test_threads_moved_off_a_shared_cpu_take_their_mask_back(monkeypatch):
    """chains.h's placement: a thread of a call that finds another thread of the call on its CPU restricts itself to
    the other CPUs until it leaves the call. In a build where every thread but the first moves at every claim
    (LA_TEAM_ALWAYS_MOVE), a thread is seen with a narrower mask during a 2-thread call, every thread has its own
    mask back after it, and the results are the default build's bits."""
    import threading

    x = _lin_inputs(1, 4096, 2, torch.float32, True, seed=11)
    want = _run("linear", x, 2)
    if cbuild.load_library("probe").linattn_probe_threads(2) != 2:
        pytest.skip("the default build has no OpenMP here")
    # into the session's kernel cache (its key hashes FLAG_SETS: a folder of the variant's own)
    monkeypatch.setattr(cbuild, "FLAG_SETS", (("-march=native", "-fopenmp", "-DLA_TEAM_ALWAYS_MOVE"),
                                              ("-fopenmp", "-DLA_TEAM_ALWAYS_MOVE")))
    monkeypatch.setattr(cbuild, "_LOADED", {})
    before, narrowed = _affinities(), []  # torch's threads are up (the 2-thread call above)
    # the watcher samples /proc while a call runs (a few ms): on a loaded machine it can miss the narrowed window
    # in many calls in a row, so it gets up to 200 (it stops at the first sighting; every call's checks still run)
    for _ in range(200):
        stop = threading.Event()

        def watch():
            while not stop.is_set():
                narrowed.extend(tid for tid, cpus in _affinities().items() if cpus != before.get(tid, cpus))

        w = threading.Thread(target=watch)
        w.start()
        try:
            got = _run("linear", x, 2)
        finally:
            stop.set()
            w.join()
        _same_bits(got, want)
        after = _affinities()  # (a thread that ends or starts meanwhile, as the watcher, is not compared)
        assert {t: m for t, m in after.items() if t in before} == {t: m for t, m in before.items() if t in after}
        if narrowed:
            break
    assert narrowed, "no thread of a 2-thread call was seen restricted in 200 calls"


def test_chains_claim_rules(tmp_path):
    """chains.h's claims, set up one situation at a time from one thread (tests/fixtures/cpu/chains_claims.c): a
    group is taken whole, a half-released group is skipped rather than split, a unit that fell behind its group is
    claimed first and the group is whole again once it caught up, equal units go round robin, a waiting thread means
    one unit per claim, and nothing is claimed once every unit is finished."""
    import subprocess

    src = Path(__file__).resolve().parents[1] / "fixtures" / "cpu" / "chains_claims.c"
    exe = tmp_path / "chains_claims"
    cmd = [*cbuild.compiler(), "-O2", "-std=c11", f"-I{cbuild.CSRC}", str(src), "-o", str(exe)]
    try:
        built = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("no C compiler")
    assert built.returncode == 0, built.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "ok", out.stdout + out.stderr
    assert "FAIL" not in out.stdout


def _timeline_harness(name: str):
    """tests/fixtures/cpu/<name>.c built (with -march=native where the compiler takes it) into the kernel cache
    (`tests.helpers.fixture_executable`: the harness includes linear.c or delta.c, seconds of -O3, so a later run
    reuses it). Skips the test without a compiler that has OpenMP."""
    from tests.helpers import fixture_executable

    exe = fixture_executable(name, (("-march=native", "-fopenmp"), ("-fopenmp",)),
                             ["-O3", "-std=c11", "-ffp-contract=fast"])
    if exe is None:
        pytest.skip("the harness needs a compiler with OpenMP")
    return exe


def test_timeline_harness_same_bits_and_a_well_formed_timeline():
    """The developer's timeline harness (tests/fixtures/cpu/linear_timeline.c: chains.h's LA_TRACE hook timestamps
    every claim of linear.c) builds against the kernel's sources and runs: the same bits at 1 and 2 threads, forward
    and backward; the 2-thread calls' claims did the work (their CPU time inside claims is positive) and every figure
    is a finite time >= 0."""
    import math

    exe = _timeline_harness("linear_timeline")
    out = subprocess.run([str(exe), str(T_LONG), "4", "1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    _, _, num1, num2, _, dk1, dk2 = lines[-1].split()
    assert num1 == num2 and dk1 == dk2, lines[-1]
    rows = {}
    for line in lines[:-1]:
        words = line.split()
        rows[(words[0], int(words[2]))] = {k: float(x) for k, x in zip(words[3::2], words[4::2])}
    assert set(rows) == {(p, n) for p in ("fwd", "bwd") for n in (1, 2)}
    for (p, n), m in rows.items():
        assert all(math.isfinite(x) and x >= 0 for x in m.values()), (p, n, m)
        assert m["wall"] > 0
        if n == 2:
            assert m["cpu0"] + m["cpu1"] > 0, (p, m)


def test_delta_timeline_harness_same_bits_and_a_well_formed_timeline(tmp_path):
    """The delta forward's timeline harness (tests/fixtures/cpu/delta_timeline.c, LA_TRACE around delta.c's chains)
    builds against the kernel's sources and runs: the same bits at 1 and 2 threads, and at 2 threads with the chains
    on one thread (OMP_THREAD_LIMIT=1: the chains' order of runs), with the inputs laid head-major (DTL_HM=1: each
    head a sequence of one head), and forward and backward (DTL_BWD=1, every run written to DTL_RUNS); both threads'
    claims ran every run (their counts add up to the units' runs: 8-chunk runs, then 4, 2, 1, 1, each way) and every
    figure is a finite time >= 0."""
    import math

    exe = _timeline_harness("delta_timeline")
    T, H = 2048, 3  # 32 chunks of 64 per head: runs of 8, 8, 8, 4, 2, 1, 1
    hashes = set()
    runs_file = tmp_path / "runs.txt"
    for env in ({}, {"OMP_THREAD_LIMIT": "1"}, {"DTL_HM": "1"}, {"DTL_BWD": "1", "DTL_RUNS": str(runs_file)}):
        out = subprocess.run([str(exe), str(T), str(H), "1"], capture_output=True, text=True, timeout=300,
                             env={**os.environ, **env})
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        _, _, o1, o2 = lines[-1].split()
        hashes |= {o1, o2}
        rows = {}
        for line in lines[:-1]:
            words = line.split()
            rows[int(words[2])] = {k: float(x) for k, x in zip(words[3::2], words[4::2])}
        assert set(rows) == {1, 2}
        for n, m in rows.items():
            assert all(math.isfinite(x) and x >= 0 for x in m.values()), (n, m)
            assert m["wall"] > 0
        ways = 2 if "DTL_BWD" in env else 1
        assert rows[2]["runs0"] + rows[2]["runs1"] == 7 * H * ways, rows[2]
        assert rows[2]["cpu0"] + rows[2]["cpu1"] > 0, rows[2]
        if "OMP_THREAD_LIMIT" in env:
            assert rows[2]["runs1"] == 0, rows[2]
        if "DTL_RUNS" in env:  # the 2-thread call's runs (the 1-thread call runs no chains)
            runs = [line.split() for line in runs_file.read_text().splitlines()]
            assert len(runs) == 7 * H * 2, len(runs)
            for _, threads, thread, unit, t0, t1, c0, c1 in runs:
                assert threads == "2" and thread in ("0", "1") and 0 <= int(unit) < H
                assert 0 <= float(t0) <= float(t1) and float(c0) <= float(c1)
    assert len(hashes) == 1, hashes


def _counting(monkeypatch, module, name):
    calls = []
    orig = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return orig(*args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return calls


def test_public_linear_forward_calls_the_body_directly_with_the_ops_bits(monkeypatch):
    """The public linear forward without an autograd graph runs the custom op's body without its dispatch (the time
    around the kernel, issue 53), with the bits of the op itself; a graph, a dispatch mode or the profiler take the
    op (counted), with the same bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from linattn.cpu import linear as clinear

    gen = torch.Generator().manual_seed(5)
    B, T, H, K, V = 2, 300, 3, 16, 24
    q, k, v = (torch.randn(B, T, H, d, generator=gen) for d in (K, K, V))
    starts = [0, T, 2 * T]
    ref = torch.ops.linattn.cpu_linear_chunk_fwd(q.reshape(B * T, H, K), k.reshape(B * T, H, K),
                                                 v.reshape(B * T, H, V), None, None, starts, 64, True,
                                                 clinear.FMAPS["elu+1"], 0.5, False, 1e-6)[0].view(B, T, H, V)
    ops = _counting(monkeypatch, clinear, "_fwd")
    o, _ = linear_attention(q, k, v, scale=0.5, backend="cpu")
    assert ops == [] and torch.equal(o, ref)

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.funcs = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.funcs.add(str(func))
            return func(*args, **(kwargs or {}))
    with Seen() as seen:
        o, _ = linear_attention(q, k, v, scale=0.5, backend="cpu")
    assert ops == ["_fwd"] and torch.equal(o, ref)
    assert any("cpu_linear_chunk_fwd" in f for f in seen.funcs), seen.funcs
    with torch.profiler.profile() as prof:
        o, _ = linear_attention(q, k, v, scale=0.5, backend="cpu")
    assert ops == ["_fwd"] * 2 and torch.equal(o, ref)
    assert any("cpu_linear_chunk_fwd" in e.key for e in prof.key_averages())
    qg = q.clone().requires_grad_()
    o, _ = linear_attention(qg, k, v, scale=0.5, backend="cpu")
    assert ops == ["_fwd"] * 3 and torch.equal(o.detach(), ref)
    o.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_public_linear_forward_chooses_its_backend_once_and_its_feature_width_once(monkeypatch):
    """One backend decision per `linear_attention` call (it was made twice on the compiled CPU path: once for the
    torch scope, once to run); a registered map's K_phi is found once per (class, name, K), and a map registered anew
    under the same name is measured anew."""
    from linattn.ops import backend, feature_maps, linear as olinear

    q = torch.randn(1, 70, 2, 8)
    calls = _counting(monkeypatch, backend, "_choose_cpu")
    monkeypatch.setitem(backend._CHOOSERS, "cpu", backend._choose_cpu)
    linear_attention(q, q, q, backend="cpu")
    assert calls == ["_choose_cpu"]

    measured = []

    class Doubled(feature_maps.FeatureMap):
        name = "t53-width"

        def phi(self, x, pos=None):
            return torch.cat([F.elu(x) + 1, F.elu(-x) + 1], dim=-1)

        def feature_dim(self, head_dim):
            measured.append(type(self).__name__)
            return super().feature_dim(head_dim)

    class Tripled(Doubled):
        def phi(self, x, pos=None):
            return torch.cat([F.elu(x) + 1, F.elu(-x) + 1, F.elu(x) + 1], dim=-1)

    widths = []
    try:
        for cls in (Doubled, Doubled, Tripled, Tripled):
            feature_maps.register_feature_map("t53-width", cls, overwrite=True)
            widths.append(olinear.prepare_linear_attention(q, q, q, feature_map="t53-width").Kf)
        widths.append(olinear.prepare_linear_attention(q, q, q, feature_map=Tripled()).Kf)  # an instance: measured
    finally:
        feature_maps.unregister_feature_map("t53-width")
        unregister_mixer("linear-t53-width")   # (registered with the map)
    assert widths == [16, 16, 24, 24, 24]
    assert measured == ["Doubled", "Tripled", "Tripled"]


def test_delta_rule_value_checks_by_reductions_keep_their_errors():
    """delta_rule's beta and g checks are one reduction each (beta's minimum, g's sum with the exact test behind it:
    the Gated DeltaNet public call's time around its kernels, issue 53), with the errors they gave: NaN and negative
    beta, -inf in g (NaN and +inf: the log-gate check's); -0.0 in beta and a g of finite values whose sum overflows
    fp32 pass."""
    from linattn import LinattnError, delta_rule

    gen = torch.Generator().manual_seed(7)
    B, T, H, K = 1, 40, 2, 8
    q, k, v = (F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) for _ in range(3))
    beta, g = torch.rand(B, T, H, generator=gen), -torch.rand(B, T, H, generator=gen)

    def run(beta=beta, g=g):
        return delta_rule(q, k, v, beta, g=g, backend="torch")[0]
    for bad, match in ((float("nan"), "beta contains NaN"), (-1e-3, "beta is a step size and must be >= 0")):
        b = beta.clone()
        b[0, 17, 1] = bad
        with pytest.raises(LinattnError, match=match):
            run(beta=b)
    for bad, match in ((float("-inf"), "g must be finite"), (float("nan"), "g contains NaN"),
                       (float("inf"), "g is a log-gate and must be <= 0")):
        gg = g.clone()
        gg[0, 33, 0] = bad
        with pytest.raises(LinattnError, match=match):
            run(g=gg)
    b = beta.clone()
    b[0, 3, 0] = -0.0
    assert torch.isfinite(run(beta=b)).all()
    huge = torch.full_like(g, -3e38)  # finite, its sum is -inf in fp32: the exact test decides
    assert torch.isfinite(run(g=huge)).all()
