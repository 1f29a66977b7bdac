"""The compiled CPU backend (issue 34): build + cache, the dispatch, and the kernels against the PyTorch forms
and the fp64 references. Skips with a reason when there is no C compiler (CI has gcc)."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import linattn
from linattn import cpu
from linattn.cpu import build as cbuild
from linattn.errors import LinattnError
from linattn.ops import backend as B
from tests.helpers import build_variant

HAVE_CC = shutil.which(os.environ.get("CC", "").strip() or "cc") is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler (cc / $CC): the compiled CPU kernels cannot build")


def _fresh_loader(monkeypatch):
    """Forget what this process loaded / noticed, so that a test sees the first-use path."""
    monkeypatch.setattr(cbuild, "_LOADED", {})
    monkeypatch.setattr(cbuild, "_NOTICED", set())


# --------------------------------------------------------------------------------------- build + cache

@needs_cc
def test_build_then_load_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path))
    first = cbuild.build("probe")
    assert cbuild.LAST_BUILD["probe"]["cached"] is False
    assert first.is_file() and first.parent.parent == tmp_path / "cpu"
    stamp = first.stat().st_mtime_ns
    second = cbuild.build("probe")  # the same key: no compiler run, the same file
    assert second == first and cbuild.LAST_BUILD["probe"]["cached"] is True and first.stat().st_mtime_ns == stamp
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".tmp-")]  # no temporary left behind
    lib = ctypes.CDLL(str(second))
    assert lib.linattn_probe_threads(1) == 1
    x, y = torch.ones(37), torch.zeros(37)
    lib.linattn_probe_axpy(ctypes.c_int64(37), ctypes.c_float(2.0), ctypes.c_void_p(x.data_ptr()),
                           ctypes.c_void_p(y.data_ptr()))
    assert torch.equal(y, torch.full((37,), 2.0))


@needs_cc
def test_key_follows_the_source(tmp_path, monkeypatch):
    """An edited source builds into another folder (a stale library is never loaded)."""
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "k.c").write_text("int f(void) { return 1; }\n")
    a = cbuild.build("k", src)
    (src / "k.c").write_text("int f(void) { return 2; }\n")
    b = cbuild.build("k", src)
    assert a != b and ctypes.CDLL(str(a)).f() == 1 and ctypes.CDLL(str(b)).f() == 2
    (src / "extra.h").write_text("/* a header of the folder is part of the key */\n")
    assert cbuild.build("k", src) != b


@needs_cc
def test_concurrent_builds_share_one_library(tmp_path):
    """Two processes that build the same library at once: both load it, it is built once (file lock)."""
    script = textwrap.dedent("""
        import ctypes, sys
        from linattn.cpu import build
        path = build.build("probe")
        ctypes.CDLL(str(path)).linattn_probe_threads(1)
        print(build.LAST_BUILD["probe"]["cached"], path)
    """)
    env = dict(os.environ, LINATTN_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(o[0] for o in outs) == ["False", "True"] and outs[0][1] == outs[1][1]


def test_no_compiler_one_notice_then_none(monkeypatch, tmp_path):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.warns(UserWarning, match="compiled CPU kernels .* not available .*no C compiler"):
        assert cbuild.load_library("probe") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one notice per process, not one per call
        assert cbuild.load_library("probe") is None
        assert not cpu.available("probe")


def test_switched_off_builds_nothing(monkeypatch, tmp_path):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    monkeypatch.setenv("LINATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cbuild, "build", lambda *a, **k: pytest.fail("compiled although switched off"))
    assert cbuild.load_library("probe") is None and not cpu.available("probe")
    assert not (tmp_path / "cpu").exists()


def test_import_compiles_nothing():
    """`import linattn` (and a PyTorch-path call) neither compiles nor creates the cache."""
    from tests.helpers import fresh_import_probe

    probe = fresh_import_probe()   # a clean interpreter with a cache folder of its own
    assert not probe["import"]["cache"] and not probe["linear"]["cache"]


# --------------------------------------------------------------------------------------- dispatch

def _problem(q=None, **kw):
    q = torch.zeros(1, 4, 2, 8) if q is None else q
    return linattn.prepare_linear_attention(q, q, q, **kw)


class _NoKernel:
    """A prepared call of an operator that has no compiled kernel."""
    q = torch.zeros(1, 4, 2, 8)


def test_backend_errors_are_linattn_errors(monkeypatch):
    assert issubclass(B.BackendUnavailableError, LinattnError) and issubclass(B.BackendUnavailableError, ImportError)
    assert issubclass(B.BackendDeviceError, LinattnError) and issubclass(B.BackendDeviceError, RuntimeError)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    with pytest.raises(B.BackendUnavailableError, match="LINATTN_CPU_KERNELS=0"):
        B.select_backend("cpu", _problem())
    assert B.select_backend("auto", _problem()) == "torch"  # silently


def test_cpu_backend_without_compiler(monkeypatch, tmp_path):
    _fresh_loader(monkeypatch)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(_problem().__class__, "cpu_kernel", "probe", raising=False)
    monkeypatch.setattr(_problem().__class__, "cpu_unsupported", lambda self: None, raising=False)
    with pytest.warns(UserWarning, match="not available"):
        assert B.select_backend("auto", _problem()) == "torch"
    with pytest.raises(B.BackendUnavailableError, match="could not be built"):
        B.select_backend("cpu", _problem())


@needs_cc
def test_cpu_backend_rules(monkeypatch):
    assert "cpu" in B.BACKENDS
    with pytest.warns(UserWarning, match="backend='cpu': _NoKernel has no compiled CPU kernel; falling back"):
        assert B.select_backend("cpu", _NoKernel()) == "torch"
    assert B.select_backend("auto", _NoKernel()) == "torch"
    assert B.select_backend("torch", _problem()) == "torch"


# --------------------------------------------------------------------------------------- linear attention kernels

from linattn.ops.reference import linear_attention_ref, rel_err  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}
GRAD_TOL = {torch.float32: 1e-4, torch.float64: 1e-10, torch.bfloat16: 5e-2}


def _lin_inputs(B, T, H, K, V, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64).to(dtype) * 0.5 for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def _gate(kind, B, T, H, seed=1):
    """-> (operator kwargs, the log-gate [B, T, H] for the reference (or None))."""
    gen = torch.Generator().manual_seed(seed)
    if kind is None:
        return {}, None
    if kind == "gamma":
        return {"gamma": 0.8}, torch.full((B, T, H), float(torch.log(torch.tensor(0.8, dtype=torch.float64))),
                                          dtype=torch.float64)
    if kind == "gamma_h":
        gam = torch.tensor([0.9, 0.5], dtype=torch.float64)[:H].requires_grad_()
        return {"gamma": gam}, None
    g = (-torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.7)
    return {"g": g}, g


def _run(backend, q, k, v, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # backend='cpu' must not fall back here
        return linattn.linear_attention(q, k, v, backend=backend, **kw)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [None, "gamma", "g"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("fmap", ["elu+1", "relu", "identity", "taylor2", "cosformer"])
def test_linear_cpu_matches_reference_and_torch(fmap, normalize, gate, dtype):
    """Outputs against the fp64 quadratic reference and the PyTorch chunk form; T = 1, T not a multiple of the
    chunk, several chunk sizes."""
    B, H, K, V = 2, 2, 4, 3
    fm = linattn.get_feature_map(fmap, K)
    for T in (1, 37):
        q, k, v = _lin_inputs(B, T, H, K, V, dtype)
        if fmap in ("identity", "taylor2") and normalize:
            q, k = q.abs() + 0.1, k.abs() + 0.1  # a denominator away from 0
        kw, log_gate = _gate(gate, B, T, H)
        if "g" in kw:
            kw["g"] = kw["g"].to(dtype)
        ref = linear_attention_ref(q, k, v, fmap, normalize=normalize, log_gate=log_gate, fmap=fm)
        for cs in (5, 16, 64):
            o, _ = _run("cpu", q, k, v, feature_map=fm, normalize=normalize, chunk_size=cs, **kw)
            o_t, _ = _run("torch", q, k, v, feature_map=fm, normalize=normalize, chunk_size=cs, **kw)
            assert o.dtype == dtype and o.shape == (B, T, H, V)
            assert rel_err(o, ref) <= TOL[dtype], f"cs={cs} T={T}: {rel_err(o, ref):.2e}"
            assert rel_err(o, o_t) <= TOL[dtype]


def _grads(backend, q, k, v, kw, state, weights):
    leaves = [q, k, v] + [x for x in (kw.get("g"), kw.get("gamma")) if isinstance(x, torch.Tensor)]
    leaves += [state.kv, state.z] if state is not None else []
    o, s = linattn.linear_attention(q, k, v, backend=backend, initial_state=state, output_final_state=True, **kw)
    loss = (o * weights[0]).sum() + (s.kv * weights[1]).sum() + (s.z * weights[2]).sum()
    return (o, s.kv, s.z), torch.autograd.grad(loss, leaves)


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [None, "gamma_h", "g"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_linear_cpu_gradients_states_and_packing(packed, normalize, gate, dtype):
    """Outputs, final states and the gradients of q, k, v, the gate (g, or gamma [H]) and the initial state
    (kv and z): compiled vs the PyTorch forms, with an initial state, uneven cu_seqlens, T % C != 0."""
    H, K, V, C = 2, 6, 5, 8
    if packed:
        cu = torch.tensor([0, 1, 9, 30, 31, 47])  # 1-token, one-chunk and ragged sequences
        B, T, N = 1, 47, 5
    else:
        cu, B, T, N = None, 3, 21, 3
    q, k, v = _lin_inputs(B, T, H, K, V, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    kv0 = torch.randn(N, H, K, V, generator=gen, dtype=torch.float64).to(dtype)
    z0 = torch.rand(N, H, K, generator=gen, dtype=torch.float64).to(dtype) + 0.5
    weights = None
    results = {}
    for backend in ("cpu", "torch"):
        qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
        kw, _ = _gate(gate, B, T, H)
        kw = {n: (x.to(dtype).requires_grad_() if n == "g" else x) for n, x in kw.items()}
        state = linattn.LinearAttentionState(kv0.clone().requires_grad_(), z0.clone().requires_grad_(), None,
                                             torch.zeros(N, dtype=torch.int64))
        extra = dict(feature_map="elu+1", normalize=normalize, chunk_size=C, cu_seqlens=cu, **kw)
        if weights is None:
            gw = torch.Generator().manual_seed(5)
            weights = [torch.randn(s, generator=gw, dtype=torch.float64).to(dtype)
                       for s in ((B, T, H, V), (N, H, K, V), (N, H, K))]
        results[backend] = _grads(backend, qq, kk, vv, extra, state, weights)
    (outs_c, grads_c), (outs_t, grads_t) = results["cpu"], results["torch"]
    for a, b in zip(outs_c, outs_t):
        assert rel_err(a, b) <= TOL[dtype]
    assert len(grads_c) == len(grads_t)
    for i, (a, b) in enumerate(zip(grads_c, grads_t)):
        assert rel_err(a, b) <= GRAD_TOL[dtype], f"gradient {i}: {rel_err(a, b):.2e}"


@needs_cc
def test_linear_cpu_gradients_against_fp64_reference():
    """fp32 compiled gradients against autograd through the fp64 quadratic reference (written from the formula)."""
    B, T, H, K, V = 2, 19, 2, 4, 3
    q, k, v = _lin_inputs(B, T, H, K, V, torch.float32, seed=7)
    g = -torch.rand(B, T, H, generator=torch.Generator().manual_seed(8)) * 0.5
    w = torch.randn(B, T, H, V, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g)]
    o, _ = linattn.linear_attention(*leaves[:3], g=leaves[3], chunk_size=8, backend="cpu")
    got = torch.autograd.grad((o.double() * w).sum(), leaves)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v, g)]
    ref = linear_attention_ref(*ref_leaves[:3], "elu+1", log_gate=ref_leaves[3])
    want = torch.autograd.grad((ref * w).sum(), ref_leaves)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= 1e-4


@needs_cc
def test_linear_cpu_half_inputs_compute_in_fp32():
    q, k, v = _lin_inputs(1, 30, 2, 8, 8, torch.bfloat16)
    o, s = _run("cpu", q, k, v, chunk_size=16, output_final_state=True)
    ref = linear_attention_ref(q, k, v, "elu+1")
    assert o.dtype == torch.bfloat16 and s.kv.dtype == torch.float32 and rel_err(o, ref) <= TOL[torch.bfloat16]


@needs_cc
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("gate", [None, "g"])
def test_linear_cpu_poison_and_prefix_bits(gate):
    """A later inf / NaN never reaches an earlier output, and a prefix run gives the full run's bits."""
    B, T, H, K, V, C = 1, 45, 2, 8, 5, 16
    q, k, v = _lin_inputs(B, T, H, K, V, torch.float32, seed=11)
    kw, _ = _gate(gate, B, T, H)
    kw = {n: x.float() for n, x in kw.items()}
    base, _ = _run("cpu", q, k, v, chunk_size=C, **kw)
    for t in (0, 7, 16, 33, 44):
        for bad in (float("inf"), float("nan")):
            for which in range(3):
                x = [q.clone(), k.clone(), v.clone()]
                x[which][:, t, 1, 0] = bad
                o, _ = _run("cpu", *x, chunk_size=C, **kw)
                assert torch.equal(o[:, :t], base[:, :t]), (t, bad, which)
        pre = {n: x[:, :t + 1].contiguous() for n, x in kw.items()}
        o, _ = _run("cpu", q[:, :t + 1].contiguous(), k[:, :t + 1].contiguous(), v[:, :t + 1].contiguous(),
                    chunk_size=C, **pre)
        assert torch.equal(o, base[:, :t + 1]), t


