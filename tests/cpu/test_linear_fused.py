"""Issue 34 (engineer D4): the cheaper finite-output check and the normaliser division inside the compiled
linear-attention kernel (forward without autograd)."""
import math
import os
import shutil

import pytest
import torch

import linattn
from linattn.ops import reference
from linattn.ops._common import all_finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite_is_exact(dtype):
    big = torch.finfo(dtype).max
    x = torch.full((1000,), big, dtype=dtype)  # every element finite, the sum overflows: the exact test decides
    assert all_finite(x)
    assert all_finite(torch.empty(0, dtype=dtype))
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = torch.randn(3, 257, dtype=torch.float64).to(dtype)
        y[2, 200] = bad
        assert not all_finite(y), bad
        y = x.clone()
        y[-1] = bad  # among values whose sum alone overflows
        assert not all_finite(y), bad
    z = torch.tensor([float("inf"), float("-inf")], dtype=dtype)  # their sum is NaN, not a finite 0
    assert not all_finite(z)
    assert all_finite(torch.arange(5))  # integers are always finite


HAVE_CC = shutil.which(os.environ.get("CC", "").strip() or "cc") is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler (cc / $CC): the compiled CPU kernels cannot build")

CASES = [  # (feature map, B, T, H, K, V, gate, cu_seqlens, chunk, initial state, HV)
    ("elu+1", 2, 67, 2, 8, 5, None, None, 16, False, None),
    ("elu+1", 1, 1, 3, 4, 4, "g", None, 64, True, None),
    ("relu", 1, 45, 2, 6, 7, "gamma", [0, 3, 20, 45], 8, False, None),  # relu: den = 0 before any active key
    ("identity", 1, 33, 2, 4, 4, None, None, 8, False, None),  # signed den: the floor keeps its sign
    ("elu+1", 1, 40, 2, 4, 3, "g", None, 16, False, 4),  # grouped value heads, folded into the value width
    ("taylor2", 1, 29, 2, 4, 4, None, None, 8, True, None),  # features by PyTorch, not in the kernel
    ("magnitude_direction", 1, 21, 1, 4, 4, None, None, 8, False, None),  # signed weights
]


def _inputs(case, dtype, seed=0):
    fmap, B, T, H, K, V, gate, cu, C, init, HV = case
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, HV or H, V, generator=gen, dtype=torch.float64)
    kw = dict(feature_map=fmap, chunk_size=C, output_final_state=True)
    if gate == "g":
        kw["g"] = -torch.rand(B, T, H, generator=gen, dtype=torch.float64).to(dtype)
    elif gate == "gamma":
        kw["gamma"] = 0.9
    if cu is not None:
        kw["cu_seqlens"] = torch.tensor(cu)
    if init:
        _, st = linattn.linear_attention(q.to(dtype), k.to(dtype), v.to(dtype), backend="torch", **kw)
        kw["initial_state"] = st
    return q.to(dtype), k.to(dtype), v.to(dtype), kw


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[2]}-{c[6]}" for c in CASES])
def test_kernel_division_matches_finish_bitwise(case, dtype):
    """Without autograd the kernel returns num / den' itself: the same bits as the division in `finish` (taken
    when an input requires grad), the same final state, and within tolerance of the fp64 reference."""
    q, k, v, kw = _inputs(case, dtype)
    with torch.no_grad():
        o_fused, st_fused = linattn.linear_attention(q, k, v, backend="cpu", **kw)
    qg = q.clone().requires_grad_()
    o_torch, st_torch = linattn.linear_attention(qg, k, v, backend="cpu", **kw)
    assert torch.equal(o_fused, o_torch.detach())
    assert torch.equal(st_fused.kv, st_torch.kv.detach()) and torch.equal(st_fused.z, st_torch.z.detach())
    if dtype != torch.bfloat16 and case[0] in ("elu+1", "relu"):
        fmap, B, T, H, K, V, gate, cu, C, init, HV = case
        if cu is None and not init:
            lg = kw.get("g")
            if gate == "gamma":
                lg = torch.full((B, T, H), math.log(0.9), dtype=torch.float64)
            ref = reference.linear_attention_ref(q, k, v, fmap, log_gate=None if lg is None else lg.double())
            tol = 1e-4 if dtype == torch.float32 else 1e-10
            assert reference.rel_err(o_fused, ref) < tol


@needs_cc
def test_kernel_division_nonfinite_rows():
    """Poison: a NaN value and an inf key later in the sequence leave every earlier row's bits unchanged, and
    the rows they reach are non-finite as on the PyTorch path."""
    q, k, v, kw = _inputs(CASES[0], torch.float32)
    with torch.no_grad():
        clean, _ = linattn.linear_attention(q, k, v, backend="cpu", **kw)
        v2, k2 = v.clone(), k.clone()
        v2[0, 40, 1, 2] = float("nan")
        k2[1, 50, 0, 1] = float("inf")
        o, _ = linattn.linear_attention(q, k2, v2, backend="cpu", **kw)
        ot, _ = linattn.linear_attention(q, k2, v2, backend="torch", **kw)
    assert torch.equal(o[0, :40], clean[0, :40]) and torch.equal(o[1, :50], clean[1, :50])
    assert torch.equal(torch.isfinite(o), torch.isfinite(ot))
    assert not torch.isfinite(o[0, 40, 1]).all() and not torch.isfinite(o[1, 50, 0]).all()


