"""The delta rule's preprocessing on the compiled kernel (prepare_delta(fused=True): cpu/delta.py delta_prepare and
delta_prepare_raw, csrc/deltaprep.c): q/k L2 normalisation ("rsqrt") or none (EFLA's coefficient, the raw form),
scale and the key-norm rescaling in one pass each way, against
the PyTorch lines of prepare_delta (the fallback) and an fp64 reference written from the formula: outputs and the
gradients of q, k, v and beta; fp32 / fp64, T = 1 and odd T; zero keys, keys whose sum of squares overflows, inf and
NaN rows (the same rows non-finite, no other row touched); delta_rule with qk_l2norm on the kernels against the fp64
reference (cu_seqlens, gates); prefix bitwise; thread counts bitwise; what turns it off (LINATTN_CPU_KERNELS=0,
backend="torch", "clamp", EFLA's coefficient, grouped value heads)."""
from __future__ import annotations

import pytest
import torch

from linattn import delta_rule
from linattn.cpu import delta as cpu_delta
from linattn.ops.delta_core import efla_coefficient, prepare_delta
from linattn.ops.reference import delta_rule_ref

pytestmark = [pytest.mark.skipif(not cpu_delta.prep_available(torch.float32),
                                 reason="no C compiler: the compiled kernels are off"),
              pytest.mark.usefixtures("one_thread_module")]

TOL = {torch.float32: 2e-5, torch.float64: 1e-12}
EPS = 1e-6


def reference(q, k, v, beta, scale):
    """fp64, from the formula: l2(x) = x / sqrt(sum x^2 + eps); d = max(|l2(k)|, 1) held constant."""
    q, k, v, beta = (t.double() for t in (q, k, v, beta))
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + EPS)
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + EPS)
    d2 = (kn * kn).sum(-1).detach().clamp_min(1.0)
    d = d2.sqrt().unsqueeze(-1)
    return qn * scale, kn / d, v / d, beta * d2


def _inputs(dtype, B=2, T=37, H=3, K=16, V=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = 3 * torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = 3 * torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    return q, k, v, beta


def _prep(x, fused, scale=0.3):
    leaves = [t.clone().requires_grad_() for t in x]
    p = prepare_delta(*leaves, qk_l2norm=True, scale=scale, fused=fused)
    return leaves, (p.q, p.k, p.v, p.a), p


def _check(x, dtype, scale=0.3):
    leaves, out, p = _prep(x, True, scale)
    assert type(p.q.grad_fn).__name__ == "_DeltaPrepBackward"
    tl, tout, tp = _prep(x, False, scale)
    assert type(tp.q.grad_fn).__name__ != "_DeltaPrepBackward"
    rl = [t.clone().double().requires_grad_() for t in x]
    rout = reference(*rl, scale)
    ws = [torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i, o in enumerate(out)]
    grads = torch.autograd.grad(sum((o.double() * w).sum() for o, w in zip(out, ws)), leaves)
    tgrads = torch.autograd.grad(sum((o.double() * w).sum() for o, w in zip(tout, ws)), tl)
    rgrads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(rout, ws)), rl)
    for name, a, t, r in zip(["q", "k", "v", "a", "dq", "dk", "dv", "dbeta"], [*out, *grads], [*tout, *tgrads],
                             [*rout, *rgrads]):
        assert a.dtype == dtype, name
        _close(a, r, TOL[dtype], f"{name} vs the fp64 reference")
        _close(a, t, TOL[dtype], f"{name} vs the PyTorch form")


