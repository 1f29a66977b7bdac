"""delta_rule (DeltaNet, Gated DeltaNet, EFLA): every variant x form against an fp64 reference loop
(outputs and gradients), EFLA's limits, extreme key norms, the unstable DeltaNet regime, bf16,
states, varlen, memory of the chunk form, and bad input."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import linattn
from linattn import delta_rule
from linattn.ops.reference import delta_rule_ref, efla_coefficient as efla_a, rel_err

MODES = ["parallel", "chunk", "recurrent"]
VARIANTS = {  # name: (exact, gated)
    "deltanet": (False, False),
    "gated_deltanet": (False, True),
    "efla": (True, False),
    "efla_gated": (True, True),
}
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def delta_ref(q, k, v, beta, g=None, exact=False, scale=None, qk_l2norm=False, S0=None):
    return delta_rule_ref(q, k, v, beta, g=g, exact=exact, scale=scale, qk_l2norm=qk_l2norm, S0=S0)


def make_inputs(B, T, H, K, V, dtype, gated, norms=(0.2, 1.4)):
    """Keys with norms in `norms` (beta * ||k||^2 < 2: a contractive DeltaNet), beta in [0, 1)."""
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, dtype=dtype), dim=-1)
    k = k * torch.empty(B, T, H, 1, dtype=dtype).uniform_(*norms)
    v = torch.randn(B, T, H, V, dtype=dtype)
    beta = torch.rand(B, T, H, dtype=dtype)
    g = -0.5 * torch.rand(B, T, H, dtype=dtype) if gated else None
    S0 = torch.randn(B, H, K, V, dtype=dtype)
    return q, k, v, beta, g, S0


def run_with_grads(fn, q, k, v, beta, g, S0, wo, wS):
    """(o, S, grads of q, k, v, beta, g, S0) for the loss sum(o * wo) + sum(S * wS)."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, beta, S0)]
    gl = g.detach().clone().requires_grad_() if g is not None else None
    o, S = fn(*leaves[:4], gl, leaves[4])
    loss = (o.double() * wo).sum() + (S.double() * wS).sum()
    inputs = leaves + ([gl] if gl is not None else [])
    return o, S, torch.autograd.grad(loss, inputs)


# ---------------------------------------------------------------- every variant x form vs the reference

@pytest.mark.parametrize("T", [1, 45])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forms_match_reference(variant, dtype, T):
    exact, gated = VARIANTS[variant]
    B, H, K, V = 2, 2, 8, 6
    q, k, v, beta, g, S0 = make_inputs(B, T, H, K, V, dtype, gated)
    wo, wS = torch.randn(B, T, H, V, dtype=torch.float64), torch.randn(B, H, K, V, dtype=torch.float64)
    ro, rS, rgrads = run_with_grads(lambda q, k, v, b, g, s: delta_ref(q, k, v, b, g, exact, S0=s),
                                    q, k, v, beta, g, S0, wo, wS)
    names = ["q", "k", "v", "beta", "S0", "g"]
    for mode, C in [("parallel", 64), ("recurrent", 64), ("chunk", 16), ("chunk", 32), ("chunk", 64)]:
        o, S, grads = run_with_grads(
            lambda q, k, v, b, g, s: delta_rule(q, k, v, b, g=g, exact=exact, mode=mode, chunk_size=C,
                                                initial_state=s, output_final_state=True),
            q, k, v, beta, g, S0, wo, wS)
        assert o.dtype == dtype and o.shape == (B, T, H, V)
        assert S.dtype == dtype and S.shape == (B, H, K, V)
        assert rel_err(o, ro) < TOL[dtype], (mode, C, rel_err(o, ro))
        assert rel_err(S, rS) < TOL[dtype], (mode, C, rel_err(S, rS))
        for name, a, b in zip(names, grads, rgrads):
            assert torch.isfinite(a).all(), (mode, C, name)
            assert rel_err(a, b) < TOL[dtype], (mode, C, name, rel_err(a, b))


