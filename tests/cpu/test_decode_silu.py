"""common.h's 8-lane SiLU (`la_silu_ymm` / `la_expf_ymm`: AVX2 intrinsics that must give la_expf's bits lane by lane)
against the scalar `la_silu_f32`, one element a call and as GCC vectorises it (probe.c's `linattn_probe_silu_f32`),
bit for bit: random floats at every scale, every bit pattern class (+-0, subnormals, huge, +-inf, NaN with payloads),
and dense sweeps over the exp's clamps and its overflow / underflow edges. Then the decode's conv (csrc/decode.c
`FN(conv)`, whose AVX2 taps pass now applies the bias and this SiLU in the same pass) against the LINATTN_PLAIN_C
build (the loops: the bits from before), through `linattn_decode_delta` with a conv of 4, SiLU on and off, with and
without a bias, channel counts on and off the 8-lane steps, outputs spanning the SiLU's edges."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from linattn.cpu import bindings, build as cbuild, ptr
from tests.helpers import build_decode_variant

LIB = bindings.bind("decode")
pytestmark = pytest.mark.skipif(LIB is None, reason="the compiled kernels are not available")


def _probe():
    lib = cbuild.load_library("probe")
    f = lib.linattn_probe_silu_f32
    f.argtypes, f.restype = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    return f


def _silu(x: np.ndarray, path: int):
    x = np.ascontiguousarray(x, dtype=np.float32)
    y = np.full_like(x, np.nan)
    rc = _probe()(x.size, x.ctypes.data, y.ctypes.data, path)
    return None if rc else y


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(46)
    parts = [
        rng.standard_normal(100_000) * s for s in (1e-30, 1e-6, 0.1, 1, 4, 16, 60, 1e4, 1e30)
    ] + [
        rng.integers(0, 2 ** 32, 1_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32),  # every class
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e-45, -1e-45, 1.17549435e-38, -1.17549435e-38,
                  3.4028235e38, -3.4028235e38, 104.0, -104.0, 100.0, -100.0, 88.72283, -88.72283, 87.33654,
                  -87.33654, 103.97208, -103.97208]),
        np.array([0x7FC00001, 0xFFC12345, 0x7F800001, 0xFFBFFFFF], dtype=np.uint32).view(np.float32),  # payloads
    ]
    # dense sweeps, every float in a window: the clamps at -x = -104 and 100, the overflow of e^-x near 88.72, its
    # results turning subnormal (-x near -87.34) and reaching 0 (-x near -103.97), and around 0
    for c in (104.0, -100.0, -88.72284, 87.33654, 103.97208, 0.0, 1e-38):
        b = np.array([c], dtype=np.float32).view(np.int32)[0]
        parts.append(np.arange(b - 20_000, b + 20_000, dtype=np.int64).astype(np.int32).view(np.float32))
        parts.append(-parts[-1])
    return np.concatenate([p.astype(np.float32) for p in parts])


def _bits(y):
    return y.view(np.uint32)


def test_vector_silu_has_the_scalar_bits():
    x = _inputs()
    scalar, gcc = _silu(x, 0), _silu(x, 1)
    assert np.array_equal(_bits(scalar), _bits(gcc)), "GCC's vector loop and the scalar call differ"
    ymm = _silu(x, 2)
    if ymm is None:
        pytest.skip("la_silu_ymm is not compiled here (no AVX2 + FMA)")
    bad = np.flatnonzero(_bits(ymm) != _bits(scalar))
    assert bad.size == 0, f"{bad.size} lanes differ, e.g. x={x[bad[:4]]!r}: {ymm[bad[:4]]!r} vs {scalar[bad[:4]]!r}"


def test_vector_silu_odd_lengths_and_values():
    """the tail past the last 8 lanes; NaN stays NaN, silu(+inf) = inf, silu(-inf) = -inf / inf = NaN (as
    x / (1 + e^-x) gives it in torch), silu(+-0) = +-0, silu(-120) = -0 (e^120 overflows)"""
    x = np.array([np.inf, -np.inf, 0.0, -0.0, np.nan, 1.0, -1.0, 120.0, -120.0, 5.0, -5.0], dtype=np.float32)
    for n in range(1, x.size + 1):
        y = _silu(x[:n], 2)
        if y is None:
            pytest.skip("la_silu_ymm is not compiled here (no AVX2 + FMA)")
        assert np.array_equal(_bits(y), _bits(_silu(x[:n], 0)))
    y = _silu(x, 2)
    assert y[0] == np.inf and np.isnan(y[1]) and _bits(y[2:4]).tolist() == [0, 0x80000000]
    assert np.isnan(y[4]) and y[7] == np.float32(120.0) and _bits(y[8:9])[0] == 0x80000000


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plain_c")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LINATTN_CACHE_DIR", str(tmp / "cache"))
        return bindings.Bound("decode", build_decode_variant(tmp, "#define LINATTN_PLAIN_C\n"))


def _delta_conv(lib, heads, act, bias, scale, seed):
    """linattn_decode_delta (float) with a conv of 4 (window w_in given): its output, new window and state"""
    B, H, HV, K, V = heads
    C = 2 * H * K + HV * V
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(B, C + HV, generator=g) * scale
    w_in = torch.randn(B, C, 3, generator=g) * scale
    cw = torch.randn(C, 4, generator=g)
    cb = torch.randn(C, generator=g) * scale if bias else None
    S0 = torch.randn(B, HV, K, V, generator=g) * 0.5
    w_out = torch.full((B, C, 3), float("nan"))
    S = torch.full((B, HV, K, V), float("nan"))
    out = torch.full((B, HV * V), float("nan"))
    rc = lib("linattn_decode_delta", torch.float32, B, H, HV, K, V, ptr(y), y.shape[1], 4, ptr(w_in), ptr(cw),
             ptr(cb) if bias else None, int(act), ptr(w_out), 0, 0, 1, 1e-6, K ** -0.5, 0, None, 0, None, None,
             ptr(S0), ptr(S), 0, None, 1e-6, 0, ptr(out), 1)
    assert rc == 0
    return out, w_out, S


@pytest.mark.parametrize("heads", [(1, 2, 2, 5, 3), (2, 2, 2, 16, 16), (1, 1, 1, 4, 1), (1, 2, 4, 24, 8)])
@pytest.mark.parametrize("act", [1, 0])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scale", [1.0, 40.0])
def test_decode_conv_has_the_plain_bits(plain, heads, act, bias, scale):
    """the AVX2 taps pass with the bias and SiLU inside it gives the loops' bits (channels 26, 96, 9, 112 a row: the
    8-lane steps and the tail; scale 40: pre-activations past the exp's clamps and overflow)"""
    got = _delta_conv(LIB, heads, act, bias, scale, seed=sum(heads) + act)
    ref = _delta_conv(plain, heads, act, bias, scale, seed=sum(heads) + act)
    for a, b in zip(got, ref):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
