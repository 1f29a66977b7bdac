"""The delta rule's preparation inside the compiled scan (issue 53; csrc/delta.c's plan.prep, csrc/deltarow.h,
cpu/delta.py delta_scan(prep=), ops/delta_core.py DeltaProblem.prep): the scan reads the raw q, k, v and beta and
prepares each row itself (delta_prepare's rows with qk_l2norm, or delta_prepare_raw_a's without), so that nothing
prepared is written out and read back; with a gradient the backward scan prepares each row again and returns the raw
rows' gradients through the preparation's backward row (round 16: no pass, no prepared rows kept).

Byte for byte against today's preparation pass then scan (the same call with its rows prepared first: prepare_delta
without a backend, then run_delta): output and final state, fp32 / bf16 / fp64, 1, 2 and 3 kernel threads (the
sequences split into runs between threads), T in {1, 63, 64, 65, 1000}, packed sequences, initial states, keys whose
sum of squares overflows (and their fp64 rows), tiny and zero keys, NaN rows (the same NaN positions); against the
fp64 reference within the kernels' tolerances; when the fusion is taken and when not; the other backends given such a
call prepare its rows first. The gradients of every input (q, k, v, beta, g, the initial state) byte for byte against
the pass's (the pass then the scan, differentiated), with the same inputs, threads and hostile rows."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from linattn import LinattnError, delta_rule
from linattn.cpu import delta as cdelta
from linattn.ops.delta_core import prepare_delta, run_delta
from linattn.ops.reference import delta_rule_ref

pytestmark = [pytest.mark.skipif(not (cdelta.prep_available(torch.float32) and cdelta.available()),
                                 reason="no C compiler: the compiled kernels are off"),
              pytest.mark.usefixtures("one_thread_module")]

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float64: 1e-11}
INT = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}


@contextlib.contextmanager
def kernel_threads(n, monkeypatch):
    """n kernel threads however small the call (cpu.delta.GRAIN lowered: a thread per token x head x K x V)."""
    monkeypatch.setattr(cdelta, "GRAIN", 1.0)
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _inputs(dtype, B=1, T=65, H=2, K=16, V=12, gate="head", seed=0, N=None, unit=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    if unit:  # the common call without qk_l2norm: the caller's unit keys (some a little longer: d != 1)
        k = F.normalize(k, dim=-1) * torch.empty(B, T, H, 1, dtype=torch.float64).uniform_(0.5, 1.3, generator=g)
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    gt = {"none": None, "head": -0.3 * torch.rand(B, T, H, generator=g, dtype=torch.float64),
          "channel": -0.3 * torch.rand(B, T, H, K, generator=g, dtype=torch.float64)}[gate]
    S0 = torch.randn(B if N is None else N, H, K, V, generator=g, dtype=torch.float64)
    return [t.to(dtype) if t is not None else None for t in (q, k, v, beta, gt)], S0.to(dtype)


def _hostile_inputs(dtype):
    """T 150 rows whose sum of squares overflows (fp32: the fp64 rows of key_norms; the L2 row's rescaled path),
    tiny and zero keys and queries, one huge channel, a key that makes d >> 1."""
    x, S0 = _inputs(dtype, T=150, H=2, K=16, V=8, unit=False)
    q, k, v, beta, g = x
    big = 1e30 if dtype == torch.float32 else 1e200
    k[0, 3, 0] *= big
    q[0, 4, 1] *= big
    k[0, 5, 1] *= 1e-30
    k[0, 6, 0] = 0
    q[0, 7, 0] = 0
    k[0, 8, 1, 2] = big  # one huge channel
    k[0, 9, 0] *= 40.0   # d >> 1
    v[0, 9, 0] *= 1e3
    return x, S0


def _poison(x):
    """NaN in q, k and v and an inf key, from row 100 on (in place)."""
    q, k, v, _, _ = x
    k[0, 100, 0, 5] = float("nan")
    q[0, 110, 1, 0] = float("nan")
    v[0, 120, 0, 3] = float("nan")
    k[0, 130, 1, 1] = float("inf")


def _fused(x, S0, l2, **kw):
    """delta_rule on the compiled kernels without a gradient: the preparation inside the scan."""
    q, k, v, beta, g = x
    with torch.no_grad():
        return delta_rule(q, k, v, beta, g=g, qk_l2norm=l2, initial_state=S0, output_final_state=True,
                          backend="cpu", **kw)


def _unfused(x, S0, l2, **kw):
    """The same call as before: the preparation pass (prepare_delta's fused rows, no backend: nothing deferred),
    then the scan on the prepared rows."""
    q, k, v, beta, g = x
    with torch.no_grad():
        p = prepare_delta(q, k, v, beta, g=g, channel_gate=True, qk_l2norm=l2, initial_state=S0,
                          output_final_state=True, fused=True, **kw)
        assert p.prep is None
        return run_delta(p, "cpu")


def _same_bytes(a, b, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    ai, bi = a.contiguous().view(INT[a.dtype]), b.contiguous().view(INT[b.dtype])
    if not torch.equal(ai, bi):
        diff = (ai != bi).nonzero()
        raise AssertionError(f"{what}: {diff.shape[0]} of {a.numel()} entries differ, the first at "
                             f"{tuple(diff[0].tolist())}: {a[tuple(diff[0])].item()!r} vs {b[tuple(diff[0])].item()!r}")


def _check_same(x, S0, l2, monkeypatch, counts=(1, 2, 3), **kw):
    """fused == unfused byte for byte at every thread count (and so == the 1-thread fused call)."""
    for n in counts:
        with kernel_threads(n, monkeypatch):
            o, S = _fused(x, S0, l2, **kw)
            ou, Su = _unfused(x, S0, l2, **kw)
        _same_bytes(o, ou, f"output, {n} threads")
        _same_bytes(S, Su, f"final state, {n} threads")
    return o, S


# ------------------------------------------------------------------ when the fusion is taken

@pytest.mark.parametrize("l2", [False, True])
def test_taken_with_and_without_a_gradient(l2, monkeypatch):
    x, S0 = _inputs(torch.float32)
    q, k, v, beta, g = x
    kw = dict(g=g, qk_l2norm=l2, initial_state=S0, fused=True, backend="cpu")
    kind = cdelta.PREP_L2 if l2 else cdelta.PREP_RAW
    with torch.no_grad():
        assert prepare_delta(q, k, v, beta, **kw).prep[0] == kind
    assert prepare_delta(q, k, v, beta, **kw).prep[0] == kind  # grad mode on, nothing requires one
    for i in range(6):  # any input requiring a gradient: the scan's own preparation, differentiable
        leaves = [t.clone().requires_grad_(j == i) for j, t in enumerate((q, k, v, beta, g, S0))]
        p = prepare_delta(*leaves[:4], **{**kw, "g": leaves[4], "initial_state": leaves[5]})
        assert p.prep[0] == kind, f"input {i} requires a gradient"
    with torch.no_grad():
        assert prepare_delta(q, k, v, beta, g=g, qk_l2norm=l2, fused=True).prep is None  # no backend: prepared
        assert prepare_delta(q, k, v, beta, g=g, qk_l2norm=l2, fused=True, backend="torch").prep is None
        assert prepare_delta(q, k, v, beta, g=g, qk_l2norm=l2, backend="cpu").prep is None  # not fused

    def no_pass(*a, **k):
        raise AssertionError("the preparation pass ran")
    monkeypatch.setattr(cdelta, "delta_prepare", no_pass)
    monkeypatch.setattr(cdelta, "delta_prepare_raw_a", no_pass)
    o, S = _fused(x, S0, l2)  # no pass ran
    assert o.shape == v.shape and S.shape == S0.shape
    _grads(x, S0, l2, fused=True)  # nor with a gradient, forward or backward


# ------------------------------------------------------------------ the same bits as the pass then the scan

@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("l2", [False, True])
def test_same_bits_as_the_pass_then_the_scan(l2, dtype, T, monkeypatch):
    x, S0 = _inputs(dtype, T=T, unit=not l2)
    o, S = _check_same(x, S0, l2, monkeypatch, counts=(1, 2, 3) if T in (65, 1000) else (1, 2))
    assert o.dtype == dtype


@pytest.mark.parametrize("grad", [False, True], ids=["outputs", "gradients"])
@pytest.mark.parametrize("gate", ["none", "channel"])
@pytest.mark.parametrize("l2", [False, True])
def test_same_bits_every_gate(l2, gate, grad, monkeypatch):
    """Without a gradient the outputs and final state, with one also every gradient, against the pass's."""
    x, S0 = _inputs(torch.float32, T=700, H=1, K=20, V=9, gate=gate, unit=not l2)
    (_check_same_grads if grad else _check_same)(x, S0, l2, monkeypatch)


@pytest.mark.parametrize("l2", [False, True])
def test_same_bits_packed_sequences(l2, monkeypatch):
    x, S0 = _inputs(torch.float32, T=1200, H=2, N=5, unit=not l2)
    cu = torch.tensor([0, 1, 64, 129, 700, 1200], dtype=torch.int64)
    _check_same(x, S0, l2, monkeypatch, cu_seqlens=cu)
    with kernel_threads(1, monkeypatch):  # and no initial state, no final state asked
        q, k, v, beta, g = x
        with torch.no_grad():
            o, S = delta_rule(q, k, v, beta, g=g, qk_l2norm=l2, cu_seqlens=cu, backend="cpu")
            p = prepare_delta(q, k, v, beta, g=g, qk_l2norm=l2, cu_seqlens=cu, fused=True)
            ou, _ = run_delta(p, "cpu")
    assert S is None
    _same_bytes(o, ou, "output without states")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("l2", [False, True])
def test_same_bits_hostile_keys(l2, dtype, monkeypatch):
    """Rows whose sum of squares overflows (fp32: the fp64 rows of key_norms; the L2 row's rescaled path), tiny and
    zero keys, keys that make d large, and NaN in q, k, v (the same NaN positions)."""
    x, S0 = _hostile_inputs(dtype)
    o1, _ = _check_same(x, S0, l2, monkeypatch)
    _poison(x)
    o, S = _check_same(x, S0, l2, monkeypatch)
    _same_bytes(o[:, :100], o1[:, :100], "the outputs before the first poisoned row")
    assert torch.isnan(o[0, 100:, 0]).any() and torch.isnan(o[0, 110:, 1]).any()


# ------------------------------------------------------------------ against the fp64 reference

@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("l2", [False, True])
def test_against_the_reference(l2, dtype, gate, monkeypatch):
    x, S0 = _inputs(dtype, T=130, H=2, gate=gate, unit=not l2)
    with kernel_threads(2, monkeypatch):
        o, S = _fused(x, S0, l2)
    ro, rS = delta_rule_ref(*(t.double() for t in x[:4]), g=x[4].double() if x[4] is not None else None,
                            qk_l2norm=l2, S0=S0.double())
    for a, r, what in ((o, ro, "output"), (S, rS, "final state")):
        err = (a.double() - r).abs().max().item() / max(1.0, r.abs().max().item())
        assert err < TOL[dtype], f"{what}: relative error {err:.2e}"


# ------------------------------------------------------------------ the other ways in

def test_another_backend_prepares_the_rows_first():
    """A deferred problem run on the PyTorch forms: its rows prepared first (the same bits as a prepared problem)."""
    x, S0 = _inputs(torch.float32, T=40)
    q, k, v, beta, g = x
    for l2 in (False, True):
        with torch.no_grad():
            p = prepare_delta(q, k, v, beta, g=g, qk_l2norm=l2, initial_state=S0, output_final_state=True,
                              fused=True, backend="cpu")
            assert p.prep is not None
            o, S = run_delta(p, "torch")
            pu = prepare_delta(q, k, v, beta, g=g, qk_l2norm=l2, initial_state=S0, output_final_state=True,
                               fused=True)
            ou, Su = run_delta(pu, "torch")
        _same_bytes(o, ou, "output on torch")
        _same_bytes(S, Su, "final state on torch")


@pytest.mark.parametrize("kind", [cdelta.PREP_L2, cdelta.PREP_RAW])
def test_delta_scan_prep_with_a_gradient(kind):
    """delta_scan(prep=) where a gradient is needed: the scan's own preparation, forward and backward, with the bits
    and gradients of the pass then the scan."""
    x, S0 = _inputs(torch.float64, T=20)
    q, k, v, beta, g = (t.flatten(0, 1) for t in x)
    prep = (kind, 0.3, 1e-6)
    qg = q.clone().requires_grad_()
    o, S = cdelta.delta_scan(qg, k, v, beta, g, S0, [0, 20], prep=prep)
    (dq,) = torch.autograd.grad(o.sum(), qg)
    rows = cdelta.delta_prepare(qg, k, v, beta, 0.3, 1e-6) if kind == cdelta.PREP_L2 else \
        cdelta.delta_prepare_raw_a(qg, k, v, beta, 0.3)
    o2, _ = cdelta.delta_scan(*rows, g, S0, [0, 20])
    (dq2,) = torch.autograd.grad(o2.sum(), qg)
    assert torch.equal(o, o2) and torch.equal(dq, dq2)
    with torch.no_grad():
        of, Sf = cdelta.delta_scan(q, k, v, beta, g, S0, [0, 20], prep=prep)
    assert torch.equal(of, o.detach()) and torch.equal(Sf, S.detach())


def test_delta_scan_refuses_an_unknown_preparation():
    x, S0 = _inputs(torch.float32, T=4)
    q, k, v, beta, g = (t.flatten(0, 1) for t in x)
    with pytest.raises(LinattnError, match="prep must be"):
        cdelta.delta_scan(q, k, v, beta, g, S0, [0, 4], prep=(7, 1.0, 0.0))


# ------------------------------------------------------------------ the gradients: the preparation inside the backward

def _grads(x, S0, l2, fused, seed=1, **kw):
    """(output, final state, the gradients of q, k, v, beta, g, S0) of delta_rule on the compiled kernels: fused
    (backend="cpu": the scan prepares the rows, forward and backward) or as before (prepare_delta without a backend:
    the preparation pass, differentiated by its own backward, then the scan on the prepared rows)."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (*x, S0)]
    q, k, v, beta, g, s0 = leaves
    if fused:
        o, S = delta_rule(q, k, v, beta, g=g, qk_l2norm=l2, initial_state=s0, output_final_state=True,
                          backend="cpu", **kw)
    else:
        p = prepare_delta(q, k, v, beta, g=g, channel_gate=True, qk_l2norm=l2, initial_state=s0,
                          output_final_state=True, fused=True, **kw)
        assert p.prep is None
        o, S = run_delta(p, "cpu")
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
    dS = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.dtype)
    ts = [t for t in leaves if t is not None]
    grads = torch.autograd.grad((o, S), ts, (do, dS))
    return o.detach(), S.detach(), grads


def _check_same_grads(x, S0, l2, monkeypatch, counts=(1, 2, 3), **kw):
    """fused == the pass's, output, final state and every gradient, byte for byte at every thread count."""
    for n in counts:
        with kernel_threads(n, monkeypatch):
            o, S, g = _grads(x, S0, l2, True, **kw)
            ou, Su, gu = _grads(x, S0, l2, False, **kw)
        _same_bytes(o, ou, f"output, {n} threads")
        _same_bytes(S, Su, f"final state, {n} threads")
        names = [nm for nm, t in zip(("dq", "dk", "dv", "dbeta", "dg", "dS0"), (*x, S0)) if t is not None]
        for nm, a, b in zip(names, g, gu):
            _same_bytes(a, b, f"{nm}, {n} threads")
    return g


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("l2", [False, True])
def test_same_gradients_as_the_pass(l2, dtype, T, monkeypatch):
    x, S0 = _inputs(dtype, T=T, unit=not l2)
    g = _check_same_grads(x, S0, l2, monkeypatch, counts=(1, 2, 3) if T in (65, 1000) else (1, 2))
    assert all(t.dtype == dtype and torch.isfinite(t).all() for t in g)


@pytest.mark.parametrize("l2", [False, True])
def test_same_gradients_packed_sequences(l2, monkeypatch):
    x, S0 = _inputs(torch.float32, T=1200, H=2, N=5, unit=not l2)
    x = [t[:, :1200] if t is not None else None for t in x]
    cu = torch.tensor([0, 1, 64, 129, 700, 1200], dtype=torch.int64)
    _check_same_grads(x, S0, l2, monkeypatch, cu_seqlens=cu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("l2", [False, True])
def test_same_gradients_hostile_keys(l2, dtype, monkeypatch):
    """The rows of test_same_bits_hostile_keys: overflowing, tiny, zero, huge and long keys, then NaN and inf."""
    x, S0 = _hostile_inputs(dtype)
    _check_same_grads(x, S0, l2, monkeypatch)
    _poison(x)
    _check_same_grads(x, S0, l2, monkeypatch, counts=(1, 2))


@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize("l2", [False, True])
def test_gradients_against_the_reference(l2, gate, monkeypatch):
    x, S0 = _inputs(torch.float64, T=130, H=2, gate=gate, unit=not l2)
    with kernel_threads(2, monkeypatch):
        _, _, g = _grads(x, S0, l2, True)
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (*x, S0)]
    q, k, v, beta, gt, s0 = leaves
    ro, rS = delta_rule_ref(q, k, v, beta, g=gt, qk_l2norm=l2, S0=s0)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(ro.shape, generator=gen, dtype=torch.float64)
    dS = torch.randn(rS.shape, generator=gen, dtype=torch.float64)
    rg = torch.autograd.grad((ro, rS), [t for t in leaves if t is not None], (do, dS))
    for a, r in zip(g, rg):
        err = (a - r).abs().max().item() / max(1.0, r.abs().max().item())
        assert err < 1e-10, f"relative error {err:.2e}"


@pytest.mark.parametrize("l2", [False, True])
def test_no_prepared_rows_kept_for_the_backward(l2):
    """What the backward keeps besides the caller's tensors: the fused call no prepared q, k, v, a (which the pass
    then the scan keep: 3 x [B, T, H, D] and a), only the checkpoints and the gate's and the offsets' small tensors."""
    x, S0 = _inputs(torch.float32, T=256, H=2, K=16, V=16, unit=not l2)

    def kept_bytes(fused):
        leaves = [t.detach().clone().requires_grad_() for t in (*x, S0)]
        seen, total = {t.untyped_storage().data_ptr() for t in leaves}, [0]

        def pack(t):
            if t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total[0] += t.untyped_storage().nbytes()
            return t
        q, k, v, beta, g, s0 = leaves
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if fused:
                delta_rule(q, k, v, beta, g=g, qk_l2norm=l2, initial_state=s0, backend="cpu")
            else:
                run_delta(prepare_delta(q, k, v, beta, g=g, qk_l2norm=l2, initial_state=s0, fused=True), "cpu")
        return total[0]
    fused, unfused = kept_bytes(True), kept_bytes(False)
    prepared = sum(t.numel() * 4 for t in x[:4])
    ckpt = 4 * 2 * 16 * 16 * 4  # T 256 / 64 checkpoints of [H, K, V]
    assert fused <= unfused - prepared, (fused, unfused, prepared)
    assert fused <= ckpt + 2 * x[4].numel() * 4 + 1024, (fused, ckpt)


@pytest.mark.parametrize("kind", [cdelta.PREP_L2, cdelta.PREP_RAW])
def test_delta_scan_prep_gradients_with_empty_sequences(kind, monkeypatch):
    """delta_scan's flat form with empty sequences among the packed ones (starts 0, 0, 70, 70, 150), a state each:
    the fused forward and backward against the pass then the scan, byte for byte, at 1-3 threads."""
    g = torch.Generator().manual_seed(5)
    x = [torch.randn(150, 2, 16, generator=g), torch.randn(150, 2, 16, generator=g),
         torch.randn(150, 2, 8, generator=g), torch.rand(150, 2, generator=g), -torch.rand(150, 2, generator=g),
         torch.randn(4, 2, 16, 8, generator=g)]
    starts, prep = [0, 0, 70, 70, 150], (kind, 0.3, 1e-6)
    for n in (1, 2, 3):
        res = []
        with kernel_threads(n, monkeypatch):
            for fused in (True, False):
                y = [t.clone().requires_grad_() for t in x]
                rows = y[:4] if fused else cdelta.prepare_rows(*y[:4], prep)
                o, S = cdelta.delta_scan(*rows, y[4], y[5], starts, prep=prep if fused else None)
                res.append([o, S, *torch.autograd.grad((o, S), y, (torch.ones_like(o), torch.ones_like(S)))])
        for i, (a, b) in enumerate(zip(*res)):
            _same_bytes(a.detach(), b.detach(), f"tensor {i}, {n} threads")
