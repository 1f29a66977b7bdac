"""The fp32 and bf16 weight products of the compiled decode (csrc/decode.c `matvec_rows_f32`, `matvec_rows_bf16`, in
rowsched.h's schedule: rows i, i + n/4, i + 2n/4, i + 3n/4 per step, the n % 4 last rows one at a time) through
`weight_matvec`, on every code path: the native build (AVX-512 where the machine has it: bf16 widened in a 512-bit
register), AVX2 (the machine's AVX-512 macro removed) and LINATTN_PLAIN_C, each against the fp64 product of the
matrix as stored (bf16: its rounded values, exact in fp64) within the computed bound. Every row count 1-9 and a
523-row matrix split over 1 and 2 threads (the same bits), widths on and off the vector path (a multiple of a line,
or not), batches, bias and add, NaN / inf and huge / tiny inputs. A row read from the wrong quarter, or left out,
fails: each row has its own scale and its own reference."""
from __future__ import annotations

import pytest
import torch

from linattn.cpu import bindings, decode as cpu_decode
from tests.helpers import _gamma_fp32, build_decode_variant, cpu_flags

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

# the prefix that selects each path (on top of -march=native); "native" is the package's own build
PATHS = {
    "native": (None, set()),
    "avx2": ("#undef __AVX512F__\n", {"avx2", "fma"}),
    "plain_c": ("#define LINATTN_PLAIN_C\n", set()),
}
FORMATS = {"plan": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module", params=sorted(PATHS))
def decode_path(request, tmp_path_factory):
    """decode.c built with `PATHS[name]`'s prefix, bound in place of the native library for the test."""
    prefix, needs = PATHS[request.param]
    if not needs <= cpu_flags():
        pytest.skip(f"the {request.param} path needs {sorted(needs)}")
    if prefix is None:
        yield request.param
        return
    tmp = tmp_path_factory.mktemp(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LINATTN_CACHE_DIR", str(tmp / "cache"))
        lib = build_decode_variant(tmp, prefix)
        mp.setattr(bindings, "load_library", lambda name: lib if name == "decode" else None)
        yield request.param


def _weights(n, m, fmt, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, m, generator=g) * (torch.rand(n, 1, generator=g) * 3 + 0.1)   # rows of different scales
    return w.to(FORMATS[fmt])


def _check(W, x, bias=None, add=None, y=None):
    """W's compiled product (or y, computed elsewhere) against the fp64 product of W as stored, within
    gamma(m + 2) |x| |W| (+ |bias| + |add|)."""
    fmt = "plan" if W.dtype == torch.float32 else "bf16"
    if y is None:
        y = cpu_decode.weight_matvec(x, fmt, W, bias=bias, add=add)
    W64, x64 = W.double(), x.double()
    ref, mag = x64 @ W64.t(), x64.abs() @ W64.abs().t()
    for t in (bias, add):
        if t is not None:
            ref, mag = ref + t.double(), mag + t.double().abs()
    bound = _gamma_fp32(W.shape[1] + 2) * mag + 2.0 ** -140   # (+ subnormal rounding)
    err = (y.double() - ref).abs()
    assert torch.isfinite(y).all()
    assert (err <= bound).all(), f"{fmt}: max error {err.max().item():.3g} at {divmod(int(err.argmax()), y.shape[1])}"
    return y


def _at_threads(k, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(k)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("m", [64, 1024, 40])   # a multiple of a line (the vector path), and not (the simd loops)
def test_every_row_count_against_fp64(decode_path, fmt, m):
    for n in range(1, 10):
        W = _weights(n, m, fmt, seed=n + m)
        for B in (1, 3):
            x = torch.randn(B, m, generator=torch.Generator().manual_seed(B + n))
            bias = torch.randn(n, generator=torch.Generator().manual_seed(n))
            add = torch.randn(B, n, generator=torch.Generator().manual_seed(B * 7 + n))
            _check(W, x)
            _check(W, x, bias=bias, add=add)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("m", [512, 48])
def test_odd_matrix_split_across_threads(decode_path, fmt, m):
    """523 rows (130 four-row steps and 3 single rows), large enough to run in parallel: every row within its bound at
    1 and 2 threads, the same bits at both."""
    W = _weights(4 * 130 + 3, m, fmt, seed=11)
    x = torch.randn(2, m, generator=torch.Generator().manual_seed(12))
    bias = torch.randn(W.shape[0], generator=torch.Generator().manual_seed(13))
    if W.shape[0] * m < 65536:   # below the threshold the product stays serial: repeat the rows until it is not
        W = W.repeat(65536 // (W.shape[0] * m) + 1, 1)[:4 * 400 + 3].contiguous()
        bias = torch.randn(W.shape[0], generator=torch.Generator().manual_seed(13))
    y1 = _at_threads(1, lambda: _check(W, x, bias=bias))
    y2 = _at_threads(2, lambda: _check(W, x, bias=bias))
    assert torch.equal(y1, y2)


def test_bf16_equals_fp32_on_rounded_weights(decode_path):
    """Where both take the vector path (the rows of four-row steps), the bf16 product is the fp32 product of the
    bf16-rounded matrix, bit for bit (the same lanes, fused multiply-adds and pairwise sums)."""
    for n in (4, 7, 523):
        Wb = _weights(n, 256, "bf16", seed=n)
        x = torch.randn(3, 256, generator=torch.Generator().manual_seed(n))
        yb = cpu_decode.weight_matvec(x, "bf16", Wb)
        yf = cpu_decode.weight_matvec(x, "plan", Wb.float())
        q = 4 * (n // 4)
        assert torch.equal(yb[:, :q], yf[:, :q])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_hostile_inputs(decode_path, fmt):
    n, m = 11, 128
    W = _weights(n, m, fmt, seed=3)
    W[5, 70] = float("nan")   # only row 5 is NaN, in every batch row
    W[9, 3] = float("inf")    # row 9 is +-inf where x[3] != 0 (x[1, 3] = 0: NaN)
    x = torch.randn(2, m, generator=torch.Generator().manual_seed(4))
    x[1, 3] = 0.0
    y = cpu_decode.weight_matvec(x, fmt, W)
    assert torch.isnan(y[:, 5]).all()
    assert torch.isinf(y[0, 9]) and torch.sign(y[0, 9]) == torch.sign(x[0, 3]) and torch.isnan(y[1, 9])
    keep = [i for i in range(n) if i not in (5, 9)]
    ok = W[keep].contiguous()
    _check(ok, x, y=y[:, keep])   # the other rows untouched
    xn = x.clone()
    xn[0, 100] = float("nan")   # a NaN input: every row of its batch row, none of the other's
    yn = cpu_decode.weight_matvec(xn, fmt, ok)
    assert torch.isnan(yn[0]).all() and torch.equal(yn[1], cpu_decode.weight_matvec(x, fmt, ok)[1])
    for scale in (1e-30, 1e30):   # subnormal products; partial sums far from overflow
        _check(ok, x * scale)


def test_bad_arguments_name_the_expected_shape():
    from linattn.errors import LinattnError
    with pytest.raises(LinattnError, match=r"W must be torch.bfloat16 \[3, 8\]"):
        cpu_decode.weight_matvec(torch.zeros(1, 8), "bf16", torch.zeros(3, 8))
    with pytest.raises(LinattnError, match=r"bias must be float32 \[3\]"):
        cpu_decode.weight_matvec(torch.zeros(1, 8), "plan", torch.zeros(3, 8), bias=torch.zeros(4))