def _close(a, b, tol, what):
    """The largest error relative to the largest entry (at least 1): the gradients of tiny keys are ~1e3."""
    err = (a.double() - b.double()).abs().max().item() / max(1.0, b.double().abs().max().item())
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 37])
def test_against_reference_and_torch(dtype, T):
    x = _inputs(dtype, T=T)
    x[1][0, 0, 1] = 0.0                       # a zero key: l2 = 0, d = 1
    _check(x, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_and_unit_keys(dtype):
    """Keys of norm ~1e-3 (the eps matters) and normalised keys (|l2(k)| rounds to 1 or just above: d != 1)."""
    q, k, v, beta = _inputs(dtype, K=5, V=3)
    k[0] = k[0] * 1e-3
    k[1] = torch.nn.functional.normalize(k[1], dim=-1) * 1e4
    _check((q, k, v, beta), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_overflowing_rows_as_torch(dtype):
    """A row whose sum of squares overflows takes l2norm.py's scaled form on both paths: finite, the right
    direction, gradients as the PyTorch form's."""
    big = 1e20 if dtype == torch.float32 else 1e160
    q, k, v, beta = _inputs(dtype, T=5)
    k[0, 2, 1] = k[0, 2, 1] * big
    q[1, 3, 0] = q[1, 3, 0] * big
    leaves, out, _ = _prep((q, k, v, beta), True)
    tl, tout, _ = _prep((q, k, v, beta), False)
    for a, t in zip(out, tout):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, t, atol=TOL[dtype], rtol=TOL[dtype])
    w = [torch.randn(o.shape, dtype=dtype) for o in out]
    grads = torch.autograd.grad(sum((o * c).sum() for o, c in zip(out, w)), leaves)
    tgrads = torch.autograd.grad(sum((o * c).sum() for o, c in zip(tout, w)), tl)
    for a, t in zip(grads, tgrads):
        torch.testing.assert_close(a, t, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["q", "k"])
def test_non_finite_rows_stay_in_their_rows(value, where):
    q, k, v, beta = _inputs(torch.float32, T=6)
    (q if where == "q" else k)[1, 4, 2, 3] = value
    leaves, out, _ = _prep((q, k, v, beta), True)
    tl, tout, _ = _prep((q, k, v, beta), False)
    for a, t in zip(out, tout):
        assert torch.equal(torch.isfinite(a), torch.isfinite(t))
    ok = torch.ones(2, 6, 3, dtype=torch.bool)
    ok[1, 4, 2] = False
    for a, t in zip(out, tout):
        assert torch.isfinite(a[ok]).all()
        torch.testing.assert_close(a[ok], t[ok], atol=2e-5, rtol=2e-5)
    grads = torch.autograd.grad(sum(o.sum() for o in out), leaves)
    tgrads = torch.autograd.grad(sum(o.sum() for o in tout), tl)
    for a, t in zip(grads, tgrads):
        assert torch.equal(torch.isfinite(a), torch.isfinite(t))
        torch.testing.assert_close(a[ok], t[ok], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_delta_rule_with_l2norm_against_reference(dtype, gated, packed):
    g = torch.Generator().manual_seed(5)
    B, T, H, K, V = (1, 71, 2, 8, 5) if packed else (2, 45, 2, 8, 5)
    q, k = torch.randn(B, T, H, K, generator=g, dtype=dtype), torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v, beta = torch.randn(B, T, H, V, generator=g, dtype=dtype), torch.rand(B, T, H, generator=g, dtype=dtype)
    gate = -0.5 * torch.rand(B, T, H, generator=g, dtype=dtype) if gated else None
    offsets = [0, 1, 71] if packed else None
    cu = torch.tensor(offsets) if packed else None
    N = 2 if packed else B
    S0 = torch.randn(N, H, K, V, generator=g, dtype=dtype)
    wo = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, beta, S0)]
    o, S = delta_rule(*leaves[:4], g=gate, qk_l2norm=True, initial_state=leaves[4], output_final_state=True,
                      cu_seqlens=cu, backend="cpu")
    grads = torch.autograd.grad((o.double() * wo).sum() + S.double().sum(), leaves)
    rl = [t.clone().double().requires_grad_() for t in (q, k, v, beta, S0)]
    if packed:
        parts = [delta_rule_ref(*(t[:, lo:hi] for t in rl[:4]), g=gate[:, lo:hi] if gated else None,
                                qk_l2norm=True, S0=rl[4][i:i + 1]) for i, (lo, hi) in enumerate(zip(offsets[:-1],
                                                                                                     offsets[1:]))]
        ro, rS = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts])
    else:
        ro, rS = delta_rule_ref(*rl[:4], g=gate, qk_l2norm=True, S0=rl[4])
    rgrads = torch.autograd.grad((ro * wo).sum() + rS.sum(), rl)
    tol = 2e-5 if dtype == torch.float32 else 1e-11
    for a, r in zip([o, S, *grads], [ro, rS, *rgrads]):
        torch.testing.assert_close(a.double(), r, atol=tol, rtol=tol)


def test_prefix_and_thread_counts_bitwise():
    q, k, v, beta = _inputs(torch.float32, T=40)
    q[:, 30:] = float("inf")     # later poison never reaches an earlier row
    full = prepare_delta(q, k, v, beta, qk_l2norm=True, fused=True)
    pre = prepare_delta(q[:, :30], k[:, :30], v[:, :30], beta[:, :30], qk_l2norm=True, fused=True)
    for a, b in zip((full.q, full.k, full.v, full.a), (pre.q, pre.k, pre.v, pre.a)):
        assert torch.equal(a[:, :30], b)
    before = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            leaves, out, _ = _prep(_inputs(torch.float32, T=40), True)
            outs.append((*out, *torch.autograd.grad(sum(o.sum() for o in out), leaves)))
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def _fused_used(**kw):
    q, k, v, beta = _inputs(torch.float32, T=4)
    q.requires_grad_()
    p = prepare_delta(q, k, v, beta, **kw)
    return type(p.q.grad_fn).__name__ in ("_DeltaPrepBackward", "_DeltaPrepRawBackward",
                                                 "_DeltaPrepRawABackward")


