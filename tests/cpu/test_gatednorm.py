"""The output norm with its gate on the compiled kernel (cpu/gatednorm.py, csrc/gatednorm.c) against an fp64
reference written from the formula y = x / sqrt(mean x^2 + eps) * w * silu(gate) and against the PyTorch form
(GatedRMSNorm): outputs and the gradients of x, gate and weight; fp32 / fp64, with and without gate and weight,
odd widths, one row; NaN / inf rows stay in their rows as in the PyTorch form; thread counts give the same bits;
the layer's output on the kernel and with LINATTN_CPU_KERNELS=0."""
import pytest
import torch

from linattn.cpu import gatednorm as cpu_gnorm
from linattn.layers import GatedDeltaNet
from linattn.layers.common import GatedRMSNorm

pytestmark = pytest.mark.skipif(not cpu_gnorm.available(), reason="no C compiler: the compiled kernels are off")


def reference(x, gate, w, eps):
    """fp64, from the formula."""
    xd = x.double()
    y = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w.double()
    if gate is not None:
        gd = gate.double()
        y = y * gd / (1 + torch.exp(-gd))
    return y


def _norm(D, dtype, affine):
    n = GatedRMSNorm(D, elementwise_affine=affine).to(dtype)
    if affine:
        with torch.no_grad():
            n.weight.copy_(torch.randn(D, dtype=dtype))
    return n


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("shape", [(2, 45, 3, 64), (1, 1, 1, 5), (130, 7)])
def test_against_reference_and_torch(dtype, gated, affine, shape):
    torch.manual_seed(0)
    n = _norm(shape[-1], dtype, affine)
    x = (3 * torch.randn(shape, dtype=dtype)).requires_grad_()
    gate = (2 * torch.randn(shape, dtype=dtype)).requires_grad_() if gated else None
    gy = torch.randn(shape, dtype=dtype)
    wrt = [t for t in (x, gate, n.weight) if t is not None]
    y = cpu_gnorm.gated_rms_norm(n, x, gate)
    grads = torch.autograd.grad(y, wrt, gy)
    y_t = n(x, gate)
    grads_t = torch.autograd.grad(y_t, wrt, gy)
    ref_in = [t.detach().double().requires_grad_() for t in wrt]
    xr = ref_in[0]
    gr = ref_in[1] if gated else None
    wr = ref_in[-1] if affine else None
    y_r = reference(xr, gr, wr, n.eps)
    grads_r = torch.autograd.grad(y_r, ref_in, gy.double())
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), y_r, **tol)
    torch.testing.assert_close(y, y_t, **tol)
    for a, b, r in zip(grads, grads_t, grads_r):
        torch.testing.assert_close(a.double(), r, **tol)
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["x", "gate"])
def test_non_finite_rows_as_torch(bad, where):
    torch.manual_seed(1)
    n = _norm(16, torch.float32, True)
    x, gate = torch.randn(2, 5, 16), torch.randn(2, 5, 16)
    (x if where == "x" else gate)[1, 3, 7] = bad
    x.requires_grad_()
    gate.requires_grad_()
    gy = torch.randn(2, 5, 16)
    y = cpu_gnorm.gated_rms_norm(n, x, gate)
    y_t = n(x, gate)
    assert torch.equal(torch.isnan(y), torch.isnan(y_t)) and torch.equal(torch.isinf(y), torch.isinf(y_t))
    # every other row is finite and right
    ok = torch.ones(2, 5, dtype=torch.bool)
    ok[1, 3] = False
    assert torch.isfinite(y[ok]).all()
    torch.testing.assert_close(y[ok], y_t[ok], atol=2e-5, rtol=2e-5)
    dx, dg = torch.autograd.grad(y, (x, gate), gy)
    dx_t, dg_t = torch.autograd.grad(y_t, (x, gate), gy)
    torch.testing.assert_close(dx[ok], dx_t[ok], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(dg[ok], dg_t[ok], atol=2e-5, rtol=2e-5)
    assert torch.equal(torch.isfinite(dx), torch.isfinite(dx_t))


def test_thread_counts_same_bits():
    torch.manual_seed(2)
    n = _norm(64, torch.float32, True)
    x = torch.randn(4, 300, 64, requires_grad=True)
    gate = torch.randn(4, 300, 64, requires_grad=True)
    gy = torch.randn(4, 300, 64)
    before = torch.get_num_threads()
    out = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            y = cpu_gnorm.gated_rms_norm(n, x, gate)
            out.append((y, *torch.autograd.grad(y, (x, gate, n.weight), gy)))
    finally:
        torch.set_num_threads(before)
    for other in out[1:]:
        for a, b in zip(out[0], other):
            assert torch.equal(a, b)


def test_falls_back_when_switched_off(monkeypatch):
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    n = _norm(8, torch.float32, True)
    x, gate = torch.randn(3, 8), torch.randn(3, 8)
    assert not cpu_gnorm.available()
    assert torch.equal(cpu_gnorm.gated_rms_norm(n, x, gate), n(x, gate))


def test_not_plain_uses_torch():
    n = GatedRMSNorm(8, gate_act="sigmoid")
    x, gate = torch.randn(3, 8), torch.randn(3, 8)
    assert torch.equal(cpu_gnorm.gated_rms_norm(n, x, gate), n(x, gate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_layer_matches_switched_off(dtype, monkeypatch):
    torch.manual_seed(3)
    layer = GatedDeltaNet(64, 2).to(dtype)
    x = torch.randn(2, 33, 64, dtype=dtype, requires_grad=True)
    gy = torch.randn(2, 33, 64, dtype=dtype)

    def run():
        y = layer(x)
        return (y, *torch.autograd.grad(y, (x, layer.o_norm.weight, layer.g_proj.weight), gy))

    fast = run()
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    slow = run()
    tol = dict(atol=5e-5, rtol=5e-5) if dtype == torch.float32 else dict(atol=1e-11, rtol=1e-11)
    for a, b in zip(fast, slow):
        torch.testing.assert_close(a, b, **tol)
