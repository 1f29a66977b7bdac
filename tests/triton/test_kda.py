"""Kimi Delta Attention (delta_rule with per-channel log gates g [B, T, HV, K]) on the Triton CHUNK kernels
(triton/delta.py's `_kda_*`), on CPU under Triton's interpreter: outputs, final states and the gradients of
every input (q, k, v, beta, g, initial_state) against backend='torch' and the fp64 recurrence
(ops/reference.py's delta_rule_ref), with grouped value heads, T not a multiple of the 16-token tile, T = 1,
uneven cu_seqlens, strong gates (down to -20 per token: a factorised exp(-G) would overflow fp32 after a few
tokens), fp32 and bf16. Tolerances as tests/triton/test_kernels.py (fp32 1e-3 of the RMS, bf16 1e-2); fp32 measures
~1e-7..1e-6. Shapes are tiny: the interpreter runs every program in Python.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import linattn  # noqa: E402
from linattn.ops.reference import delta_rule_ref, rel_err  # noqa: E402

try:
    import triton  # noqa: F401
    _RUNS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
except Exception:  # pragma: no cover - triton absent
    _RUNS = False

pytestmark = pytest.mark.skipif(not _RUNS, reason="triton not importable, or no GPU and TRITON_INTERPRET != 1")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}


def _inputs(B, T, HQ, H, K, V, gate_scale, seed, strong_channels=False):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, T, HQ, K, generator=gen), torch.randn(B, T, HQ, K, generator=gen)
    v, beta = torch.randn(B, T, H, V, generator=gen), torch.rand(B, T, H, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * gate_scale
    if strong_channels:  # half the channels decay at -20 per token, the other half barely (a wide spread)
        g[..., ::2] = -20.0 + torch.rand(B, T, H, K // 2 + K % 2, generator=gen)
        g[..., 1::2] *= 0.01
    S0 = torch.randn(B, H, K, V, generator=gen) * 0.1
    return q, k, v, beta, g, S0


def _run(backend, q, k, v, beta, g, S0, dtype, cu=None, seed=3):
    """(o, S, grads of q, k, v, beta, g, S0) of a random linear functional of o and S."""
    leaves = [x.to(DEV, dtype if i < 3 else torch.float32).requires_grad_() for i, x in
              enumerate((q, k, v, beta, g, S0))]
    qq, kk, vv, bb, gg, ss = leaves
    o, S = linattn.delta_rule(qq, kk, vv, bb, g=gg, initial_state=ss, qk_l2norm=True, mode="chunk",
                              output_final_state=True, cu_seqlens=cu, backend=backend)
    gen = torch.Generator().manual_seed(seed)
    loss = (o.float() * torch.randn(o.shape, generator=gen).to(DEV)).sum() + \
        (S.float() * torch.randn(S.shape, generator=gen).to(DEV)).sum()
    return (o, S) + torch.autograd.grad(loss, leaves)


def _ref(q, k, v, beta, g, S0, cu=None, seed=3):
    """The fp64 recurrence, per sequence of cu_seqlens (B = 1 then)."""
    leaves = [x.double().requires_grad_() for x in (q, k, v, beta, g, S0)]
    qq, kk, vv, bb, gg, ss = leaves
    if cu is None:
        o, S = delta_rule_ref(qq, kk, vv, bb, g=gg, qk_l2norm=True, S0=ss)
    else:
        parts = [delta_rule_ref(*(x[:, a:b] for x in (qq, kk, vv, bb)), g=gg[:, a:b], qk_l2norm=True,
                                S0=ss[i:i + 1]) for i, (a, b) in enumerate(zip(cu[:-1], cu[1:]))]
        o, S = torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 0)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen).double()).sum() + (S * torch.randn(S.shape, generator=gen)).sum()
    return (o, S) + torch.autograd.grad(loss, leaves)


NAMES = ("o", "S", "dq", "dk", "dv", "dbeta", "dg", "dS0")


def _compare(a, b, tol):
    errs = {}
    for name, x, y in zip(NAMES, a, b):
        assert x.shape == y.shape, name
        assert torch.isfinite(x).all(), f"{name}: non-finite values"
        errs[name] = rel_err(x.double(), y.double())
    assert max(errs.values()) <= tol, errs
    return errs


CASES = [
    # id, (B, T, HQ, H, K, V), gate scale, strong channels, cu_seqlens, dtype
    ("grouped-T21-state", (2, 21, 1, 2, 16, 16), 3.0, False, None, torch.float32),
    ("strong-varlen-T1-K40", (1, 30, 2, 2, 40, 20), 1.0, True, [0, 1, 17, 30], torch.float32),
    ("T1", (2, 1, 1, 1, 16, 16), 3.0, False, None, torch.float32),
    ("bf16-grouped-varlen", (1, 18, 1, 2, 16, 16), 3.0, True, [0, 5, 18], torch.bfloat16),
]


@pytest.mark.parametrize("shape,gate_scale,strong,cu,dtype", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_kda_chunk_matches_torch_and_fp64(shape, gate_scale, strong, cu, dtype):
    B, T, HQ, H, K, V = shape
    x = _inputs(B, T, HQ, H, K, V, gate_scale, seed=T + K, strong_channels=strong)
    if cu is not None:
        x = x[:5] + (torch.randn(len(cu) - 1, H, K, V, generator=torch.Generator().manual_seed(5)) * 0.1,)
    cu_t = torch.tensor(cu, device=DEV) if cu is not None else None
    tri = _run("triton", *x, dtype, cu_t)
    tor = _run("torch", *x, dtype, cu_t)
    _compare(tri, tor, TOL[dtype])
    if dtype == torch.float32:  # the fp64 recurrence, written from the formula
        # the inputs' rounding to dtype is shared by both low-precision sides, not by the reference
        _compare(tri, _ref(*x, cu=cu), TOL[dtype])


def test_kda_chunk_routed_to_triton(monkeypatch):
    """A chunk call with per-channel gates is covered (with or without gradients) and really runs the KDA
    kernels on backend='triton' (16-token tile); a per-head gate keeps its own kernels."""
    import linattn.triton.delta as TD

    q, k, v, beta, g, S0 = _inputs(1, 5, 1, 1, 16, 16, 1.0, seed=0)
    p = linattn.prepare_delta(q.requires_grad_(), k, v, beta, g=g, channel_gate=True, mode="chunk")
    assert p.triton_unsupported() is None
    assert p.chunk_size_used("triton") == 16
    calls = []
    orig = TD._kda_wy_fwd

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return orig[grid]

    monkeypatch.setattr(TD, "_kda_wy_fwd", Spy())
    linattn.delta_rule(q, k, v, beta, g=g, backend="triton")
    assert len(calls) == 1
    linattn.delta_rule(q, k, v, beta, g=g[..., 0], backend="triton")  # per-head gate: not the KDA kernels
    assert len(calls) == 1


def test_kda_chunk_custom_op_opcheck():
    """The chunk op with a per-channel gate g [TT, H, K]: schema, fake (shape) implementation, autograd
    registration and AOT dispatch (torch.library.opcheck), grouped heads and two packed sequences."""
    import linattn.triton.delta  # noqa: F401  (registers the ops)

    gen = torch.Generator().manual_seed(2)
    TT, H, K, V = 20, 2, 16, 16
    q, k = torch.randn(TT, 1, K, generator=gen) * 0.3, torch.randn(TT, 1, K, generator=gen) * 0.3
    v, b, g = torch.randn(TT, H, V, generator=gen), torch.rand(TT, H, generator=gen), \
        -torch.rand(TT, H, K, generator=gen) * 3.0
    h0 = torch.randn(2, H, K, V, generator=gen) * 0.1
    args = tuple(x.to(DEV).requires_grad_() for x in (q, k, v, b, g, h0)) + ([0, 3, 20], 64, True)
    res = torch.library.opcheck(torch.ops.linattn.triton_delta_chunk_fwd.default, args)
    assert all(r == "SUCCESS" for r in res.values()), res