@pytest.mark.parametrize("exact", [False, True])
def test_qk_l2norm_and_scale(exact):
    B, T, H, K, V = 1, 40, 2, 8, 8
    q, k, v, beta, g, S0 = make_inputs(B, T, H, K, V, torch.float64, gated=True, norms=(0.1, 30.0))
    wo, wS = torch.randn(B, T, H, V, dtype=torch.float64), torch.randn(B, H, K, V, dtype=torch.float64)
    ro, rS, rgrads = run_with_grads(
        lambda q, k, v, b, g, s: delta_ref(q, k, v, b, g, exact, scale=0.7, qk_l2norm=True, S0=s),
        q, k, v, beta, g, S0, wo, wS)
    for mode in MODES:
        o, S, grads = run_with_grads(
            lambda q, k, v, b, g, s: delta_rule(q, k, v, b, g=g, exact=exact, scale=0.7, qk_l2norm=True,
                                                mode=mode, chunk_size=16, initial_state=s,
                                                output_final_state=True),
            q, k, v, beta, g, S0, wo, wS)
        assert rel_err(o, ro) < 1e-10 and rel_err(S, rS) < 1e-10, mode
        for a, b in zip(grads, rgrads):
            assert rel_err(a, b) < 1e-10, mode


def test_default_scale_and_no_state():
    q, k, v, beta, _, _ = make_inputs(1, 20, 1, 16, 4, torch.float64, gated=False)
    o, S = delta_rule(q, k, v, beta)
    assert S is None
    ro, _ = delta_ref(q, k, v, beta, scale=16 ** -0.5)
    assert rel_err(o, ro) < 1e-10
    o2, _ = delta_rule(q, k, v, beta, scale=1.0)
    assert rel_err(o2, 4 * o) < 1e-12


@pytest.mark.parametrize("C", [4, 16])
def test_many_chunks(C):
    """Long enough for many chunks (the inter-chunk loop), T not a multiple of C; grads too."""
    B, T, H, K, V = 1, 301, 2, 8, 8
    q, k, v, beta, g, S0 = make_inputs(B, T, H, K, V, torch.float64, gated=True, norms=(0.2, 3.0))
    wo, wS = torch.randn(B, T, H, V, dtype=torch.float64), torch.randn(B, H, K, V, dtype=torch.float64)
    ro, rS, rgrads = run_with_grads(lambda q, k, v, b, g, s: delta_ref(q, k, v, b, g, True, S0=s),
                                    q, k, v, beta, g, S0, wo, wS)
    o, S, grads = run_with_grads(
        lambda q, k, v, b, g, s: delta_rule(q, k, v, b, g=g, exact=True, chunk_size=C, initial_state=s,
                                            output_final_state=True),
        q, k, v, beta, g, S0, wo, wS)
    assert rel_err(o, ro) < 1e-10 and rel_err(S, rS) < 1e-10
    for a, b in zip(grads, rgrads):
        assert rel_err(a, b) < 1e-10


# ---------------------------------------------------------------- EFLA: its relation to DeltaNet

def test_efla_is_deltanet_with_a():
    q, k, v, beta, g, S0 = make_inputs(2, 30, 2, 8, 8, torch.float64, gated=True, norms=(0.01, 5.0))
    a = efla_a(beta, (k * k).sum(-1))
    for mode in MODES:
        oe, Se = delta_rule(q, k, v, beta, g=g, exact=True, mode=mode, chunk_size=8, initial_state=S0,
                            output_final_state=True)
        od, Sd = delta_rule(q, k, v, a, g=g, exact=False, mode=mode, chunk_size=8, initial_state=S0,
                            output_final_state=True)
        assert rel_err(oe, od) < 1e-12 and rel_err(Se, Sd) < 1e-12, mode


def test_efla_tends_to_deltanet_for_small_keys():
    q, k, v, beta, g, _ = make_inputs(1, 30, 2, 8, 8, torch.float64, gated=False, norms=(0.5, 1.0))
    diffs = []
    for s in (1e-1, 1e-2, 1e-3):
        oe, _ = delta_rule(q, k * s, v, beta, exact=True)
        od, _ = delta_rule(q, k * s, v, beta, exact=False)
        diffs.append(rel_err(oe, od))
        assert diffs[-1] < s * s  # a = beta (1 - beta lam / 2 + ...): the gap is O(lam)
    assert diffs[0] > 10 * diffs[1] > 100 * diffs[2]
    # exactly zero keys: a = beta exactly, and finite gradients
    k0 = k * 1e-4
    k0[:, ::3] = 0
    leaves = [x.clone().requires_grad_() for x in (q, k0, v, beta)]
    oe, _ = delta_rule(*leaves, exact=True)
    od, _ = delta_rule(q, k0, v, beta, exact=False)
    assert rel_err(oe, od) < 1e-8
    oe.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)


