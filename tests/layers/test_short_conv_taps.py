"""ShortConv on the CPU for T > 1 (`ShortConv._taps`: K shifted multiply-adds in [B, T, D]) against the
formula in fp64 (y_t = act(bias + sum_j w_j x_{t-K+1+j}), the look-back from the state or zeros): outputs, returned
states and the gradients of x, weight, bias and the state; fp32 and fp64, T below and above K, K = 1."""
import pytest
import torch
import torch.nn.functional as F

from linattn.cpu import conv as cpu_conv
from linattn.layers.common import ShortConv


def reference(x, w, b, state, act):
    """fp64 loop over taps and times, written from the formula."""
    B, T, D = x.shape
    K = w.shape[-1]
    xd, wd = x.double(), w.double().view(D, K)
    past = state.double().transpose(1, 2) if state is not None else torch.zeros(B, K - 1, D, dtype=torch.float64)
    xp = torch.cat([past, xd], 1)                                      # [B, K - 1 + T, D]
    ys = []
    for t in range(T):
        y = sum(xp[:, t + j] * wd[:, j] for j in range(K))
        if b is not None:
            y = y + b.double()
        ys.append(F.silu(y) if act else y)
    return torch.stack(ys, 1), xp[:, T:].transpose(1, 2)


@pytest.fixture(params=["compiled", "torch"])
def path(request, monkeypatch):
    """Both forms: the compiled kernel (cpu/conv.py; skipped without a compiler) and the PyTorch taps."""
    if request.param == "compiled":
        if not cpu_conv.available():
            pytest.skip("no C compiler: the compiled kernels are off")
    else:
        monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T,K", [(2, 4), (3, 4), (7, 4), (65, 4), (5, 1), (6, 2)])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("act,bias", [("silu", False), (None, True)])
def test_taps_equal_the_formula_with_gradients(dtype, T, K, with_state, act, bias, path, monkeypatch):
    calls = []
    inner, inner_sep = cpu_conv.short_conv, cpu_conv.short_conv_sep   # padded input (T < K - 1) / look-back apart
    monkeypatch.setattr(cpu_conv, "short_conv", lambda *a: calls.append(1) or inner(*a))
    monkeypatch.setattr(cpu_conv, "short_conv_sep", lambda *a: calls.append(1) or inner_sep(*a))
    torch.manual_seed(T * 10 + K)
    conv = ShortConv(6, K, activation=act, bias=bias).to(dtype)
    if bias:
        with torch.no_grad():
            conv.bias.normal_()
    x = torch.randn(2, T, 6, dtype=dtype, requires_grad=True)
    state = torch.randn(2, 6, K - 1, dtype=dtype, requires_grad=True) if with_state else None
    y, new = conv(x, state)
    want, want_state = reference(x, conv.weight, conv.bias, state, act)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(y.double(), want, **tol)
    torch.testing.assert_close(new.double(), want_state, **tol)
    g = torch.randn_like(want)
    params = [x, conv.weight] + ([conv.bias] if bias else []) + ([state] if with_state else [])
    got = torch.autograd.grad((y.double() * g).sum(), params)
    exp = torch.autograd.grad((want * g).sum(), params)
    for a, b in zip(got, exp):
        torch.testing.assert_close(a.double(), b.double(), **tol)
    assert len(calls) == (path == "compiled")   # the form under test ran


def test_compiled_conv_poison_stays_causal(monkeypatch):
    """A NaN input reaches only outputs at or after it; the gradients are poisoned exactly where the PyTorch
    form's are (a zero gradient through silu'(NaN) is NaN in both)."""
    if not cpu_conv.available():
        pytest.skip("no C compiler: the compiled kernels are off")
    conv = ShortConv(4, 4)
    x0 = torch.randn(1, 10, 4)
    x0[0, 6, 1] = float("nan")
    grads = []
    for env in ("1", "0"):
        monkeypatch.setenv("LINATTN_CPU_KERNELS", env)
        x = x0.clone().requires_grad_(True)
        y, _ = conv(x)
        assert torch.isfinite(y[:, :6]).all() and torch.isnan(y[0, 6:, 1]).all()
        y[:, :6].sum().backward()
        grads.append(x.grad)
    assert torch.equal(torch.isnan(grads[0]), torch.isnan(grads[1]))
    torch.testing.assert_close(grads[0].nan_to_num(), grads[1].nan_to_num())


def test_taps_continue_a_previous_call_and_keep_a_small_state(path):
    """Two calls chained by the returned state give the one call's output; the state is a [B, D, K-1] copy."""
    conv = ShortConv(5, 4)
    x = torch.randn(1, 12, 5)
    with torch.no_grad():
        full, _ = conv(x)
        a, s = conv(x[:, :7])
        b, _ = conv(x[:, 7:], s)
    torch.testing.assert_close(torch.cat([a, b], 1), full)
    assert s.shape == (1, 5, 3) and s.is_contiguous() and s.untyped_storage().nbytes() == 15 * 4


def test_bf16_keeps_conv1d():
    """bf16 inputs keep F.conv1d (it accumulates in fp32; the taps would round after every tap): the same bits."""
    conv = ShortConv(8, 4).to(torch.bfloat16)
    x = torch.randn(2, 9, 8).to(torch.bfloat16)
    with torch.no_grad():
        y, _ = conv(x)
        want = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), conv.weight, None, groups=8)).transpose(1, 2)
    assert torch.equal(y, want)
