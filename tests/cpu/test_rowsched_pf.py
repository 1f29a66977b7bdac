"""The weight products at round 21d's prefetch distance (csrc/rowsched.h `Q_PF_BYTES` 1536) give the same bits as at
the distance before it (1024): decode.c built with `#define Q_PF_BYTES 1024` in front against the build without it,
both in this process, on the native paths and on AVX2's (without AVX-512 / VNNI: qmatvec.h's step loops), every format
(fp32 plan, bf16, int8, int4, int8-a8, int4-a8), rows n < 4, n % 4 of 1-3, inputs not a multiple of the vector, the
group or x's rounding block, 1 and 2 threads. The distance moves the step at which qmatvec.h's loops change from
unchecked to checked prefetches, so a step skipped or computed twice at that boundary differs between the two builds;
int4-a8 is also held to fp64.

Round 21e's stream distance (`Q_QUARTER`, n // 4 - 1 from n = 8) against the rule before it (n // 4, built with
`#define Q_QUARTER(n) ((n) / 4)` in front, its int4-a8 scales ordered by that rule too): every row of a four-row
step there in one here (the step of neighbouring rows 4q .. 4q + 3 from n = 8), the n % 4 last rows alone in both,
so a row lost, computed twice, read alone (fp32 / bf16: another summation order) or with another row's scales
differs."""
from __future__ import annotations

import pytest
import torch

from linattn.cpu import bindings, decode as cpu_decode, qlayout
from tests.helpers import StoredWeights, build_decode_variant, check_a8_product, cpu_flags

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

# (the AVX2 path as tests/cpu/test_int4_step.py builds it)
PATHS = {"native": ("", set()),
         "avx2": ("#undef __AVX512F__\n#undef __AVX512VNNI__\n#undef __AVXVNNI__\n", {"avx2", "fma"})}


@pytest.fixture(scope="module", params=sorted(PATHS))
def builds(request, tmp_path_factory):
    """(the path at the distance before round 21d, the path with the stream distance before round 21e, the path as
    built)"""
    prefix, needs = PATHS[request.param]
    if not needs <= cpu_flags():
        pytest.skip(f"the {request.param} path needs {sorted(needs)}")
    before = build_decode_variant(tmp_path_factory.mktemp("pf1024"), prefix + "#define Q_PF_BYTES 1024\n")
    quarter = build_decode_variant(tmp_path_factory.mktemp("q4"), prefix + "#define Q_QUARTER(n) ((n) / 4)\n")
    now = build_decode_variant(tmp_path_factory.mktemp("pf"), prefix) if prefix else bindings.load_library("decode")
    return before, quarter, now


def _weights(fmt, n, m, group, seed):
    g = torch.Generator().manual_seed(seed)
    if fmt in ("plan", "bf16"):
        w = torch.randn(n, m, generator=g)
        return (w if fmt == "plan" else w.to(torch.bfloat16)), None
    q = StoredWeights(n, m, fmt.removesuffix("_a8"), group, seed=seed)
    return q.stored, q.scales


# (n, m, group): n < 4, n % 4 of 1-3, 0 with 2 threads' ranges (n m >= 4 PAR_MIN_ELEMS for int4-a8); m not a multiple
# of 8 / 16 (fp32 / bf16 vectors) nor of 32 (x's blocks) where the format allows, int4's m / group odd
SHAPES = {"float": [(1, 100, 0), (3, 37, 0), (13, 1000, 0), (186, 64, 0), (523, 1024, 0)],
          "int8": [(2, 100, 0), (5, 37, 0), (67, 1000, 0), (186, 64, 0), (523, 1024, 0)],
          "int4": [(1, 96, 32), (3, 64, 64), (67, 192, 32), (186, 64, 32), (94, 128, 64), (13, 2112, 32),
                   (264, 1024, 32)]}


def _same_bits(monkeypatch, fmt, threads, shapes, variants):
    """Each shape's product through both (library, quarter rule) variants, byte for byte equal (int4-a8's scales
    ordered by the variant's rule); int4-a8 also held to fp64 (by the build as built, the last one bound)."""
    kind = "float" if fmt in ("plan", "bf16") else fmt[:4]
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for n, m, group in shapes[kind]:
            W, s = _weights(fmt, n, m, group, seed=n + m)
            x = torch.randn(1, m, generator=torch.Generator().manual_seed(n * m)) * 2
            out = []
            for lib, quarter in variants:
                monkeypatch.setattr(bindings, "load_library", lambda name, lib=lib: lib if name == "decode" else None)
                monkeypatch.setattr(qlayout, "step_quarter", quarter)
                out.append(cpu_decode.weight_matvec(x, fmt, W, s, group))
            assert torch.equal(out[0].view(torch.int32), out[1].view(torch.int32)), (fmt, n, m, group)
            if fmt == "int4_a8":
                check_a8_product(StoredWeights(n, m, "int4", group, seed=n + m), x)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["plan", "bf16", "int8", "int4", "int8_a8", "int4_a8"])
def test_products_same_bits_at_both_distances(builds, monkeypatch, fmt, threads):
    now = qlayout.step_quarter
    _same_bits(monkeypatch, fmt, threads, SHAPES, ((builds[0], now), (builds[2], now)))


# n 1-12 (below, at and past 8, where the rule changes; every n % 4), 2 threads' ranges, the model's n % 4 == 0
QSHAPES = {"float": [(n, 40, 0) for n in range(1, 13)] + [(64, 100, 0), (263, 1024, 0), (520, 512, 0)],
           "int8": [(n, 37, 0) for n in range(1, 13)] + [(64, 100, 0), (263, 1024, 0), (520, 512, 0)],
           "int4": [(n, 96, 32) for n in range(1, 13)] + [(64, 192, 64), (186, 64, 32), (264, 1024, 32),
                                                          (523, 128, 64), (520, 1024, 32)]}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", ["plan", "bf16", "int8", "int4", "int8_a8", "int4_a8"])
def test_products_same_bits_at_both_quarters(builds, monkeypatch, fmt, threads):
    _same_bits(monkeypatch, fmt, threads, QSHAPES, ((builds[1], lambda n: n // 4), (builds[2], qlayout.step_quarter)))
