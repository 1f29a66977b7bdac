"""linear_attention: every feature map x form x gate against the fp64 reference, states, varlen,
numerics under hostile inputs, memory of the chunk form, and bad input."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import linattn
from linattn import FAVORPlus, LinearAttentionState, linear_attention
from linattn.feature_maps import CosFormer
from linattn.ops.reference import linear_attention_ref, rel_err

# every registered feature map (a new one is tested here without being named; see also
# tests/test_registry_conformance.py)
MAPS = list(linattn.feature_map_names())
SIGNED = {"identity", "magnitude_direction"}  # kernels whose weights can be negative
MODES = ["parallel", "chunk", "recurrent"]
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def make_map(name, K):
    if name == "favor+":
        return FAVORPlus(K, n_features=16, seed=1)
    if name == "cosformer":
        return CosFormer(max_len=64)
    return linattn.get_feature_map(name, K)   # an object: the reference reads a registered map's own kernel()


def make_inputs(B, T, H, K, V, dtype, name="elu+1", normalize=True):
    q, k = torch.randn(B, T, H, K, dtype=dtype), torch.randn(B, T, H, K, dtype=dtype)
    v = torch.randn(B, T, H, V, dtype=dtype)
    if name in SIGNED and normalize:
        # a signed kernel's normalised form is ill-conditioned where its denominator crosses 0;
        # keep the weights positive so the comparison measures the implementation
        q, k = q.abs() * 0.5, k.abs() * 0.5
    if name in ("favor+", "hadamard_exp", "taylor2"):
        q, k = q * 0.5, k * 0.5
    return q, k, v


def feature_dim(fm, K):
    x = torch.zeros(1, 1, 1, K)
    return linattn.get_feature_map(fm, K).phi(x, torch.zeros(1, 1, dtype=torch.long)).shape[-1]


def gate_for(gate, B, T, H, Kf, dtype):
    if gate is None:
        return {}, None
    if gate == "gamma":
        gam = torch.tensor([0.9, 0.6])[:H]
        return {"gamma": gam}, torch.log(gam.to(dtype)).view(1, 1, H).expand(B, T, H)
    if gate == "scalar":
        g = -torch.rand(B, T, H, dtype=dtype) * 0.5
        return {"g": g}, g
    g = -torch.rand(B, T, H, Kf, dtype=dtype) * 0.5
    return {"g": g}, g


# ---------------------------------------------------------------- forms vs the fp64 reference

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [None, "gamma", "scalar", "diagonal"])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("name", MAPS)
def test_causal_forms_match_reference(name, normalize, gate, dtype):
    B, H, K, V = 2, 2, 4, 3
    fm = make_map(name, K)
    if gate == "diagonal" and (fm.positional or type(fm).phi is not type(fm).psi):
        pytest.skip("the diagonal-gate reference computes per-feature decays from phi = psi without positions")
    Kf = feature_dim(fm, K)
    for T in (1, 37):
        q, k, v = make_inputs(B, T, H, K, V, dtype, name, normalize)
        kw, log_gate = gate_for(gate, B, T, H, Kf, dtype)
        ref = linear_attention_ref(q, k, v, name, normalize=normalize, log_gate=log_gate, fmap=fm)
        for mode in MODES:
            for cs in ((5, 16, 64) if mode == "chunk" else (64,)):
                o, _ = linear_attention(q, k, v, feature_map=fm, normalize=normalize, mode=mode, chunk_size=cs, **kw)
                assert o.dtype == dtype and o.shape == (B, T, H, V)
                err = rel_err(o, ref)
                assert err <= TOL[dtype], f"{name} {mode} cs={cs} T={T}: rel err {err:.2e}"


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("name", MAPS)
def test_bidirectional_forms_match_reference(name, normalize):
    B, T, H, K, V = 2, 29, 2, 4, 3
    fm = make_map(name, K)
    for dtype in (torch.float32, torch.float64):
        q, k, v = make_inputs(B, T, H, K, V, dtype, name, normalize)
        ref = linear_attention_ref(q, k, v, name, causal=False, normalize=normalize, fmap=fm)
        for mode in ("parallel", "chunk"):
            o, _ = linear_attention(q, k, v, feature_map=fm, causal=False, normalize=normalize, mode=mode)
            assert rel_err(o, ref) <= TOL[dtype], (mode, dtype)


def test_scale_and_feature_map_none():
    q, k, v = make_inputs(1, 20, 2, 4, 3, torch.float64)
    ref = linear_attention_ref(q, k, v, "elu+1", scale=0.3)
    o, _ = linear_attention(q, k, v, scale=0.3)
    assert rel_err(o, ref) < 1e-10
    o2, _ = linear_attention(q.abs(), k.abs(), v, feature_map=None)  # q, k already features
    assert rel_err(o2, linear_attention_ref(q.abs(), k.abs(), v, "identity")) < 1e-10


def test_custom_asymmetric_feature_map():
    # ELA eq. (6): k(a, b) = a1 b2 + 2 a2 b1, not symmetric
    fm = linattn.FeatureMap(phi=lambda a: torch.stack([a[..., 0], 2 * a[..., 1]], -1),
                            psi=lambda b: torch.stack([b[..., 1], b[..., 0]], -1))
    q, k, v = torch.randn(1, 9, 1, 2, dtype=torch.float64), torch.randn(1, 9, 1, 2, dtype=torch.float64), \
        torch.randn(1, 9, 1, 3, dtype=torch.float64)
    W = (q[0, :, 0, 0:1] * k[0, :, 0, 1][None] + 2 * q[0, :, 0, 1:2] * k[0, :, 0, 0][None]).tril()
    for mode in MODES:
        o, _ = linear_attention(q, k, v, feature_map=fm, normalize=False, mode=mode, chunk_size=4)
        assert rel_err(o[0, :, 0], W @ v[0, :, 0]) < 1e-12


def test_low_precision_dtypes():
    q, k, v = make_inputs(1, 100, 2, 8, 8, torch.float32)
    ref = linear_attention_ref(q, k, v, "elu+1")
    for dt in (torch.bfloat16, torch.float16):
        o, st_ = linear_attention(q.to(dt), k.to(dt), v.to(dt), output_final_state=True)
        assert o.dtype == dt and st_.kv.dtype == torch.float32
        assert rel_err(o, ref) < 1e-2


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("gate", [None, "scalar", "diagonal"])
@pytest.mark.parametrize("name", ["elu+1", "hadamard_exp", "favor+", "sum_sq_euclid", "relu"])
def test_gradients_match_reference(name, gate):
    B, T, H, K, V = 1, 19, 2, 4, 3
    fm = make_map(name, K)
    if gate == "diagonal" and name == "sum_sq_euclid":
        pytest.skip("diagonal-gate reference written per feature for elementwise maps only")
    Kf = feature_dim(fm, K)
    q0, k0, v0 = make_inputs(B, T, H, K, V, torch.float64, name)
    kw0, lg0 = gate_for(gate, B, T, H, Kf, torch.float64)
    do = torch.randn(B, T, H, V, dtype=torch.float64)

    def grads(fn, dtype):
        q, k, v = (x.detach().clone().to(dtype).requires_grad_() for x in (q0, k0, v0))
        g = lg0.detach().clone().to(dtype).requires_grad_() if lg0 is not None else None
        (fn(q, k, v, g) * do.to(dtype)).sum().backward()
        return [x.grad for x in (q, k, v, g) if x is not None]

    ref = grads(lambda q, k, v, g: linear_attention_ref(q, k, v, name, log_gate=g, fmap=fm), torch.float64)
    for mode in MODES:
        for dtype in (torch.float64, torch.float32):
            got = grads(lambda q, k, v, g: linear_attention(q, k, v, feature_map=fm, g=g, mode=mode,
                                                            chunk_size=8)[0], dtype)
            for r, x, nm in zip(ref, got, "qkvg"):
                assert rel_err(x, r) <= TOL[dtype], f"d{nm} {mode} {dtype}: {rel_err(x, r):.2e}"


def test_gradient_of_initial_state():
    q, k, v = make_inputs(1, 12, 2, 4, 3, torch.float64)
    _, s = linear_attention(q, k, v, output_final_state=True)
    grads = []
    for mode in MODES:
        kv = s.kv.clone().requires_grad_()
        z = s.z.clone().requires_grad_()
        st_ = LinearAttentionState(kv, z, None, s.offset)
        o, _ = linear_attention(q, k, v, initial_state=st_, mode=mode, chunk_size=5)
        o.pow(2).sum().backward()
        grads.append((kv.grad, z.grad))
    for kvg, zg in grads[1:]:
        assert rel_err(kvg, grads[0][0]) < 1e-10 and rel_err(zg, grads[0][1]) < 1e-10


# ---------------------------------------------------------------- state, varlen

@pytest.mark.parametrize("name", ["elu+1", "hadamard_exp", "cosformer", "favor+"])
@pytest.mark.parametrize("gate", [None, "scalar", "diagonal"])
def test_state_round_trip_between_modes(name, gate):
    if gate == "diagonal" and name == "cosformer":
        pytest.skip("covered by the other maps")
    B, T, H, K, V = 2, 50, 2, 4, 3
    fm = make_map(name, K)
    Kf = feature_dim(fm, K)
    q, k, v = make_inputs(B, T, H, K, V, torch.float64, name)
    kw, _ = gate_for(gate, B, T, H, Kf, torch.float64)
    full, s_full = linear_attention(q, k, v, feature_map=fm, output_final_state=True, **kw)
    cut = 23
    kw1 = {n: (x[:, :cut] if n == "g" else x) for n, x in kw.items()}
    kw2 = {n: (x[:, cut:] if n == "g" else x) for n, x in kw.items()}
    for m1, m2 in [("chunk", "recurrent"), ("recurrent", "chunk"), ("parallel", "chunk"), ("chunk", "parallel")]:
        o1, s1 = linear_attention(q[:, :cut], k[:, :cut], v[:, :cut], feature_map=fm, mode=m1,
                                  output_final_state=True, chunk_size=8, **kw1)
        o2, s2 = linear_attention(q[:, cut:], k[:, cut:], v[:, cut:], feature_map=fm, mode=m2,
                                  initial_state=s1, output_final_state=True, chunk_size=8, **kw2)
        assert rel_err(torch.cat([o1, o2], 1), full) < 1e-10, (m1, m2)
        assert rel_err(s2.kv * (s2.log_scale.exp().unsqueeze(-1) if s2.log_scale is not None else 1),
                       s_full.kv * (s_full.log_scale.exp().unsqueeze(-1) if s_full.log_scale is not None else 1)
                       ) < 1e-10
        assert s2.offset.tolist() == [T] * B


def test_token_by_token_decoding_equals_one_call():
    q, k, v = make_inputs(1, 30, 2, 4, 3, torch.float64, "hadamard_exp")
    g = -torch.rand(1, 30, 2, dtype=torch.float64)
    full, _ = linear_attention(q, k, v, feature_map="hadamard_exp", g=g)
    s, outs = None, []
    for t in range(30):
        o, s = linear_attention(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], feature_map="hadamard_exp",
                                g=g[:, t:t + 1], mode="recurrent", initial_state=s, output_final_state=True)
        outs.append(o)
    assert rel_err(torch.cat(outs, 1), full) < 1e-10


@pytest.mark.parametrize("name", ["elu+1", "hadamard_exp", "cosformer"])
@pytest.mark.parametrize("mode", MODES)
def test_cu_seqlens_equals_separate_calls(name, mode):
    H, K, V = 2, 4, 3
    fm = make_map(name, K)
    lens = [5, 17, 1, 30]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int64)
    T = sum(lens)
    q, k, v = make_inputs(1, T, H, K, V, torch.float64, name)
    g = -torch.rand(1, T, H, dtype=torch.float64)
    # a non-trivial initial state per sequence
    _, s0 = linear_attention(*make_inputs(len(lens), 7, H, K, V, torch.float64, name), feature_map=fm,
                             output_final_state=True)
    o, s = linear_attention(q, k, v, feature_map=fm, g=g, mode=mode, chunk_size=8, cu_seqlens=cu,
                            initial_state=s0, output_final_state=True)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        s0_i = LinearAttentionState(*(x[i:i + 1] if x is not None else None for x in s0))
        o_i, s_i = linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], feature_map=fm, g=g[:, a:b], mode=mode,
                                    chunk_size=8, initial_state=s0_i, output_final_state=True)
        assert rel_err(o[:, a:b], o_i) < 1e-12
        assert rel_err(s.kv[i:i + 1], s_i.kv) < 1e-12 and s.offset[i] == s_i.offset[0]


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 70), chunk=st.integers(1, 40), H=st.integers(1, 3), K=st.integers(1, 6),
       V=st.integers(1, 5), name=st.sampled_from(["elu+1", "hadamard_exp", "relu", "sum_sq_euclid"]),
       gated=st.booleans())
def test_property_chunk_equals_parallel(T, chunk, H, K, V, name, gated):
    q, k, v = make_inputs(1, T, H, K, V, torch.float64, name)
    g = -torch.rand(1, T, H, dtype=torch.float64) if gated else None
    ref, _ = linear_attention(q, k, v, feature_map=name, g=g, mode="parallel")
    o, _ = linear_attention(q, k, v, feature_map=name, g=g, mode="chunk", chunk_size=chunk)
    assert rel_err(o, ref) < 1e-10


# ---------------------------------------------------------------- hostile inputs

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("normalize", [True, False])
def test_hadamard_exp_extreme_inputs(mode, normalize):
    """Entries up to +-80 (exp(160) overflows fp32): still finite and equal to the formula."""
    B, T, H, K, V = 1, 40, 2, 4, 3
    q = (torch.rand(B, T, H, K) * 160 - 80)
    k = (torch.rand(B, T, H, K) * 160 - 80)
    v = torch.randn(B, T, H, V)
    if not normalize:  # the plain sum of exp(160) weights is itself beyond fp32: scale values down
        v = v * 1e-35
    ref = linear_attention_ref(q, k, v, "hadamard_exp", normalize=normalize)
    o, _ = linear_attention(q, k, v, feature_map="hadamard_exp", normalize=normalize, mode=mode, chunk_size=16)
    assert torch.isfinite(o).all()
    # log-weights near 160 carry an fp32 rounding of ~160 * 2**-24 = 1e-5 in their exponent
    assert rel_err(o, ref) < 5e-5


@pytest.mark.parametrize("name", ["hadamard_exp", "favor+"])
@pytest.mark.parametrize("mode", MODES)
def test_tiny_then_huge_keys(name, mode):
    """Early keys at -80, later at +80: early queries must still see their (tiny) keys."""
    B, T, H, K, V = 1, 48, 1, 4, 2
    q = torch.randn(B, T, H, K)
    k = torch.randn(B, T, H, K)
    k[:, :21] -= 80 if name == "hadamard_exp" else 0
    if name == "favor+":  # make the log-features of early keys tiny and of late keys huge
        k[:, :21] *= 0.01
        k[:, 21:] *= 6
    else:
        k[:, 21:] += 80
    v = torch.randn(B, T, H, V)
    fm = make_map(name, K)
    o, _ = linear_attention(q, k, v, feature_map=fm, mode=mode, chunk_size=16)
    ref = linear_attention_ref(q, k, v, name, fmap=fm)
    assert torch.isfinite(o).all()
    assert rel_err(o[:, :21], ref[:, :21]) < 1e-4 and rel_err(o, ref) < 1e-4


def test_fp64_extreme_inputs_are_exact():
    q = torch.rand(1, 33, 1, 4, dtype=torch.float64) * 160 - 80
    k = torch.rand(1, 33, 1, 4, dtype=torch.float64) * 160 - 80
    v = torch.randn(1, 33, 1, 2, dtype=torch.float64)
    ref = linear_attention_ref(q, k, v, "hadamard_exp")
    for mode in MODES:
        o, _ = linear_attention(q, k, v, feature_map="hadamard_exp", mode=mode, chunk_size=8)
        assert rel_err(o, ref) < 1e-10


def test_vanishing_normaliser_is_finite():
    # relu features: the first keys are all inactive, so early denominators are exactly 0
    q = torch.randn(1, 20, 1, 4).abs()
    k = -torch.rand(1, 20, 1, 4)
    k[:, 10:] = k[:, 10:].abs()
    v = torch.randn(1, 20, 1, 3)
    for mode in MODES:
        o, _ = linear_attention(q, k, v, feature_map="relu", mode=mode)
        assert torch.isfinite(o).all()
        assert (o[:, :10] == 0).all()  # no active key yet: output 0, not NaN
        assert rel_err(o, linear_attention_ref(q, k, v, "relu")) < 1e-5


def test_magnitude_direction_negative_weights_never_nan():
    # a.b < -1 gives negative weights; denominators may cross 0 but outputs stay finite
    q = torch.randn(1, 64, 2, 4) * 3
    k = -q.roll(1, 1) + 0.1 * torch.randn(1, 64, 2, 4)
    v = torch.randn(1, 64, 2, 3)
    for mode in MODES:
        for normalize in (True, False):
            o, _ = linear_attention(q, k, v, feature_map="magnitude_direction", normalize=normalize, mode=mode)
            assert torch.isfinite(o).all()


def test_strong_gates_do_not_overflow():
    # decays of exp(-30) per token: cumulative gates reach -1e4 inside a chunk
    q, k, v = make_inputs(1, 100, 2, 4, 3, torch.float32)
    for shape in [(1, 100, 2), (1, 100, 2, 4)]:
        g = -30 * torch.rand(*shape)
        ref = linear_attention_ref(q, k, v, "elu+1", log_gate=g)
        for mode in MODES:
            o, _ = linear_attention(q, k, v, g=g, mode=mode, chunk_size=64)
            assert torch.isfinite(o).all() and rel_err(o, ref) < 1e-5, (shape, mode)


# ---------------------------------------------------------------- memory of the chunk form

def test_chunk_backward_keeps_no_per_token_state():
    B, T, H, K, V, C = 1, 1024, 1, 64, 64, 64
    q, k, v = (torch.randn(B, T, H, d, requires_grad=True) for d in (K, K, V))
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, _ = linear_attention(q, k, v, mode="chunk", chunk_size=C)
    # a cumulative-sum implementation saves T*K*V = 1M elements; the chunk form keeps
    # per-token vectors, the T x C intra-chunk weights and one state per chunk
    budget = 6 * T * (K + V + C) + 4 * (T // C) * K * (V + 1)
    assert sum(saved) < budget < T * K * V
    o.sum().backward()


# ---------------------------------------------------------------- FAVOR+

def test_favor_plus_random_features():
    fm = FAVORPlus(8, n_features=16, seed=3)
    fm2 = FAVORPlus(8, n_features=16, seed=3)
    assert torch.equal(fm.projection, fm2.projection)
    w = fm.projection.double()
    block = w[:8] / w[:8].norm(dim=1, keepdim=True)
    assert torch.allclose(block @ block.T, torch.eye(8, dtype=torch.float64), atol=1e-5)  # orthogonal rows
    old = fm.projection.clone()
    fm.redraw()
    assert not torch.equal(old, fm.projection)
    # unbiased estimate of exp(a.b): average many independent draws
    a, b = torch.randn(8) * 0.3, torch.randn(8) * 0.3
    big = FAVORPlus(8, n_features=20000, seed=0)
    est = (big(a) * big(b)).sum()
    assert abs(est.item() / math.exp(a @ b) - 1) < 0.05


# ---------------------------------------------------------------- bad input

def _qkv(B=1, T=8, H=2, K=4, V=3):
    return torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)


@pytest.mark.parametrize("case,exc,match", [
    (lambda q, k, v: linear_attention(q[0], k[0], v[0]), ValueError, "q must have shape"),
    (lambda q, k, v: linear_attention(q, k[:, :5], v), ValueError, "k must have the shape"),
    (lambda q, k, v: linear_attention(q, k, v[:, :, :1]), ValueError, "v must have shape"),
    (lambda q, k, v: linear_attention(q, k[..., :3], v), ValueError, "k must have the shape"),
    (lambda q, k, v: linear_attention(q.long(), k, v), TypeError, "q must be"),
    (lambda q, k, v: linear_attention(q, k, v.double()), TypeError, "share one dtype"),
    (lambda q, k, v: linear_attention(q.tolist(), k, v), TypeError, "q must be a torch.Tensor"),
    (lambda q, k, v: linear_attention(q, k, v, feature_map="softmax"), ValueError, "unknown feature_map"),
    (lambda q, k, v: linear_attention(q, k, v, mode="fast"), ValueError, "mode must be"),
    (lambda q, k, v: linear_attention(q, k, v, chunk_size=0), ValueError, "chunk_size"),
    (lambda q, k, v: linear_attention(q, k, v, causal=False, mode="recurrent"), ValueError, "recurrent"),
    (lambda q, k, v: linear_attention(q, k, v, causal=False, gamma=0.9), ValueError, "causal"),
    (lambda q, k, v: linear_attention(q, k, v, gamma=1.5), ValueError, "gamma"),
    (lambda q, k, v: linear_attention(q, k, v, gamma=torch.ones(3)), ValueError, r"\[H\]"),
    (lambda q, k, v: linear_attention(q, k, v, g=torch.zeros(1, 8, 3)), ValueError, r"g must have shape"),
    (lambda q, k, v: linear_attention(q, k, v, g=torch.zeros(1, 8, 2, 5)), ValueError, r"g must have shape"),
    (lambda q, k, v: linear_attention(q, k, v, g=torch.full((1, 8, 2), 0.1)), ValueError, "<= 0"),
    (lambda q, k, v: linear_attention(q, k, v, g=torch.zeros(1, 8, 2), gamma=0.5), ValueError, "not both"),
    (lambda q, k, v: linear_attention(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1),
                                      cu_seqlens=torch.tensor([0, 8])), ValueError, "needs batch size 1"),
    (lambda q, k, v: linear_attention(q, k, v, cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError, "increasing"),
    (lambda q, k, v: linear_attention(q, k, v, cu_seqlens=torch.tensor([0, 5, 7])), ValueError, "end at T"),
    (lambda q, k, v: linear_attention(q, k, v, cu_seqlens=torch.tensor([0., 8.])), ValueError, "integer"),
    (lambda q, k, v: linear_attention(q, k, v, initial_state=torch.zeros(1, 2, 4, 3)), TypeError,
     "LinearAttentionState"),
    (lambda q, k, v: linear_attention(q, k, v, initial_state=LinearAttentionState(
        torch.zeros(1, 2, 5, 3), torch.zeros(1, 2, 5), None, torch.zeros(1, dtype=torch.long))), ValueError,
     "kv must have shape"),
    (lambda q, k, v: linear_attention(q, k, v, eps=-1.0), ValueError, "eps"),
    (lambda q, k, v: linear_attention(q, k, v, feature_map=FAVORPlus(5)), ValueError, "dim 5"),
    (lambda q, k, v: linear_attention(q, k, v, feature_map=3), TypeError, "feature_map"),
])
def test_bad_input(case, exc, match):
    with pytest.raises(exc, match=match):
        case(*_qkv())


@pytest.mark.parametrize("name", ["hadamard_exp", "favor+"])
@pytest.mark.parametrize("gated", [False, True])
def test_log_space_matmul_path_equals_block_path(name, gated, monkeypatch):
    """Moderate inputs take the shifted matmul path; forcing the exact block path must agree."""
    import linattn.ops.linear_chunk_log as lin
    B, T, H, K, V = 2, 70, 2, 4, 3
    fm = make_map(name, K)
    q, k, v = make_inputs(B, T, H, K, V, torch.float64, name)
    g = -torch.rand(B, T, H, dtype=torch.float64) if gated else None
    _, s0 = linear_attention(q, k, v, feature_map=fm, output_final_state=True)
    calls = []
    real = lin._chunk_shifted
    monkeypatch.setattr(lin, "_chunk_shifted", lambda *a: calls.append(1) or real(*a))
    kw = dict(feature_map=fm, g=g, initial_state=s0, output_final_state=True, chunk_size=16, backend="torch")
    o1, s1 = linear_attention(q, k, v, **kw)
    assert calls, "moderate inputs should take the matmul path"
    monkeypatch.setattr(lin, "SAFE_SPAN", 0.0)
    o2, s2 = linear_attention(q, k, v, **kw)
    assert len(calls) == 1
    assert rel_err(o1, o2) < 1e-12
    true1 = s1.kv * s1.log_scale.exp().unsqueeze(-1)
    true2 = s2.kv * s2.log_scale.exp().unsqueeze(-1)
    assert rel_err(true1, true2) < 1e-12