def test_efla_saturates_for_large_keys():
    """With ||k|| large, a lambda -> 1: the step replaces the memory along k by v / ||k|| and
    leaves the orthogonal complement alone."""
    K, V = 8, 5
    S0 = torch.randn(1, 1, K, V, dtype=torch.float64)
    khat = F.normalize(torch.randn(K, dtype=torch.float64), dim=0)
    v = torch.randn(1, 1, 1, V, dtype=torch.float64)
    for mode in MODES:
        for norm in (1e2, 1e3):
            k = (khat * norm).view(1, 1, 1, K)
            _, S1 = delta_rule(torch.zeros_like(k), k, v, torch.full((1, 1, 1), 0.5, dtype=torch.float64),
                               exact=True, mode=mode, initial_state=S0, output_final_state=True)
            S1 = S1[0, 0]
            recall = khat @ S1
            assert rel_err(recall, v[0, 0, 0] / norm) < 1e-12, mode
            proj = torch.eye(K, dtype=torch.float64) - torch.outer(khat, khat)
            assert rel_err(proj @ S1, proj @ S0[0, 0]) < 1e-12, mode
    # DeltaNet with the same key overshoots instead (1 - beta lambda << -1)
    _, Sd = delta_rule(torch.zeros_like(k), k, v, torch.full((1, 1, 1), 0.5, dtype=torch.float64),
                       initial_state=S0, output_final_state=True)
    assert (khat @ Sd[0, 0]).abs().max() > 1e3 * S0.abs().max()


# ---------------------------------------------------------------- numerics

