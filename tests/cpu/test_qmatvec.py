"""The int4 product's other code paths (csrc/qmatvec.h): AVX-512 without AVX-512BW, AVX2 and scalar, each built from
the same sources with the machine's AVX-512BW or AVX-512 macro removed or LINATTN_PLAIN_C defined, against the
dequantized matrix's fp64 product within the computed bound (tests/helpers.py's check; tests/quant/test_decode.py
tests the native build). Widths with and without a tail after the last vector block, rows not a multiple of 4, groups 32
and 64, batches, threads, NaN / inf and huge / tiny inputs."""
from __future__ import annotations

import pytest
import torch

from linattn.cpu import decode as cpu_decode
from tests.cpu.decode_variants import decode_variant_fixture
from tests.helpers import (
    StoredWeights as _Stored,
    check_product_threads,
    check_quantized_product as _check_product,
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


# the prefix that selects each path (on top of -march=native); the AVX2 path needs AVX2 and FMA on this machine
PATHS = {
    "avx512f": ("#undef __AVX512BW__\n", {"avx512f"}),   # without the 16-bit permute: a shift per nibble
    "avx2": ("#undef __AVX512F__\n", {"avx2", "fma"}),
    "scalar": ("#define LINATTN_PLAIN_C\n", set()),
}


decode_lib = decode_variant_fixture(PATHS)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("n,k", [(13, 64), (16, 128), (9, 192), (8, 320), (5, 1088), (4, 2048)])
def test_int4_paths_match_dequantized_fp64(decode_lib, group, n, k):
    if k % group:
        pytest.skip("int4 needs in_features a multiple of the group")
    q = _Stored(n, k, "int4", group, seed=n + k, bias=True)
    for B in (1, 3):
        x = torch.randn(B, k, generator=torch.Generator().manual_seed(B))
        add = torch.randn(B, n, generator=torch.Generator().manual_seed(B + 7))
        _check_product(q, x)
        _check_product(q, x, bias=q.bias, add=add)


@pytest.mark.parametrize("group", [32, 64])
def test_int4_paths_hostile_inputs(decode_lib, group):
    q = _Stored(8, 256, "int4", group, seed=3)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    x[1, 130] = float("nan")   # in the second vector block
    x[2, 7] = float("inf")
    y = cpu_decode.weight_matvec(x, "int4", q.stored, q.scales, group)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    col = q.dequantize(torch.float64)[:, 7]
    want = torch.where(col == 0, float("nan"), torch.sign(col) * float("inf"))
    assert torch.equal(torch.isnan(y[2]), torch.isnan(want)) and torch.equal(y[2][col != 0].double(), want[col != 0])
    for scale in (1e-38, 1e35):   # subnormal products; partial sums far from overflow (8 * group * 1e35 < 3.4e38)
        _check_product(q, torch.randn(2, 256, generator=torch.Generator().manual_seed(5)) * scale)


def test_int4_paths_threads(decode_lib):
    """Rows split across threads: the same bits as one thread."""
    check_product_threads(_Stored(532, 512, "int4", 32, seed=9, bias=True),
                          torch.randn(2, 512, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4", 32), ("int4", 64)])
def test_row_schedule_every_row_count(decode_lib, mode, group):
    """A step reads rows i, i + n/4, i + 2n/4, i + 3n/4 (four streams), the n % 4 last rows one at a time: every row
    count from 1 to 9, and one with many steps and a tail split across 2 threads (the same bits as 1 thread), each
    row against its own fp64 product (a row read from the wrong quarter, or left out, fails)."""
    for n in range(1, 10):
        q = _Stored(n, 256, mode, group, seed=n, bias=True)
        _check_product(q, torch.randn(2, 256, generator=torch.Generator().manual_seed(n)), bias=q.bias)
    check_product_threads(_Stored(4 * 130 + 3, 512, mode, group, seed=11, bias=True),
                          torch.randn(2, 512, generator=torch.Generator().manual_seed(12)))
