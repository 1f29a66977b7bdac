"""csrc/rowsums.h: the backward's row sums folded several rows at a time (AVX2 without AVX-512) give the bits of the
row-by-row fold. The reference is the same source built with -DLINATTN_PLAIN_C, which folds row by row: RWKV-7's
outputs, final states and every gradient must agree bit for bit, over key sizes with whole batches of rows and
rows left over (K = 5, 13, 24, 64), value widths over the column blocks, both dtypes, packed sequences, threads 1
and 2. On a CPU with AVX-512 (or without AVX2) both builds fold row by row and the test checks nothing new."""
from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from linattn.cpu import build as cbuild

HAVE_CC = shutil.which(os.environ.get("CC", "").strip() or "cc") is not None
pytestmark = pytest.mark.skipif(not HAVE_CC or not cbuild.enabled(), reason="no C compiler or the kernels are off")


@pytest.fixture(scope="module")
def plain_rwkv7(tmp_path_factory):
    """csrc/rwkv7.c built with -DLINATTN_PLAIN_C (the row-by-row fold)."""
    src = tmp_path_factory.mktemp("plain")
    for f in cbuild.CSRC.iterdir():
        (src / f.name).write_bytes(f.read_bytes())
    (src / "rwkv7.c").write_text("#define LINATTN_PLAIN_C\n" + (cbuild.CSRC / "rwkv7.c").read_text())
    return ctypes.CDLL(str(cbuild.build("rwkv7", src)))


def _run(K, V, dtype, threads):
    """(o, S, every gradient) of the flat scan on three packed sequences with initial states."""
    from linattn.cpu.rwkv7 import rwkv7_scan

    g = torch.Generator().manual_seed(K * 1000 + V)
    TT, H, starts = 150, 2, [0, 1, 70, 150]  # 150 > two of the backward's checkpoint stretches
    r = torch.randn(TT, H, K, generator=g, dtype=torch.float64)
    w = -0.6 * torch.rand(TT, H, K, generator=g, dtype=torch.float64)
    k = torch.randn(TT, H, K, generator=g, dtype=torch.float64)
    kk = F.normalize(torch.randn(TT, H, K, generator=g, dtype=torch.float64), dim=-1)
    a, b = -kk, kk * torch.rand(TT, H, K, generator=g, dtype=torch.float64)
    v = torch.randn(TT, H, V, generator=g, dtype=torch.float64)
    S0 = torch.randn(3, H, K, V, generator=g, dtype=torch.float64)
    leaves = [x.to(dtype).requires_grad_() for x in (r, w, k, v, a, b, S0)]
    wo, wS = torch.randn(TT, H, V, generator=g, dtype=dtype), torch.randn(3, H, K, V, generator=g, dtype=dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        o, S = rwkv7_scan(*leaves[:6], leaves[6], starts, 0.7)
        grads = torch.autograd.grad((o * wo).sum() + (S * wS).sum(), leaves)
    finally:
        torch.set_num_threads(before)
    return (o, S, *grads)


@pytest.mark.parametrize("K,V", [(5, 16), (13, 40), (24, 48), (64, 64), (64, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rwkv7_batched_row_sums_keep_the_bits(plain_rwkv7, monkeypatch, K, V, dtype):
    from linattn.cpu import bindings

    assert bindings.bind("rwkv7") is not None
    for threads in (1, 2):
        native = _run(K, V, dtype, threads)
        with monkeypatch.context() as m:
            m.setattr(bindings, "load_library", lambda name: plain_rwkv7)
            plain = _run(K, V, dtype, threads)
        names = ["o", "S", "dr", "dw", "dk", "dv", "da", "db", "dS0"]
        for name, x, y in zip(names, native, plain):
            assert torch.equal(x, y), f"{name} (K {K}, V {V}, {dtype}, {threads} threads): the bits differ"
