"""Issue 32 point 3: the Triton kernels' newer coverage, on CPU under Triton's interpreter.

* grouped value heads: q, k [TT, HQ, K] and v, gates, states [.., H, ..] with H a multiple of HQ; value
  head j reads q/k head j // (H // HQ). Each kernel entry point against the same call with q and k
  expanded to H heads (the plain case, itself tested against the PyTorch forms in test_kernels.py):
  outputs, final states, and the gradients of every input (a q/k head's gradient is the sum over the
  value heads that read it, which autograd through `repeat_interleave` gives the expanded call);
* `qk_l2norm=True` (fla's x * rsqrt(sum x^2 + 1e-6)) on the Triton backend against an fp64 reference
  written from that formula, with keys small enough that the two L2 conventions differ.

TRITON_INTERPRET must be set before triton is imported: it is set here, at the top.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import linattn  # noqa: E402
from linattn.errors import LinattnError  # noqa: E402
from linattn.ops.reference import delta_rule_ref, rel_err  # noqa: E402

triton = pytest.importorskip("triton")
if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("no GPU and TRITON_INTERPRET != 1", allow_module_level=True)
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"

TD = pytest.importorskip("linattn.triton.delta")
TL = pytest.importorskip("linattn.triton.linear")

STARTS = [0, 1, 17, 37]  # a 1-token sequence, a full chunk + 1, a partial chunk (chunk 16)


def _leaves(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, kind) in shapes.items():
        x = torch.randn(*shape, generator=g)
        if kind == "gate":
            x = -torch.rand(*shape, generator=g) * 0.4
        elif kind == "pos":
            x = torch.rand(*shape, generator=g) + 0.3
        elif kind == "beta":
            x = torch.rand(*shape, generator=g)
        elif kind == "small":
            x = x * 0.3
        out[name] = x.to(DEV).requires_grad_(True)
    return out


def _compare(run, leaves, HQ, H, tol=1e-5, grads=True):
    """run(q, k, **rest) -> tuple of tensors; grouped (q, k with HQ heads) vs expanded (H heads)."""
    n = H // HQ
    rest = {k: v for k, v in leaves.items() if k not in ("q", "k")}
    res = {}
    for mode in ("grouped", "expanded"):
        q, k = leaves["q"], leaves["k"]
        if mode == "expanded":
            q, k = q.repeat_interleave(n, dim=1), k.repeat_interleave(n, dim=1)
        outs = [t for t in run(q, k, **rest) if t is not None]
        gs = []
        if grads:
            gen = torch.Generator().manual_seed(1)
            loss = sum((t * torch.randn(t.shape, generator=gen).to(t.device)).sum() for t in outs)
            gs = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        res[mode] = ([t.detach() for t in outs], gs)
    (oa, ga), (ob, gb) = res["grouped"], res["expanded"]
    assert len(oa) == len(ob)
    for i, (a, b) in enumerate(zip(oa, ob)):
        assert a.shape == b.shape and rel_err(a, b) <= tol, f"output {i}: {rel_err(a, b):.3g}"
    for name, a, b in zip(leaves, ga, gb):
        assert (a is None) == (b is None), name
        if a is not None:
            assert rel_err(a, b) <= tol, f"d{name}: {rel_err(a, b):.3g}"
    return oa


@pytest.mark.parametrize("HQ,H", [(1, 3), (2, 4)])
def test_grouped_heads_linear_chunk(HQ, H):
    TT, N, K, V = STARTS[-1], len(STARTS) - 1, 16, 16
    leaves = _leaves({"q": ((TT, HQ, K), "small"), "k": ((TT, HQ, K), "small"), "v": ((TT, H, V), "n"),
                      "g": ((TT, H), "gate"), "h0": ((N, H, K, V), "n"), "z0": ((N, H, K), "pos")})

    def run(q, k, v, g, h0, z0):
        return TL.chunk_linear_attention(q, k, v, g, h0, z0, fused="elu+1", scale=0.8, norm=True, starts=STARTS,
                                         chunk_size=16, output_final_state=True)

    num, den, ht, zt = _compare(run, leaves, HQ, H)
    assert num.shape == (TT, H, V) and den.shape == (TT, H) and ht.shape == (N, H, K, V) and zt.shape == (N, H, K)


def test_grouped_heads_linear_recurrent():
    HQ, H, TT, N, K, V = 2, 4, STARTS[-1], len(STARTS) - 1, 16, 16
    leaves = _leaves({"q": ((TT, HQ, K), "small"), "k": ((TT, HQ, K), "small"), "v": ((TT, H, V), "n"),
                      "g": ((TT, H), "gate"), "h0": ((N, H, K, V), "n"), "z0": ((N, H, K), "pos")})

    def run(q, k, v, g, h0, z0):
        return TL.fused_recurrent_linear_attention(q, k, v, g, h0, z0, fused="relu", scale=0.8, norm=True,
                                                   starts=STARTS, output_final_state=True)

    _compare(run, leaves, HQ, H, grads=False)


@pytest.mark.parametrize("gate", [True, False])
def test_grouped_heads_delta_chunk(gate):
    HQ, H, TT, N, K, V = 2, 4, STARTS[-1], len(STARTS) - 1, 16, 16
    shapes = {"q": ((TT, HQ, K), "small"), "k": ((TT, HQ, K), "small"), "v": ((TT, H, V), "n"),
              "b": ((TT, H), "beta"), "h0": ((N, H, K, V), "small")}
    if gate:
        shapes["g"] = ((TT, H), "gate")
    leaves = _leaves(shapes)

    def run(q, k, v, b, h0, g=None):
        return TD.chunk_delta_rule(q, k, v, b, g, h0, starts=STARTS, chunk_size=16, output_final_state=True)

    o, ht = _compare(run, leaves, HQ, H)
    assert o.shape == (TT, H, V) and ht.shape == (N, H, K, V)


def test_grouped_heads_delta_recurrent():
    HQ, H, TT, N, K, V = 1, 2, STARTS[-1], len(STARTS) - 1, 16, 16
    leaves = _leaves({"q": ((TT, HQ, K), "small"), "k": ((TT, HQ, K), "small"), "v": ((TT, H, V), "n"),
                      "b": ((TT, H), "beta"), "g": ((TT, H), "gate"), "h0": ((N, H, K, V), "small")})

    def run(q, k, v, b, g, h0):
        return TD.fused_recurrent_delta_rule(q, k, v, b, g, h0, starts=STARTS, output_final_state=True)

    _compare(run, leaves, HQ, H, grads=False)


def test_grouped_heads_must_divide():
    q = torch.randn(8, 2, 16, device=DEV)
    v = torch.randn(8, 3, 16, device=DEV)
    with pytest.raises(LinattnError, match=r"value heads \(3\).*query/key heads \(2\)"):
        TD.chunk_delta_rule(q, q, v, torch.rand(8, 3, device=DEV), None, None, starts=[0, 8], chunk_size=16,
                            output_final_state=False)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_qk_l2norm_rsqrt_convention(mode):
    """qk_l2norm=True is x * rsqrt(sum x^2 + 1e-6) on the Triton backend too: rows of norm 1e-3 come out
    with norm 1/sqrt(2), not 1 (where x / max(||x||, 1e-6) would give 1)."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 20, 2, 16, 16
    q, k, v = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen), \
        torch.randn(B, T, H, V, generator=gen)
    small = torch.zeros(T, dtype=torch.bool)
    small[::3] = True
    k[:, small] = k[:, small] / k[:, small].norm(dim=-1, keepdim=True) * 1e-3
    q[:, small] = q[:, small] / q[:, small].norm(dim=-1, keepdim=True) * 1e-3
    beta = torch.rand(B, T, H, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 0.3
    leaves = [x.to(DEV).requires_grad_(mode == "chunk") for x in (q, k, v, beta, g)]
    o, S = linattn.delta_rule(*leaves[:4], g=leaves[4], qk_l2norm=True, mode=mode, chunk_size=16,
                              output_final_state=True, backend="triton")

    def rsqrt_norm(x):
        x = x.double()
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    qn, kn = rsqrt_norm(leaves[0]), rsqrt_norm(leaves[1])
    assert torch.allclose(kn[0, small].norm(dim=-1), torch.full_like(kn[0, small][..., 0], 2 ** -0.5), rtol=1e-6)
    o_ref, S_ref = delta_rule_ref(qn, kn, leaves[2], leaves[3], g=leaves[4], S0=None)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(S, S_ref) <= 1e-5
    if mode == "chunk":
        gen = torch.Generator().manual_seed(4)
        w = torch.randn(o.shape, generator=gen).to(DEV)
        ga = torch.autograd.grad((o * w).sum(), leaves)
        gb = torch.autograd.grad((o_ref * w.double()).sum(), leaves)
        for name, a, b in zip("q k v beta g".split(), ga, gb):
            assert rel_err(a, b) <= 1e-5, name


# ------------------------------------------------------------------ torch.library custom ops

def _op_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    TT, H, K, V = 20, 2, 16, 16
    q, k = torch.randn(TT, 1, K, generator=g) * 0.3, torch.randn(TT, 1, K, generator=g) * 0.3  # grouped: HQ=1
    v, gate = torch.randn(TT, H, V, generator=g), -torch.rand(TT, H, generator=g) * 0.3
    h0, z0, b = torch.randn(2, H, K, V, generator=g) * 0.1, torch.rand(2, H, K, generator=g) + 0.5, \
        torch.rand(TT, H, generator=g)
    return [x.to(DEV).requires_grad_() for x in (q, k, v, gate, h0, z0, b)]


@pytest.mark.parametrize("op", ["linear_chunk", "linear_recurrent", "delta_chunk", "delta_recurrent"])
def test_custom_ops_opcheck(op):
    """Schema, fake (shape) implementation, autograd registration and AOT dispatch of each op."""
    q, k, v, g, h0, z0, b = _op_inputs()
    starts = [0, 3, 20]
    if op == "linear_chunk":
        args = (q, k, v, g, h0, z0, "elu+1", 0.8, True, starts, 16, True)
    elif op == "linear_recurrent":
        args = tuple(x.detach() for x in (q, k, v, g, h0, z0)) + ("relu", 0.8, True, starts, True)
    elif op == "delta_chunk":
        args = (q, k, v, b, g, h0, starts, 16, True)
    else:
        args = tuple(x.detach() for x in (q, k, v, b, g, h0)) + (starts, True)
    fn = getattr(torch.ops.linattn, f"triton_{op}_fwd").default
    res = torch.library.opcheck(fn, args)
    assert all(r == "SUCCESS" for r in res.values()), res


def test_torch_compile_fullgraph_no_graph_break():
    """The operators on backend='triton' trace under torch.compile(fullgraph=True) with no graph break
    (each kernel pass is one custom op), and the compiled forward and backward match eager."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 20, 2, 16, 16
    leaves = [torch.randn(B, T, H, d, generator=gen).to(DEV).requires_grad_() for d in (K, K, V)]
    leaves += [(-torch.rand(B, T, H, generator=gen) * 0.3).to(DEV).requires_grad_(),
               torch.rand(B, T, H, generator=gen).to(DEV).requires_grad_()]

    def f(q, k, v, g, beta):
        o1, s1 = linattn.linear_attention(q, k, v, g=g, chunk_size=16, output_final_state=True, backend="triton")
        o2, s2 = linattn.delta_rule(q, k, v, beta, g=g, qk_l2norm=True, chunk_size=16, output_final_state=True,
                                    backend="triton")
        with torch.no_grad():  # decoding: the recurrent ops continue from the states
            o3, _ = linattn.delta_rule(q[:, :1], k[:, :1], v[:, :1], beta[:, :1], g=g[:, :1], qk_l2norm=True,
                                       mode="recurrent", initial_state=s2, backend="triton")
        return o1.sum() + s1.kv.sum() + o2.sum() + s2.sum() + o3.sum()

    ref = f(*leaves)
    gref = torch.autograd.grad(ref, leaves)
    torch._dynamo.reset()
    # fullgraph=True raises on the first graph break, naming it: no separate torch._dynamo.explain trace needed
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves)
    gout = torch.autograd.grad(out, leaves)
    assert rel_err(out, ref) <= 1e-6
    for a, b in zip(gout, gref):
        assert rel_err(a, b) <= 1e-5
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_grouped_heads_delta_rule_operator(mode, monkeypatch):
    """delta_rule with q, k of 2 heads and v, beta, g, state of 4 (value head j reads q/k head j // 2) on
    backend='triton' against backend='torch': the kernels get the 2 q/k heads (not a repeated copy)."""
    gen = torch.Generator().manual_seed(5)
    B, T, HQ, H, K, V = 2, 21, 2, 4, 16, 16
    q, k = torch.randn(B, T, HQ, K, generator=gen), torch.randn(B, T, HQ, K, generator=gen)
    v, beta = torch.randn(B, T, H, V, generator=gen), torch.rand(B, T, H, generator=gen)
    g, S0 = -torch.rand(B, T, H, generator=gen) * 0.3, torch.randn(B, H, K, V, generator=gen) * 0.1
    leaves = [x.to(DEV).requires_grad_(mode == "chunk") for x in (q, k, v, beta, g, S0)]
    seen = []
    fn = "chunk_delta_rule" if mode == "chunk" else "fused_recurrent_delta_rule"
    orig = getattr(TD, fn)
    monkeypatch.setattr(TD, fn, lambda q, *a, **kw: seen.append(q.shape[1]) or orig(q, *a, **kw))
    outs = {}
    for backend in ("triton", "torch"):
        o, S = linattn.delta_rule(*leaves[:4], g=leaves[4], initial_state=leaves[5], qk_l2norm=True, mode=mode,
                                  chunk_size=16, output_final_state=True, backend=backend)
        grads = []
        if mode == "chunk":
            w = torch.randn(o.shape, generator=torch.Generator().manual_seed(6)).to(DEV)
            grads = torch.autograd.grad((o * w).sum() + S.sum(), leaves)
        outs[backend] = (o, S, grads)
    assert seen == [HQ]
    (o1, S1, g1), (o2, S2, g2) = outs["triton"], outs["torch"]
    assert o1.shape == (B, T, H, V) and S1.shape == (B, H, K, V)
    assert rel_err(o1, o2) <= 1e-5 and rel_err(S1, S2) <= 1e-5
    for name, a, b in zip("q k v beta g S0".split(), g1, g2):
        assert rel_err(a, b) <= 1e-5, name


@pytest.mark.parametrize("gate_heads", [4, 2, None])
def test_grouped_heads_linear_attention_operator(gate_heads, monkeypatch):
    """linear_attention with q, k of 2 heads and v of 4: a gate per value head (q, k repeated by the
    operator; the kernels get the 2 q/k heads), per q/k head or none (value heads folded into the width)."""
    gen = torch.Generator().manual_seed(7)
    B, T, HQ, H, K, V = 2, 21, 2, 4, 16, 16
    q, k = torch.randn(B, T, HQ, K, generator=gen) * 0.5, torch.randn(B, T, HQ, K, generator=gen) * 0.5
    v = torch.randn(B, T, H, V, generator=gen)
    leaves = [x.to(DEV).requires_grad_() for x in (q, k, v)]
    kw = {}
    if gate_heads is not None:
        leaves.append((-torch.rand(B, T, gate_heads, generator=gen) * 0.3).to(DEV).requires_grad_())
        kw["g"] = leaves[-1]
    seen = []
    orig = TL.chunk_linear_attention
    monkeypatch.setattr(TL, "chunk_linear_attention", lambda q, *a, **k2: seen.append(q.shape[1]) or orig(q, *a, **k2))
    outs = {}
    for backend in ("triton", "torch"):
        o, st = linattn.linear_attention(*leaves[:3], chunk_size=16, output_final_state=True, backend=backend, **kw)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(8)).to(DEV)
        outs[backend] = (o, st, torch.autograd.grad((o * w).sum() + st.kv.sum() + st.z.sum(), leaves))
    assert seen == [HQ]
    (o1, s1, g1), (o2, s2, g2) = outs["triton"], outs["torch"]
    assert o1.shape == (B, T, H, V) and s1.kv.shape == s2.kv.shape
    for a, b in ((o1, o2), (s1.kv, s2.kv), (s1.z, s2.z)) + tuple(zip(g1, g2)):
        assert rel_err(a, b) <= 1e-5


def test_kda_per_channel_gates_recurrent():
    """KDA (delta_rule with g [B, T, H, K]) decodes on the Triton recurrent kernel (grouped heads too),
    against backend='torch' and an fp64 reference loop (the chunk form: tests/triton/test_kda.py)."""
    gen = torch.Generator().manual_seed(9)
    B, T, HQ, H, K, V = 2, 9, 1, 2, 16, 16
    q, k = torch.randn(B, T, HQ, K, generator=gen), torch.randn(B, T, HQ, K, generator=gen)
    v, beta = torch.randn(B, T, H, V, generator=gen), torch.rand(B, T, H, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen) * 2.0  # a strong decay on some channels
    S0 = torch.randn(B, H, K, V, generator=gen) * 0.1
    args = [x.to(DEV) for x in (q, k, v, beta)]
    kw = dict(g=g.to(DEV), initial_state=S0.to(DEV), qk_l2norm=True, mode="recurrent", output_final_state=True)
    p = linattn.prepare_delta(*args, channel_gate=True, qk_l2norm=True, g=kw["g"], mode="recurrent")
    assert p.triton_unsupported() is None
    assert linattn.prepare_delta(*args, channel_gate=True, g=kw["g"]).triton_unsupported() is None  # chunk: KDA kernels
    o1, S1 = linattn.delta_rule(*args, backend="triton", **kw)
    o2, S2 = linattn.delta_rule(*args, backend="torch", **kw)
    assert rel_err(o1, o2) <= 1e-5 and rel_err(S1, S2) <= 1e-5

    def rsqrt_norm(x):
        x = x.double()
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    qe, ke = (rsqrt_norm(x).repeat_interleave(H // HQ, dim=2) for x in (q, k))
    o3, S3 = delta_rule_ref(qe, ke, v, beta, g=g, S0=S0)
    assert rel_err(o1, o3) <= 1e-5 and rel_err(S1, S3) <= 1e-5


@pytest.mark.parametrize("fm", ["elu+1", "taylor2"])
def test_gla_diagonal_gates_recurrent(fm):
    """linear_attention with diagonal (GLA) gates g [B, T, H, K_phi] decodes on the Triton recurrent kernel
    (a fused map, and taylor2's PyTorch features with K_phi != K), continuing a prefix's state, against
    backend='torch'; the chunk form stays on PyTorch."""
    gen = torch.Generator().manual_seed(10)
    B, T, H, K, V = 2, 7, 2, 4, 16
    q, k, v = (torch.randn(B, T, H, d, generator=gen) * 0.5 for d in (K, K, V))
    Kf = linattn.get_feature_map(fm, K).phi(torch.zeros(1, 1, 1, K), torch.zeros(1, 1, dtype=torch.long)).shape[-1]
    g = -torch.rand(B, T, H, Kf, generator=gen) * 1.5
    q, k, v, g = (x.to(DEV) for x in (q, k, v, g))
    _, state = linattn.linear_attention(q[:, :3], k[:, :3], v[:, :3], feature_map=fm, g=g[:, :3], mode="chunk",
                                        output_final_state=True, backend="torch")
    kw = dict(feature_map=fm, g=g[:, 3:], mode="recurrent", initial_state=state, output_final_state=True)
    p = linattn.prepare_linear_attention(q[:, 3:], k[:, 3:], v[:, 3:], **kw)
    assert p.triton_unsupported() is None
    assert "diagonal" in linattn.prepare_linear_attention(q, k, v, feature_map=fm, g=g).triton_unsupported()
    o1, s1 = linattn.linear_attention(q[:, 3:], k[:, 3:], v[:, 3:], backend="triton", **kw)
    o2, s2 = linattn.linear_attention(q[:, 3:], k[:, 3:], v[:, 3:], backend="torch", **kw)
    for a, b in ((o1, o2), (s1.kv, s2.kv), (s1.z, s2.z)):
        assert rel_err(a, b) <= 1e-5