@pytest.mark.parametrize("gated", [False, True])
def test_efla_extreme_key_norms_fp32(gated):
    """Key norms log-uniform in [1e-6, 1e3] (lambda up to 1e6) in fp32: finite and accurate, every form."""
    B, T, H, K, V = 1, 80, 2, 16, 16
    q, k, v, beta, g, S0 = make_inputs(B, T, H, K, V, torch.float32, gated)
    k = F.normalize(k, dim=-1) * 10 ** torch.empty(B, T, H, 1).uniform_(-6, 3)
    k[:, 5, 0] = 0.0  # and an exactly-zero key
    wo, wS = torch.randn(B, T, H, V, dtype=torch.float64), torch.randn(B, H, K, V, dtype=torch.float64)
    ro, rS, rgrads = run_with_grads(lambda q, k, v, b, g, s: delta_ref(q, k, v, b, g, True, S0=s),
                                    q, k, v, beta, g, S0, wo, wS)
    for mode in MODES:
        o, S, grads = run_with_grads(
            lambda q, k, v, b, g, s: delta_rule(q, k, v, b, g=g, exact=True, mode=mode, chunk_size=32,
                                                initial_state=s, output_final_state=True),
            q, k, v, beta, g, S0, wo, wS)
        assert torch.isfinite(o).all() and torch.isfinite(S).all(), mode
        assert rel_err(o, ro) < 1e-5 and rel_err(S, rS) < 1e-5, (mode, rel_err(o, ro), rel_err(S, rS))
        for name, a, b in zip(["q", "k", "v", "beta", "S0", "g"], grads, rgrads):
            assert torch.isfinite(a).all(), (mode, name)
            assert rel_err(a, b) < 1e-5, (mode, name, rel_err(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unstable_deltanet_forms_agree(dtype):
    """DeltaNet with beta ||k||^2 in (2, 3.5) grows geometrically (eigenvalue 1 - beta lambda < -1);
    on short sequences every form reproduces the same growing values."""
    B, T, H, K, V = 1, 24, 2, 8, 8
    q, k, v, beta, _, S0 = make_inputs(B, T, H, K, V, dtype, gated=False)
    # keys close to one direction, so that the growth along it compounds; lambda = 4
    k = F.normalize(torch.randn(1, 1, H, K, dtype=dtype) + 0.1 * k, dim=-1) * 2.0
    beta = 0.5 + 0.375 * torch.rand(B, T, H, dtype=dtype)  # beta lambda in (2, 3.5)
    ro, rS = delta_ref(q, k, v, beta, S0=S0)
    assert ro.abs().max() > 1e3 * ro[:, :2].abs().max()  # it does blow up
    tol = {torch.float32: 2e-5, torch.float64: 1e-12}[dtype]
    for mode, C in [("parallel", 64), ("recurrent", 64), ("chunk", 8), ("chunk", 16)]:
        o, S = delta_rule(q, k, v, beta, mode=mode, chunk_size=C, initial_state=S0, output_final_state=True)
        assert rel_err(o, ro) < tol and rel_err(S, rS) < tol, (mode, C, rel_err(o, ro))


@pytest.mark.parametrize("exact,gated,l2", [(True, True, False), (False, True, True)])
def test_bf16_close_to_fp64(exact, gated, l2):
    B, T, H, K, V = 1, 512, 2, 32, 32
    q, k, v, beta, g, _ = make_inputs(B, T, H, K, V, torch.float32, gated, norms=(0.5, 3.0 if exact else 1.4))
    q, k, v, beta = (x.bfloat16() for x in (q, k, v, beta))
    ro, rS = delta_ref(q, k, v, beta, g, exact, qk_l2norm=l2)
    o, S = delta_rule(q, k, v, beta, g=g, exact=exact, qk_l2norm=l2, output_final_state=True)
    assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
    assert rel_err(o, ro) < 1e-2 and rel_err(S, rS) < 1e-2, rel_err(o, ro)
    # the recurrent form too (on a prefix, to keep the test fast)
    n = 128
    o, _ = delta_rule(q[:, :n], k[:, :n], v[:, :n], beta[:, :n], g=g[:, :n] if gated else None, exact=exact,
                      qk_l2norm=l2, mode="recurrent")
    assert o.dtype == torch.bfloat16 and rel_err(o, ro[:, :n]) < 1e-2


# ---------------------------------------------------------------- states and packed sequences

@pytest.mark.parametrize("first,rest", [("chunk", "recurrent"), ("parallel", "chunk"), ("recurrent", "parallel")])
def test_state_round_trip(first, rest):
    q, k, v, beta, g, S0 = make_inputs(2, 50, 2, 8, 6, torch.float64, gated=True)
    full, S_full = delta_rule(q, k, v, beta, g=g, exact=True, chunk_size=16, initial_state=S0,
                              output_final_state=True)
    a, S_a = delta_rule(q[:, :23], k[:, :23], v[:, :23], beta[:, :23], g=g[:, :23], exact=True, mode=first,
                        chunk_size=16, initial_state=S0, output_final_state=True)
    b, S_b = delta_rule(q[:, 23:], k[:, 23:], v[:, 23:], beta[:, 23:], g=g[:, 23:], exact=True, mode=rest,
                        chunk_size=16, initial_state=S_a, output_final_state=True)
    assert rel_err(torch.cat([a, b], dim=1), full) < 1e-12
    assert rel_err(S_b, S_full) < 1e-12


@pytest.mark.parametrize("mode", MODES)
def test_cu_seqlens_equals_separate_calls(mode):
    lens = [5, 20, 1, 12]
    T, H, K, V = sum(lens), 2, 8, 6
    q, k, v, beta, g, _ = make_inputs(1, T, H, K, V, torch.float32, gated=True)
    S0 = torch.randn(len(lens), H, K, V)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, g, S0)]
    o, S = delta_rule(*leaves[:4], g=leaves[4], exact=True, mode=mode, chunk_size=8, initial_state=leaves[5],
                      output_final_state=True, cu_seqlens=cu)
    assert S.shape == (len(lens), H, K, V)
    (o.sum() + S.sum()).backward()
    assert all(torch.isfinite(x.grad).all() for x in leaves)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        oi, Si = delta_rule(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], g=g[:, a:b], exact=True, mode=mode,
                            chunk_size=8, initial_state=S0[i:i + 1], output_final_state=True)
        assert rel_err(o[:, a:b], oi) < 1e-6 and rel_err(S[i:i + 1], Si) < 1e-6, i
    o2, S2 = delta_rule(q, k, v, beta, g=g, exact=True, mode=mode, cu_seqlens=cu)
    assert S2 is None


def test_chunk_backward_keeps_no_per_token_state():
    B, T, H, K, V, C = 1, 1024, 1, 128, 128, 64
    q, k, v, beta, g, _ = make_inputs(B, T, H, K, V, torch.float32, gated=True)
    leaves = [x.requires_grad_() for x in (q, k, v, beta, g)]
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = delta_rule(*leaves[:4], g=leaves[4], exact=True, mode="chunk", chunk_size=C)
    # a state per token alone would be T*K*V = 16.8M elements; the chunk form keeps per-token
    # vectors, C x C blocks, and per chunk one state and one K x K transition (~6M in all)
    assert sum(saved) < T * K * V / 2
    o.sum().backward()


# ---------------------------------------------------------------- property test

