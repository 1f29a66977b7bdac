"""The compiled short convolution with x and its look-back apart (cpu/conv.py short_conv_sep, csrc/conv.c) over
many backward blocks (64 padded rows each): against an fp64 formula and the padded-input entry point, outputs and
the gradients of x, the look-back, weight and bias; the same bits for every thread count (per-block partial sums)."""
import pytest
import torch
import torch.nn.functional as F

from linattn.cpu import conv as cpu_conv

pytestmark = pytest.mark.skipif(not cpu_conv.available(), reason="no C compiler: the compiled kernels are off")


def _case(dtype, T=200, K=4, D=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, T, D, generator=g, dtype=dtype).requires_grad_()
    past = torch.randn(2, K - 1, D, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(K, D, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(D, generator=g, dtype=dtype).requires_grad_()
    return x, past, w, b


def _formula(x, past, w, b, silu):
    xp = torch.cat([past if past is not None else x.new_zeros(x.shape[0], w.shape[0] - 1, x.shape[2]), x], 1)
    T, K = x.shape[1], w.shape[0]
    y = sum(xp[:, j:j + T] * w[j] for j in range(K)) + b
    return F.silu(y) if silu else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("with_past", [True, False])
def test_sep_against_formula_and_padded(dtype, silu, with_past):
    x, past, w, b = _case(dtype)
    p = past if with_past else None
    wrt = [t for t in (x, past, w, b) if t is not None and (t is not past or with_past)]
    gy = torch.randn(x.shape, dtype=dtype)
    y = cpu_conv.short_conv_sep(x, p, w, b, silu)
    got = torch.autograd.grad(y, wrt, gy)
    xp = torch.cat([p if p is not None else x.new_zeros(2, 3, x.shape[2]), x], 1)
    y_pad = cpu_conv.short_conv(xp, w, b, silu)
    got_pad = torch.autograd.grad(y_pad, wrt, gy)
    ref_in = [t.detach().double().requires_grad_() for t in wrt]
    y_ref = _formula(ref_in[0], ref_in[1] if with_past else None, ref_in[-2], ref_in[-1], silu)
    exp = torch.autograd.grad(y_ref, ref_in, gy.double())
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(y.double(), y_ref, **tol)
    torch.testing.assert_close(y, y_pad, **tol)
    for a, c, r in zip(got, got_pad, exp):
        torch.testing.assert_close(a.double(), r, **tol)
        torch.testing.assert_close(a, c, **tol)


def test_thread_counts_same_bits():
    x, past, w, b = _case(torch.float32, T=300)
    gy = torch.randn(x.shape)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            y = cpu_conv.short_conv_sep(x, past, w, b, True)
            outs.append((y, *torch.autograd.grad(y, (x, past, w, b), gy)))
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        for a, c in zip(outs[0], other):
            assert torch.equal(a, c)
