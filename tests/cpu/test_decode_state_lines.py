"""The delta-rule decode's state update with the old state given and the new one streamed (csrc/decode.c,
delta_update_lines: both passes by blocks of columns, e and o in registers) against the row loop that takes the plain
stores (the same call with S_out off a 64-byte line: the code before the blocks, unchanged), bit for bit, and against
an fp64 reference of the delta rule; on the native build (AVX-512 where the machine has it: column blocks of 8
vectors) and the AVX2 one (8 vectors too: 4 lines in fp32)."""
from __future__ import annotations

import pytest
import torch

from linattn.cpu import bindings, ptr
from tests.cpu.decode_variants import decode_variant_fixture

# (the AVX2 prefix as test_qmatvec_a8_layout.py writes it: one cached build for both)
decode_lib = decode_variant_fixture({"native": ("", set()), "avx2": (
    "#undef __AVX512F__\n#undef __AVX512VNNI__\n#undef __AVXVNNI__\n", {"avx2", "fma"})})
pytestmark = [pytest.mark.skipif(bindings.bind("decode") is None, reason="the compiled decode library is unavailable"),
              pytest.mark.usefixtures("decode_lib")]


def _inputs(B, H, HV, K, V, gated, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    C = 2 * H * K + HV * V
    y = torch.randn(B, C + HV * (2 if gated else 1), generator=g, dtype=torch.float64)
    S0 = torch.randn(B, HV, K, V, generator=g, dtype=torch.float64) * 0.5
    neg_a = -torch.rand(HV, generator=g, dtype=torch.float64) * 2
    dt_bias = torch.randn(HV, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (y, S0, neg_a, dt_bias)]


def _call(y, S0, neg_a, dt_bias, heads, kind, gated, misalign):
    """linattn_decode_delta (no conv, no norm, no gate; q l2-normalised, k too for kind 0); the new state written into
    a buffer `misalign` elements past a 64-byte line (0: the streamed path)."""
    B, H, HV, K, V = heads
    n = B * HV * K * V
    buf = torch.zeros(n + 64, dtype=y.dtype)
    start = (-(buf.data_ptr() // y.element_size())) % (64 // y.element_size()) + misalign
    S = buf[start:start + n].view(B, HV, K, V)
    out = torch.full((B, HV * V), float("nan"), dtype=y.dtype)
    fn = bindings.bind("decode").function("linattn_decode_delta", y.dtype)
    rc = fn(B, H, HV, K, V, ptr(y), y.shape[1], 0, None, None, None, 0, None, kind, 0, 1, 1e-6, K ** -0.5, 0, None,
            int(gated), ptr(neg_a) if gated else None, ptr(dt_bias) if gated else None, ptr(S0), ptr(S), 0, None,
            1e-6, 0, ptr(out), 1)
    assert rc == 0
    return out, S.clone()


def _reference(y, S0, neg_a, dt_bias, heads, kind, gated):
    """The delta rule in fp64 (kind 0: q, k l2-normalised by rsqrt; kind 1, EFLA: q so, keys kept, the exact
    coefficient)."""
    B, H, HV, K, V = heads
    y, S0 = y.double(), S0.double()
    q = y[:, :H * K].view(B, H, K)
    k = y[:, H * K:2 * H * K].view(B, H, K)
    v = y[:, 2 * H * K:2 * H * K + HV * V].view(B, HV, V)
    yb = y[:, 2 * H * K + HV * V:]
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)   # (kind 1: q_l2)
    if kind == 0:
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * K ** -0.5
    lam = (k * k).sum(-1, keepdim=True)
    d2 = lam.clamp_min(1.0)
    k = k / d2.sqrt()
    G = HV // H
    q, k, lam, d2 = (t.repeat_interleave(G, 1) for t in (q, k, lam, d2))
    beta = torch.sigmoid(yb[:, :HV]).unsqueeze(-1)
    a = beta if kind == 0 else -torch.expm1(-beta * lam) / lam
    S = S0
    if gated:
        decay = torch.exp(neg_a.double() * torch.nn.functional.softplus(yb[:, HV:2 * HV] + dt_bias.double()))
        S = S * decay[..., None, None]
    ks = torch.einsum("bhk,bhkv->bhv", k, S)
    err = a * d2 * (v / d2.sqrt()) - a * d2 * ks
    S = S + k.unsqueeze(-1) * err.unsqueeze(-2)
    return torch.einsum("bhk,bhkv->bhv", q, S).reshape(B, HV * V), S


# (B, H, HV, K, V): K with 0-3 rows past the last block of four, and fewer rows than the prefetch distance; V one
# to eight 64-byte lines in fp32 (16 / 32 / 128 channels), and 9 / 13 (144 / 208: column blocks and a tail of 1 / 5
# lines in fp32 with AVX-512's blocks of 8 lines, 1 line with AVX2's of 4; fp64's twice as many lines); several heads
# (the next head's prefetch) and GVA
SHAPES = [(1, 16, 16, 128, 128), (2, 2, 4, 7, 16), (1, 3, 3, 66, 32), (2, 1, 2, 129, 48), (1, 2, 2, 3, 16),
          (1, 4, 8, 13, 64), (1, 2, 2, 11, 144), (1, 1, 2, 5, 208)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind,gated", [(0, True), (0, False), (1, True)])
def test_state_lines_equal_the_row_loop_and_the_delta_rule(shape, kind, gated, dtype):
    y, S0, neg_a, dt_bias = _inputs(*shape, gated, dtype, seed=sum(shape) + 7 * kind + gated)
    o_lines, S_lines = _call(y, S0, neg_a, dt_bias, shape, kind, gated, misalign=0)
    o_rows, S_rows = _call(y, S0, neg_a, dt_bias, shape, kind, gated, misalign=1)
    assert torch.equal(S_lines, S_rows) and torch.equal(o_lines, o_rows)
    o_ref, S_ref = _reference(y, S0, neg_a, dt_bias, shape, kind, gated)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(S_lines.double(), S_ref, **tol)
    torch.testing.assert_close(o_lines.double(), o_ref, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("V", [16, 144])
def test_state_lines_keep_nonfinite_values(V, dtype):
    """An inf in the old state (and the NaNs it makes) and a NaN land where the row loop puts them: in a column block
    and in the columns past the last one."""
    shape = (1, 2, 2, 9, V)
    y, S0, neg_a, dt_bias = _inputs(*shape, True, dtype, seed=5)
    S0[0, 1, 4, 3] = float("inf")
    S0[0, 0, 8, V - 1] = float("nan")
    S0[0, 1, 2, V - 9] = float("-inf")
    o_lines, S_lines = _call(y, S0, neg_a, dt_bias, shape, 0, True, misalign=0)
    o_rows, S_rows = _call(y, S0, neg_a, dt_bias, shape, 0, True, misalign=1)
    assert not torch.isfinite(S_lines).all()
    for a, b in ((S_lines, S_rows), (o_lines, o_rows)):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