@settings(max_examples=20, deadline=None)
@given(B=st.integers(1, 2), T=st.integers(1, 40), H=st.integers(1, 2), K=st.integers(1, 6), V=st.integers(1, 6),
       C=st.sampled_from([1, 3, 8, 16, 64]), exact=st.booleans(), gated=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_property_chunk_matches_reference(B, T, H, K, V, C, exact, gated, seed):
    torch.manual_seed(seed)
    q, k, v, beta, g, S0 = make_inputs(B, T, H, K, V, torch.float64, gated)
    ro, rS = delta_ref(q, k, v, beta, g, exact, S0=S0)
    for mode in ("chunk", "parallel"):
        o, S = delta_rule(q, k, v, beta, g=g, exact=exact, mode=mode, chunk_size=C, initial_state=S0,
                          output_final_state=True)
        assert rel_err(o, ro) < 1e-10 and rel_err(S, rS) < 1e-10, mode


# ---------------------------------------------------------------- bad input

def test_bad_inputs():
    B, T, H, K, V = 2, 6, 2, 4, 3
    q, k, v, beta, g, S0 = make_inputs(B, T, H, K, V, torch.float32, gated=True)

    def call(**kw):
        args = dict(q=q, k=k, v=v, beta=beta)
        args.update({n: kw.pop(n) for n in list(kw) if n in args})
        return delta_rule(args["q"], args["k"], args["v"], args["beta"], **kw)

    with pytest.raises(ValueError, match="q must have shape"):
        call(q=q[0])
    with pytest.raises(ValueError, match="k must have the shape of q"):
        call(k=k[..., :3])
    with pytest.raises(ValueError, match=r"v must have shape \[B, T, H, V\]"):
        call(v=v[:, :4])
    with pytest.raises(TypeError, match="q must be float16"):
        call(q=q.long())
    with pytest.raises(TypeError, match="q, k, v must share one dtype"):
        call(v=v.double())
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\]"):
        call(beta=beta[..., None])
    with pytest.raises(ValueError, match=r"beta must have shape \[B, T, H\]"):
        call(beta=beta[:, :3])
    with pytest.raises(TypeError, match="beta must be a torch.Tensor"):
        call(beta=0.5)
    with pytest.raises(TypeError, match="beta must be float16"):
        call(beta=torch.ones(B, T, H, dtype=torch.long))
    with pytest.raises(ValueError, match="beta .* >= 0"):
        call(beta=beta - 2.0)
    with pytest.raises(ValueError, match="beta contains NaN"):
        call(beta=torch.full_like(beta, float("nan")))
    with pytest.raises(ValueError, match="g is a log-gate and must be <= 0"):
        call(g=-g + 0.1)
    with pytest.raises(ValueError, match=r"g must have shape \[B, T, H\] or \[B, T, H, 4\]"):
        call(g=g[..., None].expand(B, T, H, K + 1))
    with pytest.raises(ValueError, match="g must be finite"):
        call(g=torch.full_like(g, float("-inf")))
    with pytest.raises(ValueError, match="mode must be one of"):
        call(mode="fast")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        call(chunk_size=0)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, H, K, V\]"):
        call(initial_state=S0[:, :, :, :2])
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, H, K, V\]"):
        call(initial_state=S0[0])
    with pytest.raises(TypeError, match="initial_state must be a torch.Tensor"):
        call(initial_state=S0.numpy())
    with pytest.raises(TypeError, match="initial_state must be a floating tensor"):
        call(initial_state=S0.long())
    with pytest.raises(TypeError, match="scale must be a float"):
        call(scale="big")
    with pytest.raises(TypeError, match="exact must be a bool"):
        call(exact=1)
    with pytest.raises(ValueError, match=r"needs batch size 1 \(\[1, T_total"):
        call(cu_seqlens=torch.tensor([0, 2, T]))
    q1, k1, v1, b1, g1, _ = make_inputs(1, T, H, K, V, torch.float32, gated=True)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0 and end at T"):
        delta_rule(q1, k1, v1, b1, cu_seqlens=torch.tensor([0, 2, T + 1]))
    with pytest.raises(ValueError, match="strictly increasing"):
        delta_rule(q1, k1, v1, b1, cu_seqlens=torch.tensor([0, 2, 2, T]))
    with pytest.raises(ValueError, match=r"initial_state must have shape \[N, H, K, V\] = \(2,"):
        delta_rule(q1, k1, v1, b1, cu_seqlens=torch.tensor([0, 2, T]), initial_state=torch.zeros(1, H, K, V))


def test_exported():
    assert linattn.delta_rule is delta_rule
    assert "delta_rule" in linattn.__all__
