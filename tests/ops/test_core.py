"""Core v2 of the operators: the prepared path, the delta family's general scan (per-channel gates, a
read key of its own) against its fp64 reference, no host reads of tensor values in the default CUDA
path, torch.compile(fullgraph=True), shift invariance of the exp kernels, and the chunk size used."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import linattn
from linattn.ops.delta_core import efla_coefficient, prepare_delta, run_delta
from linattn.ops.reference import delta_scan_ref, linear_attention_ref, rel_err

MODES = ["parallel", "chunk", "recurrent"]


# ---------------------------------------------------------------- the general delta scan

def _scan_inputs(B, T, H, K, V, dtype, gate, read_key, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1) * 1.2
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    g = None
    if gate == "head":
        g = -torch.rand(B, T, H, generator=gen, dtype=dtype) * 0.5
    elif gate == "channel":
        g = -torch.rand(B, T, H, K, generator=gen, dtype=dtype) * 0.5
    r = (F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=dtype), dim=-1) * 0.8) if read_key else None
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=dtype) * 0.3
    return q, k, v, beta, g, r, S0


def _scan(q, k, v, beta, g, r, S0, mode, chunk_size=16, exact=False):
    p = prepare_delta(q, k, v, beta, g=g, r=r, channel_gate=True, mode=mode, chunk_size=chunk_size,
                      coefficient=efla_coefficient if exact else None, initial_state=S0, output_final_state=True)
    return run_delta(p, backend="torch")


def _scan_ref(q, k, v, beta, g, r, S0, exact=False):
    K = q.shape[-1]
    a = beta.double()
    if exact:
        lam = (k.double() ** 2).sum(-1)
        a = torch.where(lam > 0, -torch.expm1(-a * lam) / lam.clamp_min(1e-300), a)
    return delta_scan_ref(q, k, v, a, r=r, g=g, scale=K ** -0.5, S0=S0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gate,read_key", [("channel", False), ("channel", True), ("head", True), (None, True)])
@pytest.mark.parametrize("T", [1, 37])
def test_general_scan_matches_reference(mode, gate, read_key, T):
    """Kimi Delta Attention (per-channel gates) and a separate read key (Comba's form), fp64, every form,
    T = 1 and T not a multiple of the chunk size, with an initial state."""
    args = _scan_inputs(2, T, 2, 6, 5, torch.float64, gate, read_key)
    o, S = _scan(*args, mode)
    o_ref, S_ref = _scan_ref(*args)
    assert rel_err(o, o_ref) < 1e-10 and rel_err(S, S_ref) < 1e-10


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gate,read_key,exact", [("channel", False, False), ("channel", True, False),
                                                 ("head", True, True)])
def test_general_scan_fp32_and_gradients(mode, gate, read_key, exact):
    """fp32 forms against fp64: outputs, states and the gradients of every input."""
    args64 = _scan_inputs(1, 29, 2, 8, 4, torch.float64, gate, read_key, seed=3)
    leaves = [x.float().requires_grad_(True) if x is not None else None for x in args64]
    o, S = _scan(*leaves, mode, exact=exact)
    leaves64 = [x.clone().requires_grad_(True) if x is not None else None for x in args64]
    o_ref, S_ref = _scan_ref(*leaves64, exact=exact)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5
    gen = torch.Generator().manual_seed(1)
    wo, wS = torch.randn(o.shape, generator=gen, dtype=torch.float64), torch.randn(S.shape, generator=gen,
                                                                                 dtype=torch.float64)
    live = [x for x in leaves if x is not None]
    live64 = [x for x in leaves64 if x is not None]
    g32 = torch.autograd.grad((o.double() * wo).sum() + (S.double() * wS).sum(), live)
    g64 = torch.autograd.grad((o_ref * wo).sum() + (S_ref * wS).sum(), live64)
    for a, b in zip(g32, g64):
        assert rel_err(a, b) < 1e-4


def test_kda_through_delta_rule_and_strong_channel_gates():
    """delta_rule with g [B, T, H, K] is Kimi Delta Attention; log-gates of -30 per token stay exact."""
    q, k, v, beta, _, _, S0 = _scan_inputs(1, 40, 2, 8, 4, torch.float64, None, False)
    g = -30 * torch.rand(1, 40, 2, 8, dtype=torch.float64)
    ref, S_ref = _scan_ref(q, k, v, beta, g, None, S0)
    for mode in MODES:
        o, S = linattn.delta_rule(q, k, v, beta, g=g, mode=mode, chunk_size=16, initial_state=S0,
                                  output_final_state=True)
        assert torch.isfinite(o).all() and rel_err(o, ref) < 1e-10 and rel_err(S, S_ref) < 1e-10


def test_rescaling_is_per_token_and_exact():
    """Keys of norm 1e3 next to keys of norm 1e-3: every form agrees with the reference (the rescaling is
    one rule for all tokens, no branch on the values)."""
    q, k, v, beta, g, _, S0 = _scan_inputs(1, 24, 1, 8, 4, torch.float64, "head", False)
    k = k * torch.where(torch.arange(24) % 2 == 0, 1e3, 1e-3).view(1, 24, 1, 1)
    ref, _ = _scan_ref(q, k, v, beta, g, None, S0, exact=True)
    for mode in MODES:
        o, _ = linattn.delta_rule(q, k, v, beta, g=g, exact=True, mode=mode, chunk_size=8, initial_state=S0)
        assert rel_err(o, ref) < 1e-10


# ---------------------------------------------------------------- numerics fix: shift invariance

@pytest.mark.parametrize("name", ["hadamard_exp", "favor+"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shift", [-40.0, 40.0])
def test_normalised_exp_kernels_are_shift_invariant(name, mode, shift):
    """Adding a constant to every query entry multiplies every kernel value by one factor: the normalised
    output must not change (it used to collapse to ~0 when q + k ~ -60, eps flooring the true denominator)."""
    B, T, H, K, V = 1, 21, 2, 4, 3
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    if name == "favor+":  # FAVOR+ is shift-invariant in the projected features: shift along w's direction
        fm = linattn.FAVORPlus(K, seed=0)
        q_shifted = q  # its log-features move by w.q: instead shift the keys' norm term below
        o0, _ = linattn.linear_attention(q, k, v, feature_map=fm, mode=mode, chunk_size=8)
        o1, _ = linattn.linear_attention(q_shifted * (1 + shift / 400), k, v, feature_map=fm, mode=mode,
                                         chunk_size=8)
        ref = linear_attention_ref(q_shifted * (1 + shift / 400), k, v, name, fmap=fm)
        assert rel_err(o1, ref) < 1e-5 and torch.isfinite(o0).all()
        return
    o0, _ = linattn.linear_attention(q, k, v, feature_map=name, mode=mode, chunk_size=8)
    o1, _ = linattn.linear_attention(q + shift, k, v, feature_map=name, mode=mode, chunk_size=8)
    assert rel_err(o1, o0) < 1e-5
    # and with the keys shifted too: q + k ~ -80 or +80
    o2, _ = linattn.linear_attention(q + shift, k + shift, v, feature_map=name, mode=mode, chunk_size=8)
    assert rel_err(o2, o0) < 1e-5


# ---------------------------------------------------------------- host reads and torch.compile

HOST_READS = ("item", "__bool__", "tolist", "__int__", "__float__", "__index__", "nonzero")


class CountHostReads(TorchFunctionMode):
    """Counts the tensor methods that read values on the host (a device-to-host sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def checks_as_on_cuda():
    """The default for CUDA tensors: no value checks."""
    previous = linattn.set_checks("shapes")
    yield
    linattn.set_checks(previous)


def test_no_host_reads_in_a_decoded_token(checks_as_on_cuda):
    """A decoded token of a Gated DeltaNet layer, and one-token calls of both operators, read no value on the
    host (the first version read five per Gated DeltaNet token)."""
    from linattn.layers import GatedDeltaNet, LayerCache
    torch.manual_seed(0)
    layer = GatedDeltaNet(32, 2).eval()
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        cache = LayerCache()
        layer(x[:, :5], cache=cache)
        with CountHostReads() as c:
            layer(x[:, 5:], cache=cache)
            q = torch.randn(1, 1, 2, 8)
            _, s = linattn.delta_rule(q, q, q, torch.rand(1, 1, 2), g=-torch.rand(1, 1, 2), mode="recurrent",
                                      output_final_state=True)
            linattn.linear_attention(q, q, q, g=-torch.rand(1, 1, 2), mode="recurrent", output_final_state=True)
            linattn.linear_attention(q, q, q, mode="chunk", gamma=0.9)
    assert c.calls == []


def test_value_checks_follow_set_checks():
    q = torch.randn(1, 4, 1, 8)
    bad_beta = -torch.ones(1, 4, 1)
    assert linattn.get_checks() == "auto"
    with pytest.raises(linattn.LinattnError, match="beta is a step size"):
        linattn.delta_rule(q, q, q, bad_beta)
    previous = linattn.set_checks("shapes")
    try:
        linattn.delta_rule(q, q, q, bad_beta)  # not read: no check, no sync
        with pytest.raises(linattn.LinattnError, match="beta must have shape"):  # shapes always checked
            linattn.delta_rule(q, q, q, bad_beta[:, :3])
    finally:
        linattn.set_checks(previous)
    with pytest.raises(linattn.LinattnError, match="checks level"):
        linattn.set_checks("some")


def _compiled_matches(fn, *args, backend="aot_eager"):
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    got, want = compiled(*args), fn(*args)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gate", [None, "gamma", "g"])
def test_compile_linear_chunk(gate):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 40, 2, 8, generator=gen) for _ in range(3))
    g = -torch.rand(2, 40, 2, generator=gen)

    def fn(q, k, v, g):
        kw = {"gamma": 0.9} if gate == "gamma" else ({"g": g} if gate == "g" else {})
        o, s = linattn.linear_attention(q, k, v, feature_map="elu+1", mode="chunk", chunk_size=16,
                                        output_final_state=True, **kw)
        return o, s.kv, s.z

    _compiled_matches(fn, q, k, v, g)