@needs_cc
@pytest.mark.parametrize("fmap", [0, 1, 2])
def test_kernel_division_backward_matches_autograd(fmap):
    """The custom op called with eps >= 0 (o = num / den' in the kernel) has the division's backward in its backward
    kernel: the gradients of q, k, v, the gate and the initial state agree with autograd through the undivided op
    and PyTorch's floored division (fp64; tiny queries put some |den| under the floor, whose slope is 0)."""
    from linattn.cpu.linear import _fwd

    gen = torch.Generator().manual_seed(4)
    TT, H, K, V, eps = 23, 2, 4, 3, 1e-6
    q, k = (torch.randn(TT, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    q[::3] *= 1e-9 if fmap != 2 else 1.0
    v = torch.randn(TT, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(TT, H, generator=gen, dtype=torch.float64)
    S0 = torch.rand(2, H, K, V + 1, generator=gen, dtype=torch.float64)
    w = torch.randn(TT, H, V, generator=gen, dtype=torch.float64)
    grads = []
    for divided in (True, False):
        xs = [t.clone().requires_grad_() for t in (q, k, v, g, S0)]
        num, den, S, P, bad = _fwd(*xs, [0, 9, TT], 4, True, fmap, 1.0, True, eps if divided else -1.0)
        assert int(bad) == 0
        if not divided:
            d = torch.where(den < 0, torch.minimum(den, torch.tensor(-eps)), torch.maximum(den, torch.tensor(eps)))
            num = num / d.unsqueeze(-1)
        grads.append(torch.autograd.grad((num * w).sum() + S.square().sum(), xs))
    for a, b in zip(*grads):  # rtol: identity features give signed, ill-conditioned dens (gradients ~1e7)
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-12 * max(1.0, b.abs().max().item()))


@needs_cc
def test_kernel_division_flags_nonfinite_num():
    """The kernel flags a division that met inf / NaN in num: under autograd the call then runs undivided (the
    PyTorch division keeps the non-finite rows out of the other gradients), with the PyTorch path's gradients."""
    from linattn.cpu.linear import NUM_NONFINITE, OUT_NONFINITE, _fwd

    q, k = (torch.rand(9, 1, 4) for _ in range(2))
    v = torch.randn(9, 1, 3)
    assert int(_fwd(q, k, v, None, None, [0, 9], 4, True, 0, 1.0, False, 1e-6)[4]) == 0
    v[6, 0, 1] = float("inf")
    assert int(_fwd(q, k, v, None, None, [0, 9], 4, True, 0, 1.0, False, 1e-6)[4]) == NUM_NONFINITE | OUT_NONFINITE
    # no division: num is the output, flagged as such
    assert int(_fwd(q, k, v, None, None, [0, 9], 4, True, 0, 1.0, False, -1.0)[4]) == OUT_NONFINITE
    grads = {}
    for backend in ("cpu", "torch"):
        xs = [t.clone().double().unsqueeze(0).requires_grad_() for t in (q, k, v)]
        o, _ = linattn.linear_attention(*xs, feature_map="relu", chunk_size=4, backend=backend)
        grads[backend] = torch.autograd.grad(o[:, :6].sum(), xs)  # the rows before the inf value
    for a, b in zip(grads["cpu"], grads["torch"]):  # rows >= 6 meet inf * 0 = NaN on both paths
        assert torch.isfinite(a[:, :6]).all()
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, equal_nan=True)


@needs_cc
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-T{c[2]}-{c[6]}" for c in CASES])
def test_lean_division_gradients(case):
    """Under autograd the compiled path divides through `_FlooredDivide` (its own backward): the gradients of
    q, k, v (and of the gate) agree with the PyTorch forms' autograd division in fp64, den floor included."""
    q, k, v, kw = _inputs(case, torch.float64, seed=1)
    grads = {}
    for backend in ("cpu", "torch"):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        kw2 = dict(kw)
        if "g" in kw2:
            kw2["g"] = kw2["g"].clone().requires_grad_()
            xs.append(kw2["g"])
        o, _ = linattn.linear_attention(*xs[:3], backend=backend, **kw2)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(2), dtype=o.dtype)
        grads[backend] = torch.autograd.grad((o * w).sum(), xs)
    for a, b in zip(grads["cpu"], grads["torch"]):  # atol: gradients that are 0 in exact arithmetic (T = 1)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13 * max(1.0, b.abs().max().item()))