@needs_cc
def test_linear_dispatch_auto_and_fallbacks(monkeypatch):
    q, k, v = _lin_inputs(1, 20, 2, 4, 4, torch.float32)
    assert B.select_backend("auto", _problem(q)) == "cpu"
    for kw in ({"mode": "recurrent"}, {"causal": False}, {"g": -torch.rand(1, 4, 2, 8)}, {"mode": "parallel"},
               {"feature_map": "hadamard_exp", "g": -torch.rand(1, 4, 2, 8)}):
        p = _problem(**kw)
        assert p.cpu_unsupported() is not None and B.select_backend("auto", p) == "torch"
    # the log-space maps have their own compiled kernel (cpu/linear_log.py), chosen by auto
    assert B.select_backend("auto", _problem(feature_map="hadamard_exp")) == "cpu"
    o, _ = linattn.linear_attention(q, k, v, feature_map="hadamard_exp", backend="cpu")
    assert rel_err(o, linear_attention_ref(q, k, v, "hadamard_exp")) < 1e-5
    o_auto, _ = linattn.linear_attention(q, k, v)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")  # off: auto is the PyTorch path, same values
    assert B.select_backend("auto", _problem(q)) == "torch"
    o_off, _ = linattn.linear_attention(q, k, v)
    assert rel_err(o_auto, o_off) < 1e-6
    assert linattn.chunk_size_used("linear_attention", q, k, v, chunk_size=48, backend="auto") == 48


