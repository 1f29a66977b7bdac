"""int4-a8's group scales in the order of the product's steps (cpu/qlayout.py, csrc/qmatvec.h a8_step_scales): the
layout against its definition written element by element, its inverse, and the compiled product reading it on every
path (AVX2, AVX-VNNI, plain C): each row of an n-row product has the bits of that row's product alone (one row: the
layout is the rows' order), for row counts with every n % 4, groups 32 and 64, odd group counts, one and two x rows,
one and two threads. A wrong offset of any row's or group's scale changes a row's value."""
from __future__ import annotations

import pytest
import torch

from linattn.cpu import decode as cpu_decode
from linattn.cpu.qlayout import rows_scales, step_scales
from linattn.errors import LinattnError
from linattn.models.decode_plan import plan_scales
from tests.cpu.decode_variants import decode_variant_fixture
from tests.helpers import VPDPBUSD_IN_C, StoredWeights as _Stored

PATHS = {
    "native": ("", set()),
    "avx2": ("#undef __AVX512F__\n#undef __AVX512VNNI__\n#undef __AVXVNNI__\n", {"avx2", "fma"}),
    "avx-vnni": ("#undef __AVX512F__\n#undef __AVX512VNNI__\n#define __AVXVNNI__ 1\n", {"avx2", "fma", "avx_vnni"}),
    # (AVX-VNNI's `vpdpbusd` written in C, as test_qmatvec_a8.py builds it: that path on any AVX2 machine)
    "avx-vnni-emulated": ("#undef __AVX512F__\n#undef __AVX512VNNI__\n#define __AVXVNNI__ 1\n" + VPDPBUSD_IN_C,
                          {"avx2", "fma"}),
    "scalar": ("#define LINATTN_PLAIN_C\n", set()),
}

decode_lib = decode_variant_fixture(PATHS)