def test_what_turns_it_off(monkeypatch):
    assert _fused_used(qk_l2norm=True, fused=True)
    assert not _fused_used(qk_l2norm=True)                                  # prepare_delta's default
    assert not _fused_used(qk_l2norm="clamp", fused=True)
    assert not _fused_used(qk_l2norm=True, fused=True, coefficient=lambda b, lam: b)
    assert _fused_used(qk_l2norm=False, fused=True, coefficient=efla_coefficient)   # the raw form (EFLA)
    assert _fused_used(qk_l2norm=False, fused=True)
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    assert not _fused_used(qk_l2norm=True, fused=True)


def test_delta_rule_backend_torch_keeps_the_pytorch_preprocessing(monkeypatch):
    seen = []
    real = cpu_delta.delta_prepare
    monkeypatch.setattr(cpu_delta, "delta_prepare", lambda *a: seen.append(1) or real(*a))
    q, k, v, beta = _inputs(torch.float32, T=4)
    o_t, _ = delta_rule(q, k, v, beta, qk_l2norm=True, backend="torch")
    assert not seen
    # the compiled kernels, with a gradient too: the scans prepare the rows themselves (test_delta_fused_prep.py)
    o_c, _ = delta_rule(q.clone().requires_grad_(), k, v, beta, qk_l2norm=True, backend="auto")
    assert not seen
    torch.testing.assert_close(o_c.detach(), o_t, atol=2e-5, rtol=2e-5)
    # the pass, where the problem is prepared for any backend (no backend given)
    p = prepare_delta(q.clone().requires_grad_(), k, v, beta, qk_l2norm=True, fused=True)
    assert seen and p.prep is None


# ------------------------------------------------------------------ the raw form (no normalisation: EFLA)

def reference_raw(q, k, v, beta, scale, coefficient):
    """fp64, from the formula: lam = |k|^2, d = sqrt(max(lam, 1)) held constant, a = coefficient(beta, lam) d^2."""
    q, k, v, beta = (t.double() for t in (q, k, v, beta))
    lam = (k * k).sum(-1)
    d2 = lam.detach().clamp_min(1.0)
    d = d2.sqrt().unsqueeze(-1)
    a = coefficient(beta, lam) if coefficient is not None else beta
    return q * scale, k / d, v / d, a * d2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("T", [1, 37])
def test_raw_against_reference_and_torch(dtype, exact, T):
    q, k, v, beta = _inputs(dtype, T=T)
    k = k * 0.3                                   # norms on both sides of 1 (d = 1 and d > 1)
    k[0, 0, 1] = 0.0
    coef = efla_coefficient if exact else None
    x = (q, k, v, beta)
    leaves = [t.clone().requires_grad_() for t in x]
    p = prepare_delta(*leaves, coefficient=coef, scale=0.3, fused=True)
    # without a coefficient a = beta d2 comes from the same pass (delta_prepare_raw_a)
    assert type(p.q.grad_fn).__name__ == ("_DeltaPrepRawBackward" if exact else "_DeltaPrepRawABackward")
    tl = [t.clone().requires_grad_() for t in x]
    tp = prepare_delta(*tl, coefficient=coef, scale=0.3)
    rl = [t.clone().double().requires_grad_() for t in x]
    rout = reference_raw(*rl, 0.3, efla_coefficient if exact else None)
    out, tout = (p.q, p.k, p.v, p.a), (tp.q, tp.k, tp.v, tp.a)
    ws = [torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
          for i, o in enumerate(out)]
    grads = torch.autograd.grad(sum((o.double() * w).sum() for o, w in zip(out, ws)), leaves)
    tgrads = torch.autograd.grad(sum((o.double() * w).sum() for o, w in zip(tout, ws)), tl)
    rgrads = torch.autograd.grad(sum((o * w).sum() for o, w in zip(rout, ws)), rl)
    for name, a, t, r in zip(["q", "k", "v", "a", "dq", "dk", "dv", "dbeta"], [*out, *grads], [*tout, *tgrads],
                             [*rout, *rgrads]):
        assert a.dtype == dtype, name
        _close(a, r, TOL[dtype], f"raw {name} vs the fp64 reference")
        _close(a, t, TOL[dtype], f"raw {name} vs the PyTorch form")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("coefficient", [efla_coefficient, None])