@needs_cc
@pytest.mark.parametrize("fmap", ["relu", "identity"])
def test_lean_division_floor_slope(fmap):
    """Rows whose |den| < eps (tiny queries) are floored: the floor has slope 0, so they send no gradient
    through den; the compiled path's backward agrees with autograd's there (fp64)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 12, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    q = q.abs() if fmap == "relu" else q
    q[:, ::2] *= 1e-9  # every other row: |den| ~ 1e-9 < eps = 1e-6
    grads = {}
    for backend in ("cpu", "torch"):
        xs = [t.clone().requires_grad_() for t in (q, k, v)]
        o, _ = linattn.linear_attention(*xs, feature_map=fmap, chunk_size=4, backend=backend)
        grads[backend] = torch.autograd.grad(o.square().sum(), xs)
    for a, b in zip(grads["cpu"], grads["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13 * max(1.0, b.abs().max().item()))


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_flags_output_overflow(dtype):
    """An output that overflows from finite num (signed weights summing to den = 0, floored to eps) is flagged as
    output, not as num: the lean backward still applies, and linear_attention's overflow error still comes."""
    from linattn.cpu.linear import OUT_NONFINITE, _fwd

    big = torch.finfo(dtype).max / 4
    q = torch.ones(2, 1, 1, dtype=dtype)
    k = torch.tensor([1.0, -1.0], dtype=dtype).view(2, 1, 1)
    v = torch.tensor([big, -big], dtype=dtype).view(2, 1, 1)  # num_1 = 2 big / 2 ... = big; den_1 = 0
    num, den, _, _, flags = _fwd(q, k, v, None, None, [0, 2], 4, True, 0, 1.0, False, 1e-6)
    assert int(flags) == OUT_NONFINITE and torch.isinf(num[1]).all() and torch.isfinite(num[0]).all()
    with pytest.raises(linattn.LinattnError, match="overflowed"):
        linattn.linear_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), feature_map="identity",
                                 backend="cpu")


def _planted(where: str, bad: float, dtype, T=200, H=3, C=16):
    """q, k, v [1, T, H, 4] with `bad` in one value of one row of head 1: in the first, a middle or the last chunk."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, T, H, 4, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))
    row = {"first": 3, "middle": T // 2 + 5, "last": T - 2}[where]
    v[0, row, 1, 2] = bad
    return q, k, v, row


@needs_cc
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_planted_nonfinite_matches_torch_path(monkeypatch, threads, where, bad):
    """A NaN / inf value planted in one row of one head: the compiled path (its kernel's flags deciding the lean
    backward and the output check) gives the PyTorch path's outputs and gradients, NaN where it has NaN, in fp64
    (the rows before it finite); the heads it cannot reach match the fp64 reference, outputs and gradients."""
    from linattn.cpu import linear as clinear

    monkeypatch.setattr(clinear, "GRAIN", 1.0)  # a small call: the kernels would otherwise get one thread
    q, k, v, row = _planted(where, bad, torch.float64)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    got = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for backend in ("cpu", "torch"):
            xs = [t.clone().requires_grad_() for t in (q, k, v)]
            o, _ = linattn.linear_attention(*xs, feature_map="elu+1", chunk_size=16, backend=backend)
            # the loss reads the rows before the planted one, and head 0 everywhere
            mask = torch.zeros_like(o)
            mask[:, :row] = 1
            mask[:, :, 0] = 1
            got[backend] = (o.detach(), *torch.autograd.grad((o * w * mask).sum(), xs))
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(got["cpu"], got["torch"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, equal_nan=True)
    o = got["cpu"][0]
    assert not torch.isfinite(o[0, row, 1]).all() and torch.isfinite(o[0, :row]).all()
    assert all(torch.isfinite(d[0, :row]).all() for d in got["cpu"][1:])
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference.linear_attention_ref(*xs, "elu+1")
    # the reference's masked products (0 * NaN) poison its whole head 1: heads 0 and 2, which never see the value
    dref = torch.autograd.grad((ref * w * mask).sum(), xs)
    for h in (0, 2):
        torch.testing.assert_close(o[:, :, h], ref[:, :, h].detach(), rtol=1e-9, atol=1e-11)
        for a, b in zip(got["cpu"][1:], dref):
            torch.testing.assert_close(a[:, :, h], b[:, :, h], rtol=1e-9, atol=1e-11)


def test_nonfinite_flag_values_match_the_c_source():
    """cpu/linear.py reads the forward's flags by the values linear.c defines."""
    import re
    from pathlib import Path

    from linattn.cpu import linear as clinear

    text = (Path(clinear.__file__).parent / "csrc" / "linear.c").read_text()
    flags = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define LIN_(\w+_NONFINITE) (\d+)", text)}
    assert flags == {"NUM_NONFINITE": clinear.NUM_NONFINITE, "OUT_NONFINITE": clinear.OUT_NONFINITE}