@pytest.mark.parametrize("variant", ["deltanet", "gated", "efla", "kda"])
def test_compile_delta_chunk(variant):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 2, 8, generator=gen) for _ in range(3))
    beta, g = torch.rand(1, 40, 2, generator=gen), -torch.rand(1, 40, 2, generator=gen)
    if variant == "kda":  # per-channel gates: the sub-block scores' own autograd.Function inside the graph
        g = -torch.rand(1, 40, 2, 8, generator=gen)

    def fn(q, k, v, beta, g):
        return linattn.delta_rule(q, k, v, beta, g=g if variant in ("gated", "kda") else None,
                                  exact=variant == "efla", qk_l2norm=True, mode="chunk", chunk_size=16,
                                  output_final_state=True)

    _compiled_matches(fn, q, k, v, beta, g)
    if variant == "kda":  # and its backward through the compiled graph
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
        grads = []
        for f in (compiled, fn):
            gl = g.clone().requires_grad_()
            f(q, k, v, beta, gl)[0].square().sum().backward()
            grads.append(gl.grad)
        assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_compile_one_token_decoding():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2, 8, generator=gen) for _ in range(3))
    beta, g = torch.rand(1, 1, 2, generator=gen), -torch.rand(1, 1, 2, generator=gen)
    S = torch.randn(1, 2, 8, 8, generator=gen)
    st = linattn.linear_attention(torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8),
                                  output_final_state=True)[1]

    def delta_step(q, k, v, beta, g, S):
        return linattn.delta_rule(q, k, v, beta, g=g, qk_l2norm=True, mode="recurrent", initial_state=S,
                                  output_final_state=True)

    def linear_step(q, k, v, g, kv, z, offset):
        o, s = linattn.linear_attention(q, k, v, g=g, mode="recurrent", output_final_state=True,
                                        initial_state=linattn.LinearAttentionState(kv, z, None, offset))
        return o, s.kv, s.z

    _compiled_matches(delta_step, q, k, v, beta, g, S)
    _compiled_matches(linear_step, q, k, v, g, st.kv, st.z, st.offset)