def test_raw_overflowing_and_non_finite_rows_as_torch(dtype, coefficient):
    """|k|^2 overflowing the float sum (summed in double, as key_norms), inf and NaN keys: the PyTorch form's
    values and non-finite pattern, every other row untouched (EFLA's coefficient, and a = beta d2 from the pass)."""
    q, k, v, beta = _inputs(dtype, T=6)
    k[0, 2, 1] = k[0, 2, 1] * (3e19 if dtype == torch.float32 else 1e150)
    k[1, 4, 2, 3] = float("nan")
    k[1, 1, 0, 0] = float("inf")
    outs = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, beta)]
        p = prepare_delta(*leaves, coefficient=coefficient, fused=fused)
        out = (p.q, p.k, p.v, p.a)
        outs.append((*out, *torch.autograd.grad(sum(o.sum() for o in out), leaves)))
    for a, t in zip(*outs):
        assert torch.equal(torch.isnan(a), torch.isnan(t)) and torch.equal(torch.isinf(a), torch.isinf(t))
        fin = torch.isfinite(t)
        torch.testing.assert_close(a[fin], t[fin], atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gated", [False, True])
def test_efla_delta_rule_against_reference(dtype, gated):
    g = torch.Generator().manual_seed(6)
    B, T, H, K, V = 2, 45, 2, 8, 5
    q, k = torch.randn(B, T, H, K, generator=g, dtype=dtype), 0.6 * torch.randn(B, T, H, K, generator=g, dtype=dtype)
    v, beta = torch.randn(B, T, H, V, generator=g, dtype=dtype), torch.rand(B, T, H, generator=g, dtype=dtype)
    gate = -0.5 * torch.rand(B, T, H, generator=g, dtype=dtype) if gated else None
    wo = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, beta)]
    o, _ = delta_rule(*leaves, g=gate, exact=True, backend="cpu")
    grads = torch.autograd.grad((o.double() * wo).sum(), leaves)
    rl = [t.clone().double().requires_grad_() for t in (q, k, v, beta)]
    ro, _ = delta_rule_ref(*rl, g=gate, exact=True)
    rgrads = torch.autograd.grad((ro * wo).sum(), rl)
    for a, r in zip([o, *grads], [ro, *rgrads]):
        _close(a, r, 2e-5 if dtype == torch.float32 else 1e-11, "EFLA on the kernels vs the fp64 reference")


# ------------------------------------------------------------------ a layer's own q normalisation (EFLA)

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_l2_rows_against_reference_and_l2_normalize(dtype):
    """cpu.delta.l2_rows against the fp64 formula and layers.common.l2_normalize (the PyTorch form): values and
    gradients; zero, tiny, overflowing, inf and NaN rows as the PyTorch form (non-finite pattern, other rows)."""
    from linattn.layers.common import l2_normalize

    q = _inputs(dtype, T=9)[0]
    q[0, 0, 0] = 0.0
    q[0, 1, 1] = q[0, 1, 1] * 1e-4
    q[0, 2, 2] = q[0, 2, 2] * (1e20 if dtype == torch.float32 else 1e160)
    q[1, 3, 0, 5] = float("nan")
    q[1, 4, 1, 2] = float("inf")
    gy = torch.randn(q.shape, dtype=dtype)
    x1, x2, xr = q.clone().requires_grad_(), q.clone().requires_grad_(), q.clone().double().requires_grad_()
    y1 = cpu_delta.l2_rows(x1, EPS)
    y2 = l2_normalize(x2)
    g1, = torch.autograd.grad(y1, x1, gy)
    g2, = torch.autograd.grad(y2, x2, gy)
    for a, t in ((y1, y2), (g1, g2)):
        assert a.dtype == dtype
        assert torch.equal(torch.isfinite(a), torch.isfinite(t))
        fin = torch.isfinite(t)
        torch.testing.assert_close(a[fin], t[fin], atol=TOL[dtype], rtol=TOL[dtype])
    ok = torch.ones(2, 9, 3, dtype=torch.bool)
    ok[0, 2, 2] = ok[1, 3, 0] = ok[1, 4, 1] = False     # the plain formula overflows / is not finite there
    yr = xr / torch.sqrt((xr * xr).sum(-1, keepdim=True) + EPS)
    gr, = torch.autograd.grad(yr, xr, gy.double())
    _close(y1[ok], yr[ok], TOL[dtype], "l2_rows vs the fp64 formula")
    _close(g1[ok], gr[ok], TOL[dtype], "l2_rows' gradient vs the fp64 formula")


def test_efla_layer_on_the_kernels_matches_switched_off(monkeypatch):
    from linattn.layers import EFLA

    torch.manual_seed(4)
    layer = EFLA(64, 2).double()
    x = torch.randn(2, 37, 64, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(2, 37, 64, dtype=torch.float64)

    def run():
        y = layer(x)
        return (y, *torch.autograd.grad(y, (x, layer.q_proj.weight, layer.k_proj.weight), gy))

    fast = run()
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    slow = run()
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)
