"""AVX2's int4-a8 decode step (csrc/qmatvec.h a8_i4_steps4's direct loop: one x row on one thread with no bias, add
or tail, its steps of four rows in a loop of their own storing into y, a row's lanes in pairs of steps). Rows of one
odd step, pairs only, pairs and an odd step, steps on the unchecked loop and the last ones on the checked one, every
n % 4, groups 32 and 64, every row and group its own scale: the bits of the same row in a product of two x rows
(a8_i4_pass: its own scale loads and loop) and of the product with an add of zeros (the per-step loop's stores), and
within the format's bound against fp64. (Round 20 tried other forms of this loop with the same bits: this is the
test that held them to it.)"""
from __future__ import annotations

import pytest
import torch

from linattn.cpu import decode as cpu_decode
from linattn.quant.linear import pack_int4
from tests.cpu.decode_variants import decode_variant_fixture
from tests.helpers import StoredWeights, check_a8_product

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

# the AVX2 path (without AVX-512 / VNNI) on any machine with AVX2 and FMA
decode_lib = decode_variant_fixture(
    {"avx2": ("#undef __AVX512F__\n#undef __AVX512VNNI__\n#undef __AVXVNNI__\n", {"avx2", "fma"})})

# (n, k): the row's 8-input lanes nlv = k / 8 in pairs of steps (16 lanes) and an odd step: k 64 an odd step alone,
# 128 one pair, 192 a pair and an odd step, 256 / 384 two / three pairs, 320 / 448 and an odd step, 1024 eight pairs
# (the 530M model's qkv / gate_up / head rows), 2112 16 pairs and an odd step. n: the first steps' prefetches need no
# check (Q_PF_BYTES + 32 + 64 (nlv / 16 - 1) bytes of room after the last row), the last ones do, at Q_PF_BYTES 1536
# (rowsched.h) as at 1024 (rounds 20-21c's; (13, 2112) all unchecked at 1024); n % 4 of 0-3 (the last rows alone)
SHAPES = [(186, 64), (94, 128), (67, 192), (46, 256), (44, 320), (33, 384), (35, 448), (64, 1024), (13, 2112)]


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_decode_step_bits(decode_lib, group, n, k):
    q = StoredWeights(n, k, "int4", group, seed=n + 7 * k)
    g = torch.Generator().manual_seed(n * k + group)
    # every row and group its own scale: a scale read from the wrong group, row or step changes a row
    q.scales = (q.scales.float() * (1 + torch.rand(q.scales.shape, generator=g))).to(torch.bfloat16)
    x = torch.randn(2, k, generator=g) * (1 + torch.rand(1, k, generator=g) * 3)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_decode.weight_matvec(x[:1].contiguous(), "int4_a8", q.stored, q.scales, group)
        two = cpu_decode.weight_matvec(x, "int4_a8", q.stored, q.scales, group)
        zeros = cpu_decode.weight_matvec(x[:1].contiguous(), "int4_a8", q.stored, q.scales, group,
                                         add=torch.zeros(1, n))
        assert torch.equal(one[0].view(torch.int32), two[0].view(torch.int32))
        assert torch.equal(one.view(torch.int32), zeros.view(torch.int32))
        check_a8_product(q, x[:1].contiguous())
    finally:
        torch.set_num_threads(threads)


def test_int4_decode_step_zero_rows(decode_lib):
    """Rows whose codes are all 8 (every weight 0) give +0 from the direct stores, and the rows between them their
    sums within the bound: each of a step's four sums goes to its own row."""
    n, k, group = 64, 1024, 32
    q = StoredWeights(n, k, "int4", group, seed=5)
    q.q[::3] = 0   # (rows 0, 3, 6, ...: the weights 0, codes 8)
    q.stored = pack_int4(q.q)
    x = -torch.rand(1, k, generator=torch.Generator().manual_seed(3)) - 0.5
    y = cpu_decode.weight_matvec(x, "int4_a8", q.stored, q.scales, group)
    assert torch.equal(y[0, ::3].view(torch.int32), torch.zeros(len(range(0, n, 3)), dtype=torch.int32))
    check_a8_product(q, x)