def test_compile_inductor_linear_chunk():
    """One real (inductor, C++) compilation: the default torch.compile backend."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 32, 2, 8, generator=gen) for _ in range(3))

    def fn(q, k, v):
        return linattn.linear_attention(q, k, v, gamma=0.9, mode="chunk", chunk_size=16)[:1]

    _compiled_matches(fn, q, k, v, backend="inductor")


# ---------------------------------------------------------------- chunk size actually used

def test_chunk_size_used():
    q = torch.randn(1, 100, 2, 8)
    assert linattn.chunk_size_used("linear_attention", q, q, q, chunk_size=48) == 48
    assert linattn.chunk_size_used("linear_attention", q, q, q, feature_map="hadamard_exp", chunk_size=48) == 16
    assert linattn.chunk_size_used("linear_attention", q, q, q, g=-torch.ones(1, 100, 2, 8), chunk_size=48) == 16
    assert linattn.chunk_size_used("linear_attention", q, q, q, mode="recurrent") == 1
    assert linattn.chunk_size_used("linear_attention", q, q, q, mode="parallel") == 100
    beta = torch.rand(1, 100, 2)
    assert linattn.chunk_size_used("delta_rule", q, q, q, beta, chunk_size=48, backend="torch") == 48
    assert linattn.chunk_size_used("delta_rule", q, q, q, beta, g=-torch.ones(1, 100, 2, 8), chunk_size=48,
                                   backend="torch") == 16
    assert linattn.chunk_size_used("delta_rule", q, q, q, beta, chunk_size=48, backend="cpu") == 1  # token by token
    p = linattn.prepare_linear_attention(q, q, q, chunk_size=48)
    assert p.chunk_size_used("triton") == 64  # the kernels' tiles are 16, 32 or 64
    with pytest.raises(linattn.LinattnError, match="op must be"):
        linattn.chunk_size_used("softmax", q, q, q)


def test_feature_maps_know_their_capabilities():
    K = 8
    for name in linattn.FEATURE_MAP_NAMES:
        fm = linattn.get_feature_map(name, K)
        x = torch.randn(1, 3, 1, K)
        pos = torch.arange(3).view(1, 3)
        assert fm.phi(x, pos).shape[-1] == fm.feature_dim(K), name
        assert fm.log_space == (name in ("hadamard_exp", "favor+"))
        assert (fm.fused_kernel is not None) == (name in ("identity", "elu+1", "relu"))
    custom = linattn.FeatureMap(phi=lambda x: torch.cat([x, x * x], -1))
    assert custom.feature_dim(5) == 10 and custom.fused_kernel is None and not custom.log_space
    assert math.isclose(linattn.linear_attention(torch.ones(1, 2, 1, 5), torch.ones(1, 2, 1, 5),
                                                 torch.ones(1, 2, 1, 3), feature_map=custom)[0][0, 0, 0, 0].item(), 1.0)