def _defined(scales: torch.Tensor) -> torch.Tensor:
    """The steps' order by its definition: step t < q (n // 4 - 1 from n = 8, n // 4 below: rowsched.h Q_QUARTER)
    holds rows t + r q as [group][4 rows] at 4 t ng, step q (n >= 8) rows 4q + r as [group][4 rows] at 4 q ng, the
    n % 4 last rows follow by rows."""
    n, ng = scales.shape
    q = n // 4 - 1 if n >= 8 else n // 4
    out = torch.empty(n * ng, dtype=scales.dtype)
    for i in range(n):
        for g in range(ng):
            if i < 4 * q:
                at = 4 * ((i % q) * ng + g) + i // q
            elif i < 4 * (n // 4):
                at = 4 * (q * ng + g) + i - 4 * q
            else:
                at = i * ng + g
            out[at] = scales[i, g]
    return out.view(n, ng)


@pytest.mark.parametrize("n", list(range(1, 14)) + [16, 17, 18, 19, 61])
@pytest.mark.parametrize("ng", [1, 3, 8, 33])
def test_step_scales_is_its_definition(n, ng):
    s = torch.arange(n * ng, dtype=torch.float32).view(n, ng).to(torch.bfloat16)   # (exact: < 256)
    s = torch.randn(n, ng, generator=torch.Generator().manual_seed(n * 100 + ng)).to(torch.bfloat16) if n * ng > 256 \
        else s
    got = step_scales(s)
    assert got.shape == s.shape and got.dtype == s.dtype and got.is_contiguous()
    assert torch.equal(got.view(torch.int16), _defined(s).view(torch.int16))
    assert torch.equal(rows_scales(got).view(torch.int16), s.view(torch.int16))
    if n < 4:   # (no step of four rows: the rows' order)
        assert torch.equal(got.view(torch.int16), s.view(torch.int16))


def test_step_scales_bad_input():
    with pytest.raises(LinattnError, match=r"step_scales: scales must be a \[n, n_groups\] tensor"):
        step_scales(torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(LinattnError, match="rows_scales"):
        rows_scales(torch.zeros(2, 3, 4))


def test_plan_scales_which_matrices():
    """A plan's int4-a8 matrices read their scales in the steps' order, MLA's kv_b_proj (read by rows) and every
    other format as stored."""
    s = torch.randn(12, 5).to(torch.bfloat16)
    assert torch.equal(plan_scales("W", "int4_a8", s), step_scales(s))
    assert torch.equal(plan_scales("head", "int4_a8", s), step_scales(s))
    for name, mode in (("mla_Wkb", "int4_a8"), ("W", "int4"), ("W", "int8_a8"), ("Wd", "int8")):
        assert plan_scales(name, mode, s) is s


# (n, k, group): every n % 4, n 8-12 (q = n // 4 - 1 from 8), groups 32 / 64, odd group counts (96 / 32 = 3,
# 1056 / 32 = 33, 192 / 64 = 3, 1088 / 64 = 17), a tail after the last vector step (k % 64 == 32), a row count past
# one 2-thread split; n 9-11 with two groups or more (with one, q = 1 makes the steps' order the rows')
SHAPES = [(n, k, 32) for n, k in ((1, 96), (2, 64), (3, 1056), (4, 96), (5, 1056), (6, 64), (7, 160), (8, 1056),
                                  (12, 96), (13, 544), (258, 1056))] + \
         [(n, k, 64) for n, k in ((1, 192), (3, 64), (4, 1088), (5, 192), (6, 1088), (7, 320), (9, 128), (10, 192),
                                  (11, 192), (257, 192))]


@pytest.mark.parametrize("n,k,group", SHAPES)
def test_a8_int4_rows_read_the_steps_order(decode_lib, n, k, group):
    """Each row of the product (scales put in the steps' order by weight_matvec) has the bits of its row alone, for
    one and two x rows and one and two threads; the same scales passed by rows as if in the steps' order give other
    values (the product reads the layout, not the rows' order)."""
    q = _Stored(n, k, "int4", group, seed=n * 7 + k, bias=True)
    g = torch.Generator().manual_seed(n + k)
    # (every row and group its own scale: a scale read from another row or group changes the row's value)
    q.scales = (q.scales.float() * (1 + torch.rand(q.scales.shape, generator=g))).to(torch.bfloat16)
    x = torch.randn(2, k, generator=g) * 2
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for B in (1, 2):
                y = cpu_decode.weight_matvec(x[:B].contiguous(), "int4_a8", q.stored, q.scales, group, bias=q.bias)
                for i in range(n):
                    one = cpu_decode.weight_matvec(x[:B].contiguous(), "int4_a8", q.stored[i:i + 1].contiguous(),
                                                   q.scales[i:i + 1].contiguous(), group,
                                                   bias=q.bias[i:i + 1].contiguous())
                    assert torch.equal(one[:, 0].view(torch.int32), y[:, i].view(torch.int32)), (nt, B, i)
    finally:
        torch.set_num_threads(threads)
    if n >= 4:
        pre = cpu_decode.weight_matvec(x, "int4_a8", q.stored, step_scales(q.scales), group, bias=q.bias,
                                       scales_in_step_order=True)
        assert torch.equal(pre.view(torch.int32), y.view(torch.int32))
        wrong = cpu_decode.weight_matvec(x, "int4_a8", q.stored, q.scales, group, bias=q.bias,
                                         scales_in_step_order=True)
        assert not torch.equal(wrong, y)


@pytest.mark.parametrize("group", [32, 64])
def test_a8_int4_non_finite_x_takes_the_exact_product(decode_lib, group):
    """x with a NaN or inf: the exact int4 product (its scales put back by rows first), bit for bit."""
    q = _Stored(7, 4 * group, "int4", group, seed=3, bias=True)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(2, 4 * group, generator=torch.Generator().manual_seed(5))
        x[1, group + 3] = bad
        y = cpu_decode.weight_matvec(x, "int4_a8", q.stored, q.scales, group, bias=q.bias)
        exact = cpu_decode.weight_matvec(x, "int4", q.stored, q.scales, group, bias=q.bias)
        assert torch.equal(y.view(torch.int32), exact.view(torch.int32))


# (n, k): steps whose prefetches need no check and the last ones that do (64 rows of 1024 inputs), every n % 4, an
# odd last vector step (k 96, 192, 1088), a tail after it (k 160, 1056)
ONE_ROW_SHAPES = [(4, 1024), (64, 1024), (66, 1024), (67, 192), (65, 96), (9, 160), (41, 1056), (38, 1088)]


@pytest.mark.parametrize("fmt,group", [("int4_a8", 32), ("int4_a8", 64), ("int8_a8", 0)])
@pytest.mark.parametrize("n,k", ONE_ROW_SHAPES)
def test_a8_one_row_steps_loop(decode_lib, fmt, group, n, k):
    """One x row on one thread (the decode's product: AVX2 runs its steps of four rows in a loop of their own,
    storing into y directly when there is no bias, add or tail) has the bits of the same row in a product of two x
    rows (the per-step path), with no bias, a bias, an add."""
    if k % max(group, 1):
        pytest.skip("int4 needs in_features a multiple of the group")
    q = _Stored(n, k, fmt[:4], group or None, seed=n + 3 * k, bias=True)
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(2, k, generator=g) * 2
    add = torch.randn(2, n, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for b, a in ((None, None), (q.bias, None), (None, add), (q.bias, add)):
            one = cpu_decode.weight_matvec(x[:1].contiguous(), fmt, q.stored, q.scales, group, bias=b,
                                           add=None if a is None else a[:1].contiguous())
            two = cpu_decode.weight_matvec(x, fmt, q.stored, q.scales, group, bias=b, add=a)
            assert torch.equal(one[0].view(torch.int32), two[0].view(torch.int32)), (b is None, a is None)
    finally:
        torch.set_num_threads(threads)


# (n, k): past the 2-thread size (int4: n k >= 4 * 65536) with steps split unevenly between the threads (n 67:
# 19 steps, 9 | 10; n 131: 35, 17 | 18; n 258: 66, 33 | 33, the second thread's last two steps single rows), every
# n % 4 in 1..3, a tail after the last vector step (k % 64 == 32), an odd last vector step (1088, 2112: 17 and 33
# steps of 64 inputs); and small products on one thread only
MULTI_SHAPES = [(67, 4096), (131, 2080), (131, 2112), (258, 1056), (258, 1088), (9, 160), (6, 192), (7, 96)]


@pytest.mark.parametrize("fmt,group", [("int4_a8", 32), ("int4_a8", 64), ("int8_a8", 0)])
@pytest.mark.parametrize("n,k", MULTI_SHAPES)
def test_a8_several_x_rows_and_thread_ranges(decode_lib, fmt, group, n, k):
    """Several x rows (2-8: prefill chunks, batch decode; AVX2 shares each load of a step's codes between up to four
    x rows) and two threads (1-8 x rows; each thread's contiguous range of steps through the step loops) give every
    x row the bits of its product alone on one thread, with a bias and with an add: a wrong x row's, scale's,
    output's or range's offset changes a row."""
    if k % max(group, 1):
        pytest.skip("int4 needs in_features a multiple of the group")
    q = _Stored(n, k, fmt[:4], group or None, seed=n * 5 + k, bias=True)
    g = torch.Generator().manual_seed(n + 11 * k)
    if fmt == "int4_a8":   # (every row and group its own scale)
        q.scales = (q.scales.float() * (1 + torch.rand(q.scales.shape, generator=g))).to(torch.bfloat16)
    x = torch.randn(8, k, generator=g) * (1 + torch.rand(8, 1, generator=g) * 3)
    add = torch.randn(8, n, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        def product(B, v, b=0):   # v 0: an add, 1: a bias, 2: neither (the one-row loop's direct stores)
            return cpu_decode.weight_matvec(x[b:b + B].contiguous(), fmt, q.stored, q.scales, group,
                                            bias=q.bias if v == 1 else None,
                                            add=add[b:b + B].contiguous() if v == 0 else None)

        alone = {(b, v): product(1, v, b)[0] for b in range(8) for v in (0, 1, 2)}
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for B in (1, 2, 3, 4, 5, 8) if nt == 2 else (2, 3, 4, 5, 8):
                for v in (0, 1, 2) if B in (1, 8) else (B % 2,):
                    y = product(B, v)
                    for b in range(B):
                        assert torch.equal(y[b].view(torch.int32), alone[b, v].view(torch.int32)), (nt, B, v, b)
    finally:
        torch.set_num_threads(threads)
