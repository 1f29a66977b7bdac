"""The int8-activation products (csrc/qmatvec.h, formats "int8_a8" / "int4_a8"): x rounded to int8 per block of 32
inputs, the weights exact. Every path (AVX-512 VNNI, AVX-VNNI, AVX2 without VNNI with and without AVX-512 on the
machine, plain C) against fp64: the dequantized matrix times x rounded by the format's definition (tests/helpers.py,
written block by block), within the fp32 rounding of the scaling and summation, and the exact product within the
derived bound sum_j |w_j| s_j / 2 + that rounding. Widths with and without a tail after the last vector step (int8:
any width), rows not a multiple of 4, groups 32 and 64, batches, threads, zero blocks, NaN / inf, huge / tiny
inputs."""
from __future__ import annotations

import pytest
import torch

from linattn.cpu import bindings, decode as cpu_decode
from linattn.quant import round_activations
from tests.cpu.decode_variants import decode_variant_fixture
from tests.helpers import (
    VPDPBUSD_IN_C,
    StoredWeights as _Stored,
    build_decode_variant,
    check_a8_product,
    check_product_threads,
    cpu_flags,
    rounded_activations_fp64,
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


# the prefix that selects each path on top of -march=native, and what the machine needs for it
PATHS = {
    "native": ("", set()),
    "avx2-beside-avx512": ("#undef __AVX512VNNI__\n#undef __AVXVNNI__\n", {"avx2"}),
    "avx2": ("#undef __AVX512F__\n#undef __AVX512VNNI__\n#undef __AVXVNNI__\n", {"avx2", "fma"}),
    "avx-vnni": ("#undef __AVX512F__\n#undef __AVX512VNNI__\n#define __AVXVNNI__ 1\n", {"avx2", "fma", "avx_vnni"}),
    "scalar": ("#define LINATTN_PLAIN_C\n", set()),
}


decode_lib = decode_variant_fixture(PATHS)


FORMATS = [("int8", None), ("int4", 32), ("int4", 64)]


@pytest.mark.parametrize("mode,group", FORMATS)
@pytest.mark.parametrize("n,k", [(13, 64), (16, 128), (9, 192), (8, 320), (5, 1088), (4, 2048), (7, 100), (6, 33),
                                 (3, 1), (5, 17)])
def test_a8_paths_match_fp64(decode_lib, mode, group, n, k):
    if mode == "int4" and k % group:
        pytest.skip("int4 needs in_features a multiple of the group")
    q = _Stored(n, k, mode, group, seed=n + k, bias=True)
    for B in (1, 3):
        x = torch.randn(B, k, generator=torch.Generator().manual_seed(B)) * torch.rand(1, k) * 4
        add = torch.randn(B, n, generator=torch.Generator().manual_seed(B + 7))
        check_a8_product(q, x)
        check_a8_product(q, x, bias=q.bias, add=add)


@pytest.mark.parametrize("mode,group", FORMATS)
def test_a8_paths_hostile_inputs(decode_lib, mode, group):
    q = _Stored(8, 256, mode, group, seed=3)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    x[0, 64:128] = 0   # zero blocks: scale 0, integers 0
    check_a8_product(q, x)
    check_a8_product(q, torch.zeros(2, 256))
    # a NaN or inf anywhere: the exact product, NaN / inf pattern included
    x[1, 130] = float("nan")
    x[2, 7] = float("inf")
    y = cpu_decode.weight_matvec(x, mode + "_a8", q.stored, q.scales, q.group)
    exact = cpu_decode.weight_matvec(x, mode, q.stored, q.scales, q.group)
    assert torch.isnan(y[1]).all() and torch.equal(torch.isnan(y), torch.isnan(exact))
    assert torch.equal(y[~torch.isnan(y)], exact[~torch.isnan(exact)])
    for scale in (1e-38, 1e-30, 1e35):   # scales near fp32's smallest normals; partials far from overflow
        check_a8_product(q, torch.randn(2, 256, generator=torch.Generator().manual_seed(5)) * scale)
    tiny = torch.full((1, 256), 2.0 ** -149)   # subnormal inputs: the scale raised by ulps
    tiny[0, ::3] = -3 * 2.0 ** -149
    check_a8_product(q, tiny)


@pytest.mark.parametrize("mode,group", FORMATS)
def test_a8_paths_threads(decode_lib, mode, group):
    """Rows split across threads: the same bits as one thread, within the bounds."""
    q = _Stored(532, 512, mode, group, seed=9, bias=True)
    check_product_threads(q, torch.randn(2, 512, generator=torch.Generator().manual_seed(3)), check_a8_product)


def test_a8_differs_from_exact():
    """The rounding is applied: the result moves off the exact product (by more than fp32 rounding) and toward x^'s."""
    q = _Stored(16, 512, "int4", 32, seed=1)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(2))
    y8 = cpu_decode.weight_matvec(x, "int4_a8", q.stored, q.scales, 32).double()
    y = cpu_decode.weight_matvec(x, "int4", q.stored, q.scales, 32).double()
    W = q.dequantize(torch.float64)
    xhat, _ = rounded_activations_fp64(x)
    assert (y8 - y).abs().max() > 1e3 * (y - x.double() @ W.t()).abs().max()
    assert (y8 - xhat @ W.t()).abs().max() < 1e-3 * (y8 - y).abs().max()