@needs_cc
def test_linear_cpu_custom_op_opcheck():
    """The custom op's schema, fake (meta) registration and autograd registration agree (torch.library.opcheck)."""
    from linattn.cpu.linear import _fwd

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.rand(13, 2, 4, generator=gen) for _ in range(2))
    v = torch.randn(13, 2, 3, generator=gen)
    g = -torch.rand(13, 2, generator=gen)
    S0 = torch.randn(2, 2, 4, 4, generator=gen)
    for args in ((q, k, v, g, S0, [0, 6, 13], 4, True, 2, 0.5, True),
                 (q, k, v, None, None, [0, 13], 8, False, 0, 1.0, True)):
        args = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
        torch.library.opcheck(_fwd, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@needs_cc
def test_linear_cpu_under_torch_compile():
    """torch.compile(fullgraph=True) traces the compiled kernel as one custom op (forward and backward)."""
    q, k, v = (x.requires_grad_() for x in _lin_inputs(2, 40, 2, 8, 8, torch.float32))
    g = -torch.rand(2, 40, 2)

    def fn(q, k, v, g):
        o, s = linattn.linear_attention(q, k, v, g=g, chunk_size=16, output_final_state=True, backend="cpu")
        return o, s.kv

    fn(q, k, v, g)  # loads the library outside the trace
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got, want = compiled(q, k, v, g), fn(q, k, v, g)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad(got[0].sum() + got[1].sum(), (q, k, v))
    gb = torch.autograd.grad(want[0].sum() + want[1].sum(), (q, k, v))
    for a, b in zip(ga, gb):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


@needs_cc
@pytest.mark.parametrize("gate", [None, "g"])
def test_linear_cpu_bits_do_not_depend_on_threads_or_batch(gate):
    """One pass per (sequence, head) or three passes over all chunks (few sequences x heads for the threads): the
    same per-chunk arithmetic, so the same bits, forward and backward; and a sequence alone = the same in a batch."""
    B, T, H, K, V = 3, 50, 1, 8, 4
    q, k, v = _lin_inputs(B, T, H, K, V, torch.float32, seed=21)
    kw, _ = _gate(gate, B, T, H)
    kw = {n: x.float() for n, x in kw.items()}
    runs = []
    n0 = torch.get_num_threads()
    try:
        for threads, rows in ((1, slice(None)), (2, slice(None)), (2, slice(1, 2))):  # 3x1 pairs / 2 threads: 3 passes
            torch.set_num_threads(threads)
            leaves = [x[rows].clone().requires_grad_() for x in (q, k, v)]
            extra = {n: x[rows] for n, x in kw.items()}
            o, s = _run("cpu", *leaves, chunk_size=16, output_final_state=True, **extra)
            grads = torch.autograd.grad(o.sum() + s.kv.sum(), leaves)
            runs.append((o, s.kv, *grads))
    finally:
        torch.set_num_threads(n0)
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    for a, b in zip(runs[2], runs[0]):
        assert torch.equal(a, b[1:2])


# --------------------------------------------------------------------------------------- linattn bench ops --backends

def test_bench_ops_compares_backends(tmp_path, capsys):
    """`--backends torch,cpu`: each backend-taking case once per backend, labelled, with the ratio to the first and
    targets per backend; operators without a backend (softmax) once."""
    import json

    from linattn import cli

    out = tmp_path / "o"
    argv = ["bench", "ops", "--T", "64", "--repeats", "1", "--warmup", "0", "--min-time", "0", "--matmul-n", "64",
            "--modes", "chunk", "--passes", "fwd", "--families", "linear,softmax", "--backends", "torch,cpu",
            "--no-memory", "--quiet", "--out", str(out)]
    assert cli.main(argv) == 0
    stdout = capsys.readouterr().out
    assert "linear elu+1 chunk [torch]" in stdout and "linear elu+1 chunk [cpu]" in stdout and "torch/op" in stdout
    report = json.loads((out / "ops.json").read_text())
    rows = {(r["op"], r.get("backend")) for r in report["results"]}
    assert rows == {("linear", "torch"), ("linear", "cpu"), ("softmax", None)}
    by = {r.get("backend"): r for r in report["results"] if r["op"] == "linear"}
    assert by["torch"]["speedup_vs_first_backend"] == 1.0 and by["cpu"]["speedup_vs_first_backend"] > 0
    names = [t["target"] for t in report["targets"]]
    assert any(n.startswith("[torch] linear") for n in names) and any(n.startswith("[cpu] linear") for n in names)
    assert report["config"]["backends"] == ["torch", "cpu"]


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-gcc") is None, reason="no aarch64 cross compiler "
                    "(apt-get install gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("name", ["probe", "linear"])
def test_sources_cross_compile_for_aarch64(name, tmp_path):
    """The kernels are portable C (no x86 intrinsics): they compile for arm64 (compile only, not run)."""
    src = cbuild.CSRC / f"{name}.c"
    out = tmp_path / f"{name}.o"
    r = subprocess.run(["aarch64-linux-gnu-gcc", *[f for f in cbuild.BASE_FLAGS if f != "-shared"], "-fopenmp",
                        f"-I{cbuild.CSRC}", "-c", str(src), "-o", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.read_bytes()[:4] == b"\x7fELF"


@needs_cc
def test_linear_cpu_plain_c_fallback(tmp_path, monkeypatch):
    """The products without GCC/clang vector types (-DLINATTN_PLAIN_C, what another compiler gets) agree too."""
    from linattn.cpu import bindings

    # cached by its sources' hash (the define included), so a later run reuses this build
    lib = build_variant(tmp_path, "linear", "#define LINATTN_PLAIN_C\n")
    monkeypatch.setattr(bindings, "load_library", lambda name: lib)
    q, k, v = (x.requires_grad_() for x in _lin_inputs(2, 45, 2, 8, 33, torch.float32, seed=5))
    g = -torch.rand(2, 45, 2)
    o, _ = _run("cpu", q, k, v, g=g, chunk_size=16)
    o_t, _ = _run("torch", q, k, v, g=g, chunk_size=16)
    assert rel_err(o, o_t) <= TOL[torch.float32]
    ga = torch.autograd.grad(o.sum(), (q, k, v))
    gb = torch.autograd.grad(o_t.sum(), (q, k, v))
    for a, b in zip(ga, gb):
        assert rel_err(a, b) <= GRAD_TOL[torch.float32]


@needs_cc
def test_linear_cpu_odd_chunks_and_wide_features():
    """Chunk sizes 1, 3 and 512, and a feature width past the tail columns' buffer (taylor2, K = 32: 1057
    features), forward and backward, against the PyTorch forms; chunk_size > 512 falls back with a warning."""
    q, k, v = _lin_inputs(2, 37, 2, 8, 5, torch.float32, seed=31)
    g = -torch.rand(2, 37, 2, generator=torch.Generator().manual_seed(32)) * 0.3
    for C in (1, 3, 512):
        outs = []
        for backend in ("cpu", "torch"):
            leaves = [x.clone().requires_grad_() for x in (q, k, v)]
            o, _ = _run(backend, *leaves, g=g, chunk_size=C)
            outs.append((o, *torch.autograd.grad(o.sum(), leaves)))
        for a, b in zip(*outs):
            assert rel_err(a, b) <= GRAD_TOL[torch.float32], C
    q, k, v = (0.2 * x for x in _lin_inputs(1, 20, 1, 32, 3, torch.float32, seed=33))
    o, _ = _run("cpu", q, k, v, feature_map="taylor2", chunk_size=8)
    assert rel_err(o, _run("torch", q, k, v, feature_map="taylor2", chunk_size=8)[0]) <= TOL[torch.float32]
    with pytest.warns(UserWarning, match="chunk_size > 512"):
        linattn.linear_attention(q, k, v, chunk_size=513, backend="cpu")


def test_bench_ops_issue34_targets_from_rows():
    """--targets 34: issue 34's thresholds per backend, and at T = 1024 the compiled rows against the torch ones."""
    from linattn.bench import ops

    class A:
        T, families, modes, passes = [1024, 16384], ["linear", "delta", "softmax"], ["chunk"], ["fwd"]
        backends, targets = ["torch", "cpu"], "34"

    def row(T, op, ms, backend, mode="chunk", gflops=0.0):
        return {"T": T, "op": op, "mode": mode, "pass": "fwd", "ms": ms, "gflops": gflops, "backend": backend}

    results = [row(16384, "softmax", 100.0, None, mode="sdpa"),
               row(16384, "linear", 2.0, "cpu", gflops=50.0), row(16384, "linear", 4.0, "torch", gflops=25.0),
               row(16384, "deltanet", 4.0, "cpu"), row(1024, "linear", 1.0, "cpu"), row(1024, "linear", 1.5, "torch"),
               row(1024, "deltanet", 2.0, "cpu"), row(1024, "deltanet", 1.0, "torch")]
    t = {x["target"]: x for x in ops.compute_targets(results, [], A, {"gflops": 100.0, "dtype": "float32"})}
    assert t["[cpu] linear elu+1 chunk fwd: softmax time / op time"]["met"] is True       # 50x >= 40x
    assert t["[torch] linear elu+1 chunk fwd: softmax time / op time"]["met"] is False    # 25x < 40x
    assert t["[cpu] linear elu+1 chunk fwd: achieved / measured float32 matmul rate"]["met"] is True  # 50% >= 45%
    assert t["[cpu] DeltaNet chunk fwd: softmax time / op time"]["met"] is True           # 25x >= 20x
    assert not any("recurrent time" in name for name in t)                                 # not an issue-34 target
    assert t["[cpu vs torch] linear elu+1 chunk fwd at T=1024: torch time / cpu time"]["measured"] == 1.5
    assert t["[cpu vs torch] DeltaNet chunk fwd at T=1024: torch time / cpu time"]["met"] is False


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(1, 4, 0, 4, 4), (0, 4, 2, 4, 4), (5, 4, 0, 4, 4)])
def test_linear_cpu_empty_heads_or_batch_at_any_thread_count(shape, threads):
    """An empty head or batch dimension gives empty results and an empty state, and never reaches an integer
    division by the head count (one thread made the kernel's one-pass schedule divide by H = 0: SIGFPE)."""
    B_, T, H, K, V = shape
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q, k, v = torch.randn(B_, T, H, K), torch.randn(B_, T, H, K), torch.randn(B_, T, H, V)
        for grad in (False, True):
            xs = [x.clone().requires_grad_(grad) for x in (q, k, v)]
            o, s = linattn.linear_attention(*xs, backend="cpu", output_final_state=True)
            assert o.shape == (B_, T, H, V)
            if grad:
                o.sum().backward()
                assert all(x.grad is not None and x.grad.shape == x.shape for x in xs)
    finally:
        torch.set_num_threads(before)