@pytest.mark.parametrize("k", [32, 100, 256])
def test_a8_paths_round_as_the_definition(decode_lib, k):
    """Every path's rounding of x, seen through an int8 identity of scale 1 (y = x^ exactly: one nonzero integer
    product per row, its scaling the definition's one fp32 product): equal to round_activations bit for bit, with
    ties to even, +-127, zero and subnormal blocks, and a tail block (k = 100)."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(4, k, generator=g) * torch.tensor([[1.0], [1e-38], [1e35], [1.0]])
    x[0, :32] = torch.arange(32) - 15.5   # a block of max 16.5 ...
    x[0, 31] = 127.0                      # ... raised to 127: scale 1, every other value a tie
    x[1, 32:64] = 0
    x[3, :] = 2.0 ** -149 * (torch.arange(k) % 7 - 3)
    eye = torch.eye(k, dtype=torch.int8)
    ones = torch.ones(k, dtype=torch.bfloat16)
    y = cpu_decode.weight_matvec(x, "int8_a8", eye, ones, 0)
    assert torch.equal(y, round_activations(x))


def test_round_activations_matches_the_definition():
    """The PyTorch paths' rounding (quant/linear.round_activations) equals the definition bit for bit (fp32 x),
    tails, zero blocks, subnormals and extremes included; a NaN / inf leaves x as it is."""
    g = torch.Generator().manual_seed(0)
    for k in (1, 31, 32, 33, 100, 256):
        x = torch.randn(3, k, generator=g) * torch.tensor([[1.0], [1e-38], [1e35]])
        x[0, : min(k, 5)] = 0
        xhat, _ = rounded_activations_fp64(x)
        got = round_activations(x)
        assert got.dtype == torch.float32 and torch.equal(got, xhat.float())
    sub = torch.full((1, 40), 2.0 ** -149) * torch.arange(40)
    assert torch.equal(round_activations(sub), rounded_activations_fp64(sub)[0].float())
    bad = torch.randn(2, 40)
    bad[1, 3] = float("inf")
    assert torch.equal(round_activations(bad), bad)
    assert round_activations(torch.randn(2, 3, 40).double()).dtype == torch.float64


@pytest.mark.parametrize("mode,group", FORMATS)
def test_a8_row_schedule_every_row_count(decode_lib, mode, group):
    """The four-stream row schedule (rows i, i + n/4, ...; the n % 4 last one at a time) for every row count from 1
    to 9, each row within its bounds."""
    for n in range(1, 10):
        q = _Stored(n, 256, mode, group, seed=n, bias=True)
        check_a8_product(q, torch.randn(2, 256, generator=torch.Generator().manual_seed(n)), bias=q.bias)


def test_a8_avx_vnni_same_bits_as_avx2(tmp_path, monkeypatch):
    """AVX-VNNI's `vpdpbusd` (the excess folded into its start) and AVX2's `vpmaddubsw` + `vpmaddwd` make the same
    integer lanes, and the float steps after them are the same: the same bits, rows 1-9 and 523, 1 and 2 threads."""
    if not {"avx2", "fma", "avx_vnni"} <= cpu_flags():
        pytest.skip("needs AVX2, FMA and AVX-VNNI")
    cases = [_Stored(n, 512, mode, group, seed=n, bias=True) for n in (1, 5, 9, 523) for mode, group in FORMATS]
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(7)) * 3
    got, threads = {}, torch.get_num_threads()
    try:
        for name in ("avx-vnni", "avx2", "scalar"):
            (tmp_path / name).mkdir()
            lib = build_decode_variant(tmp_path / name, PATHS[name][0])
            monkeypatch.setattr(bindings, "load_library", lambda n, lib=lib: lib if n == "decode" else None)
            got[name] = []
            for t in (1, 2):
                torch.set_num_threads(t)
                got[name] += [cpu_decode.weight_matvec(x, q.mode + "_a8", q.stored, q.scales, q.group, bias=q.bias)
                              for q in cases]
    finally:
        torch.set_num_threads(threads)
    assert len(got["avx2"]) == 2 * len(cases)
    for a, b in zip(got["avx-vnni"], got["avx2"]):
        assert torch.equal(a, b)
    # (the variants were the ones run: plain C sums in another order, so its bits differ somewhere)
    assert any(not torch.equal(a, c) for a, c in zip(got["avx2"], got["scalar"]))


INT4_WIDTHS = {32: (64, 96, 1056, 4192), 64: (64, 192, 1088, 8256)}


@pytest.mark.parametrize("group", [32, 64])
def test_a8_int4_row_bits_independent_of_the_step(decode_lib, group):
    """AVX2's int4 product sums a step's four rows' integers together and scales them in one vector (csrc/qmatvec.h
    a8_i4_rows); a row alone (the n % 4 last) takes the same float steps: every row of an n-row product has the bits
    of that row's product alone (rowsched.h: the schedule changes no bits), and is within the bounds. Widths of one
    step, an odd step count, a tail after the last step and more than one span of 128 groups (the rows' scales
    converted per span, the last 8 groups short)."""
    for n, k in zip((9, 6, 5, 7), INT4_WIDTHS[group]):
        q = _Stored(n, k, "int4", group, seed=n + k, bias=True)
        x = torch.randn(2, k, generator=torch.Generator().manual_seed(k)) * 2
        check_a8_product(q, x, bias=q.bias)
        y = cpu_decode.weight_matvec(x, "int4_a8", q.stored, q.scales, group, bias=q.bias)
        for i in range(n):
            one = cpu_decode.weight_matvec(x, "int4_a8", q.stored[i:i + 1].contiguous(),
                                           q.scales[i:i + 1].contiguous(), group, bias=q.bias[i:i + 1].contiguous())
            assert torch.equal(one[:, 0].view(torch.int32), y[:, i].view(torch.int32)), (n, k, i)


def test_a8_int8_row_bits_independent_of_the_step(decode_lib):
    """AVX2's int8 product sums a step's four rows' 8 lanes in one transpose-and-add (csrc/qmatvec.h a8_i8_rows,
    round 14), a row alone (the n % 4 last) by halving its lanes in scalar code, in the same order: every row of an
    n-row product has the bits of that row's product alone, and is within the bounds. Widths below one step, with a
    tail, of an odd count of steps (a pair's even step alone at the end) and of many pairs."""
    for n, k in zip((9, 6, 5, 7, 8), (33, 100, 96, 1056, 4128)):
        q = _Stored(n, k, "int8", None, seed=n + k, bias=True)
        x = torch.randn(2, k, generator=torch.Generator().manual_seed(k)) * 2
        check_a8_product(q, x, bias=q.bias)
        y = cpu_decode.weight_matvec(x, "int8_a8", q.stored, q.scales, q.group, bias=q.bias)
        for i in range(n):
            one = cpu_decode.weight_matvec(x, "int8_a8", q.stored[i:i + 1].contiguous(),
                                           q.scales[i:i + 1].contiguous(), q.group, bias=q.bias[i:i + 1].contiguous())
            assert torch.equal(one[:, 0].view(torch.int32), y[:, i].view(torch.int32)), (n, k, i)


@pytest.mark.parametrize("group", [32, 64])
def test_a8_int4_extreme_integer_sums_exact(decode_lib, group):
    """Codes 0 and 15 times x's integers +-127 (scale 1 for every block and group): the largest 16-bit partial sums
    AVX2's path forms (16 products of 15 x 127 = 30480 before the excess is taken off) and the largest excess; every
    product and sum is an integer below 2^24, so the result is exact: equal to the integer product."""
    g = torch.Generator().manual_seed(group)
    for k in INT4_WIDTHS[group]:
        codes = torch.randint(0, 16, (5, k), generator=g)
        codes[0], codes[1], codes[4] = 15, 0, 15   # rows 0-3 one step, row 4 alone
        codes[2] = torch.where(torch.rand(k, generator=g) < 0.5, 0, 15)
        stored = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
        x = torch.full((3, k), 127.0)
        x[1] = -127.0
        x[2] = torch.where(torch.rand(k, generator=g) < 0.5, -127.0, 127.0)
        x[2, 32:63] = torch.arange(31) - 15.0   # a block of small integers (its max 127: scale 1)
        y = cpu_decode.weight_matvec(x, "int4_a8", stored, torch.ones(5, k // group, dtype=torch.bfloat16), group)
        want = x.double() @ (codes - 8).double().t()
        assert torch.equal(y.double(), want), (k, (y.double() - want).abs().max().item())


def test_a8_avx_vnni_emulated_same_bits_as_avx2(tmp_path, monkeypatch):
    """The AVX-VNNI path with `vpdpbusd` written in C (so that a CPU without AVX-VNNI runs it: its int4 rows start
    from the lanes' excess and `vphaddd` their lanes; AVX2's sum 16-bit lanes and take the blocks' excess after) and
    the AVX2 path: the same bits, int8 and int4 (groups 32, 64), rows 1-9 and 523, widths with a tail and more than
    one span of scales, 1 and 2 threads."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("needs AVX2 and FMA")
    cases = [_Stored(n, k, mode, group, seed=n, bias=True) for n in (1, 5, 9, 523) for k in (512, 1056, 4192)
             for mode, group in FORMATS if mode == "int8" or k % group == 0]
    xs = {k: torch.randn(2, k, generator=torch.Generator().manual_seed(k)) * 3 for k in (512, 1056, 4192)}
    prefixes = {"emulated": PATHS["avx-vnni"][0] + VPDPBUSD_IN_C, "avx2": PATHS["avx2"][0]}
    got, threads = {}, torch.get_num_threads()
    try:
        for name, prefix in prefixes.items():
            (tmp_path / name).mkdir()
            lib = build_decode_variant(tmp_path / name, prefix)
            monkeypatch.setattr(bindings, "load_library", lambda n, lib=lib: lib if n == "decode" else None)
            got[name] = []
            for t in (1, 2):
                torch.set_num_threads(t)
                got[name] += [cpu_decode.weight_matvec(xs[q.in_features], q.mode + "_a8", q.stored, q.scales,
                                                       q.group, bias=q.bias) for q in cases]
    finally:
        torch.set_num_threads(threads)
    assert len(got["avx2"]) == 2 * len(cases)
    for a, b in zip(got["emulated"], got["avx2"]):
        assert torch.equal(a, b)


def test_a8_rate_harness_builds_and_runs():
    """The developer's cost harness (tests/fixtures/cpu/a8_rate.c, including decode.c) builds against the kernels'
    sources and runs each of its four products once: a finite checksum, the same on a second run."""
    import math
    import subprocess

    from tests.helpers import fixture_executable

    exe = fixture_executable("a8_rate", (("-march=native", "-fno-trapping-math"), ()),
                             ["-O2", "-std=c11", "-ffp-contract=fast"])
    if exe is None:
        pytest.fail("tests/fixtures/cpu/a8_rate.c does not build")
    sums = []
    for _ in range(2):
        out = subprocess.run([str(exe), "count"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        assert sum(line.startswith(("int4_a8", "int8_a8")) for line in lines) == 4, out.stdout
        assert lines[-1].startswith("checksum ")
        sums.append(float(lines[-1].split()[1]))
    assert math.isfinite(sums[0]) and sums[0] == sums[1]


def _f32_nearest(v):
    """The fp32 nearest to the rational v, ties to even (float(v) is the correctly rounded double; its fp32 and the
    neighbours of that are compared exactly, so no double rounding)."""
    from fractions import Fraction

    import numpy as np

    c = np.float32(float(v))
    best = None
    for f in (np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))):
        d = abs(Fraction(float(f)) - v)
        if best is None or d < best[0] or (d == best[0] and int(f.view(np.uint32)) % 2 == 0):
            best = (d, f)
    return best[1]


def _avx2_int4_a8_order(q: "_Stored", x, bias):
    """The AVX2 int4-a8 product's float steps written out (csrc/qmatvec.h a8_i4_rows): per step of 64 inputs two
    blocks of 32, each block's exact integer sum I times its x scale (one fp32 product) then fused-multiply-added
    with its group's scale into lane 0 (the even blocks) or lane 1 (the odd ones); the row's result (lane 0 + lane 1)
    + the tail after the last whole step (a8_int4_row_scalar: each block's sum times s_b times the group scale in
    fp64, rounded once, added in fp32; +0 without a tail), + bias."""
    from fractions import Fraction

    import numpy as np

    xhat, s = rounded_activations_fp64(x)
    Q = (xhat / torch.where(s > 0, s, torch.ones_like(s))).round().long().numpy()
    s32 = s.numpy().astype(np.float32)
    codes = q.q.long().numpy()
    gsc = q.scales.float().numpy()
    n, k = codes.shape
    mv, G = k - k % 64, q.group
    y = np.zeros((x.shape[0], n), np.float32)
    for b in range(x.shape[0]):
        for i in range(n):
            lanes = [np.float32(0), np.float32(0)]
            for blk in range(mv // 32):
                isum = int((codes[i, 32 * blk:32 * blk + 32] * Q[b, 32 * blk:32 * blk + 32]).sum())
                p = np.float32(np.float32(isum) * s32[b, 32 * blk])
                g = gsc[i, 32 * blk // G]
                lanes[blk % 2] = _f32_nearest(Fraction(float(p)) * Fraction(float(g)) + Fraction(float(lanes[blk % 2])))
            tail = np.float32(0)
            for blk in range(mv // 32, k // 32):
                isum = int((codes[i, 32 * blk:32 * blk + 32] * Q[b, 32 * blk:32 * blk + 32]).sum())
                t = np.float64(isum) * (np.float64(s32[b, 32 * blk]) * np.float64(gsc[i, 32 * blk // G]))
                tail = np.float32(tail + np.float32(t))
            v = np.float32(np.float32(lanes[0] + lanes[1]) + tail)
            y[b, i] = np.float32(v + np.float32(bias[i].item()))
    return torch.from_numpy(y)


@pytest.mark.parametrize("group", [32, 64])
def test_a8_int4_avx2_bits_are_its_float_order(tmp_path, monkeypatch, group):
    """AVX2's int4-a8 product (built without AVX-512 / VNNI) equals, bit for bit, its float steps written out in
    Python (`_avx2_int4_a8_order`): a change of the steps' arithmetic or order fails here, not only against the
    bound. Rows 1, 3, 4, 5, 8, 9 (one step of four rows and the n % 4 rows alone), short rows of 1024 inputs (the
    530M model's qkv / gate_up / head), a tail after the last step, more than one span of scales, and 4 and 8 rows
    of 4192 / 8256 inputs, whose last quarter's prefetches reach the matrix's end within the row (the steps split
    between the unchecked and the checked loop); two x rows (the second prefetches nothing)."""
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("needs AVX2 and FMA")
    lib = build_decode_variant(tmp_path, PATHS["avx2"][0])
    monkeypatch.setattr(bindings, "load_library", lambda n: lib if n == "decode" else None)
    widths = {32: (64, 96, 1024, 4192), 64: (64, 192, 1024, 8256)}[group]
    cases = [(n, k) for n in (1, 3, 5, 9) for k in widths[:3]] + [(4, widths[3]), (8, widths[3])]
    for n, k in cases:
        q = _Stored(n, k, "int4", group, seed=7 * n + k, bias=True)
        x = torch.randn(2, k, generator=torch.Generator().manual_seed(n + k)) * torch.rand(1, k) * 3
        y = cpu_decode.weight_matvec(x, "int4_a8", q.stored, q.scales, group, bias=q.bias)
        want = _avx2_int4_a8_order(q, x, q.bias)
        assert torch.equal(y.view(torch.int32), want.view(torch.int32)), (n, k, (y - want).abs().max().item())


@pytest.mark.parametrize("march", ["icelake-server", "sapphirerapids"])
def test_a8_avx512_vnni_branches_compile(march):
    """decode.c's AVX-512 VNNI configuration, whose int4 products take the 256-bit steps, compiles for a target
    without AVX-VNNI (Ice Lake: the VL form of `vpdpbusd`) and one with it (Sapphire Rapids), whatever this machine
    runs (compiled to assembly, not run)."""
    import subprocess
    from pathlib import Path

    from linattn.cpu import build

    src = Path(build.__file__).resolve().parent / "csrc"
    cmd = [*build.compiler(), "-S", "-o", "/dev/null", "-std=c11", "-O1", f"-march={march}", "-fopenmp", "-I", str(src),
           str(src / "decode.c")]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        pytest.skip("no C compiler")
    if "bad value" in res.stderr or "unrecognized" in res.stderr:
        pytest.skip(f"the compiler does not know -march={march}")
    assert res.returncode == 0, res.stderr[-2000:]
