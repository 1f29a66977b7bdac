"""Operator conventions of the models people download (issue 35 point 1) and the overflow / precision
points of issue 33 (4, 7): the qk L2 normalisation, grouped value heads, the gated output norm, dtypes."""
import json

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import checkpoint as ck
from linattn.errors import ConfigError, LinattnError
from linattn.models import LMConfig
from linattn.ops.l2norm import l2norm
from linattn.ops.reference import delta_rule_ref, rel_err
from tests.helpers import FIXTURES

LEGACY = FIXTURES / "legacy_l2norm"


def _inputs(B=1, T=9, H=2, K=8, V=4, seed=0, dtype=torch.float64, key_norm=None):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=gen, dtype=dtype)
    if key_norm is not None:
        q = F.normalize(q, dim=-1) * key_norm
        k = F.normalize(k, dim=-1) * key_norm
    v = torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    return q, k, v, beta


# ------------------------------------------------------------------ 35.1 b: the qk L2 convention

def test_qk_l2norm_true_is_fla_rsqrt_form():
    # at ||k|| = 4e-3 the two forms differ by ~3e-2 relative: True must be x * rsqrt(sum x^2 + 1e-6)
    q, k, v, beta = _inputs(key_norm=4e-3)
    o, _ = linattn.delta_rule(q, k, v, beta, qk_l2norm=True, mode="recurrent")
    fla = delta_rule_ref(q, k, v, beta, qk_l2norm="rsqrt")[0]
    old = delta_rule_ref(q, k, v, beta, qk_l2norm="clamp")[0]
    assert rel_err(o, fla) < 1e-12
    assert rel_err(o, old) > 1e-3
    o_rsqrt, _ = linattn.delta_rule(q, k, v, beta, qk_l2norm="rsqrt")
    assert rel_err(o_rsqrt, fla) < 1e-12


@pytest.mark.parametrize("mode", ["parallel", "chunk", "recurrent"])
def test_qk_l2norm_clamp_is_the_old_form(mode):
    q, k, v, beta = _inputs(key_norm=4e-3)
    o, _ = linattn.delta_rule(q, k, v, beta, qk_l2norm="clamp", mode=mode, chunk_size=4)
    ref = delta_rule_ref(q, k, v, beta, qk_l2norm="clamp")[0]
    assert rel_err(o, ref) < 1e-12
    # the old implementation, F.normalize, on the operator's inputs
    o_old, _ = linattn.delta_rule(F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6), v, beta,
                                  mode=mode, chunk_size=4)
    assert rel_err(o, o_old) < 1e-12


def test_qk_l2norm_bad_value():
    q, k, v, beta = _inputs()
    with pytest.raises(LinattnError, match="qk_l2norm"):
        linattn.delta_rule(q, k, v, beta, qk_l2norm="l2")


def test_layers_share_the_operators_l2norm():
    from linattn.layers.common import l2_normalize
    x = torch.randn(3, 5, 2, 8) * 1e-3
    assert torch.equal(l2_normalize(x), l2norm(x, "rsqrt"))
    assert torch.equal(l2_normalize(x, convention="clamp"), l2norm(x, "clamp"))
    assert torch.allclose(l2norm(x, "clamp"), F.normalize(x, dim=-1, eps=1e-6), rtol=1e-6, atol=0)


def test_legacy_checkpoint_loads_with_clamp_and_same_logits():
    # tests/fixtures/legacy_l2norm: written by make_fixture.py with the code of commit 046bb29, whose config dicts
    # have no l2norm_convention and whose operators normalised with the clamp form (keys of norm ~1e-3)
    c = ck.load_checkpoint(LEGACY)
    assert c.model_config.l2norm_convention == "clamp"
    exp = json.loads((LEGACY / "expected_logits.json").read_text())
    ids = torch.tensor(exp["ids"])
    with torch.no_grad():
        logits = c.model(ids).logits.double()
    # to fp32 rounding (the key-norm rescaling now forms ||k||^2 in fp64: issue 33.4)
    assert (logits - torch.tensor(exp["logits"], dtype=torch.float64)).abs().max() < 1e-6
    # the same weights with today's default give other logits: the test can fail
    new = ck.build_model(c.model_config.replace(l2norm_convention="rsqrt"))
    new.load_state_dict(c.model.state_dict())
    with torch.no_grad():
        assert (new(ids).logits.double() - logits).abs().max() > 1e-2


def test_config_dicts_old_partial_and_new():
    saved = json.loads((LEGACY / "config.json").read_text())["model"]      # a dict as today's code writes it
    saved.pop("arch")
    assert LMConfig.from_dict(saved).l2norm_convention == "clamp"
    assert LMConfig.from_dict({"vocab_size": 8, "mixer": "deltanet"}).l2norm_convention == "rsqrt"   # CLI, hand-made
    cfg = LMConfig(vocab_size=8, mixer="deltanet")
    assert cfg.l2norm_convention == "rsqrt"
    assert LMConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    clamp = cfg.replace(l2norm_convention="clamp")
    assert LMConfig.from_dict(clamp.to_dict()) == clamp
    with pytest.raises(ConfigError, match="l2norm_convention"):
        LMConfig(vocab_size=8, l2norm_convention="fla")


@pytest.mark.parametrize("mixer", ["deltanet", "gated-deltanet", "kda", "delta-product"])
def test_layer_convention_reaches_the_operator(mixer):
    from linattn.models.registry import build_mixer
    torch.manual_seed(0)
    layer = build_mixer(mixer, 16, 2, l2norm_convention="clamp").double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.startswith(("q_proj", "k_proj")):
                p.mul_(1e-3)
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    y_clamp = layer(x)
    layer.l2norm_convention = "rsqrt"
    y_rsqrt = layer(x)
    assert (y_clamp - y_rsqrt).abs().max() > 1e-3
    # decoding (the fast step for deltanet / gated-deltanet) uses the layer's convention too
    layer.l2norm_convention = "clamp"
    cache = linattn.layers.LayerCache()
    with torch.no_grad():
        steps = torch.cat([layer(x[:, t:t + 1], cache) for t in range(7)], dim=1)
    assert torch.allclose(steps, y_clamp.detach(), rtol=1e-7, atol=1e-8)


# ------------------------------------------------------------------ 33.4: no overflow of squares and sums

MODES = ("parallel", "chunk", "recurrent")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("convention", ["rsqrt", "clamp"])
def test_qk_l2norm_same_for_any_key_scale_up_to_dtype_max(mode, convention):
    # was: k * 1e20 in fp32 gave all-zero outputs (sum k^2 = inf)
    q, k, v, beta = _inputs(T=11, dtype=torch.float32)
    o1, S1 = linattn.delta_rule(q, k, v, beta, qk_l2norm=convention, mode=mode, chunk_size=4,
                                output_final_state=True)
    top = torch.finfo(torch.float32).max / k.abs().max().item()
    for c in (1e3, 1e10, 1e20, 1e30, top):
        o, S = linattn.delta_rule(q * c, k * c, v, beta, qk_l2norm=convention, mode=mode, chunk_size=4,
                                  output_final_state=True)
        assert torch.isfinite(o).all() and rel_err(o, o1) < 1e-6, c
        assert rel_err(S, S1) < 1e-6, c


def test_qk_l2norm_fp64_and_gradients_with_huge_keys():
    q, k, v, beta = _inputs(T=7)
    for c in (1e200, 1e300):
        o, _ = linattn.delta_rule(q, k * c, v, beta, qk_l2norm=True)
        # against k * 1e3 (the reference's own squares overflow fp64 at 1e200), where eps = 1e-6 weighs < 1e-12
        assert rel_err(o, delta_rule_ref(q, k * 1e3, v, beta, qk_l2norm=True)[0]) < 1e-12, c
    kc = (k.float() * 1e20).requires_grad_()
    qf = q.float().requires_grad_()
    o, _ = linattn.delta_rule(qf, kc, v.float(), beta.float(), qk_l2norm=True)
    o.square().sum().backward()
    k64 = (k * 1e20).requires_grad_()
    q64 = q.clone().requires_grad_()
    ref = delta_rule_ref(q64, k64, v, beta, qk_l2norm=True)[0]
    ref.square().sum().backward()
    assert torch.isfinite(kc.grad).all()
    assert rel_err(kc.grad, k64.grad) < 1e-4 and rel_err(qf.grad, q64.grad) < 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_efla_huge_keys(mode):
    # EFLA's ||k||^2 overflowed fp32 (a = 0 * inf = NaN); keys of norm 1e20 and near fp32's largest value
    q, k, v, beta = _inputs(T=9, dtype=torch.float32)
    k = k.clone()
    k[0, 2] *= 1e20
    k[0, 5, 1] *= 1e37
    o, S = linattn.delta_rule(q, k, v, beta, exact=True, mode=mode, chunk_size=4, output_final_state=True)
    ref_o, ref_S = delta_rule_ref(q, k, v, beta, exact=True)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert rel_err(o, ref_o) < 1e-5 and rel_err(S, ref_S) < 1e-5


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("channel", [False, True])
def test_log_gates_near_the_dtype_lowest_value(mode, channel):
    # two gates of -3e38 summed to -inf in fp32, and -inf - -inf = NaN in the decay differences
    q, k, v, beta = _inputs(T=9, dtype=torch.float32)
    g = -torch.rand(1, 9, 2, 8 if channel else None) if channel else -torch.rand(1, 9, 2)
    g[0, 3:5] = -3e38
    o, S = linattn.delta_rule(q, k, v, beta, g=g, qk_l2norm=True, mode=mode, chunk_size=8, output_final_state=True)
    ref_o, ref_S = delta_rule_ref(q, k, v, beta, g=g, qk_l2norm=True)
    assert torch.isfinite(o).all()
    assert rel_err(o, ref_o) < 1e-5 and rel_err(S, ref_S) < 1e-5


# ------------------------------------------------------------------ 33.7: the parallel form's precision

@pytest.mark.parametrize("gate", ["head", "channel"])
def test_parallel_fp32_as_accurate_as_chunk_at_T1000(gate):
    # fast gates (mean -0.4 per token: the sum reaches ~ -400): the parallel form's whole-sequence cumulative
    # sum in fp32 made it 13-20x less accurate than chunk (5.5e-6 vs 4.1e-7 here); its gate sums are now fp64
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 1000, 2, 16, 16
    q, k, v = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) for D in (K, K, V))
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    g = -0.8 * torch.rand(B, T, H, *((K,) if gate == "channel" else ()), generator=gen, dtype=torch.float64)
    ref = delta_rule_ref(q, k, v, beta, g=g, qk_l2norm=True)[0]
    err = {}
    for mode in ("parallel", "chunk"):
        o, _ = linattn.delta_rule(q.float(), k.float(), v.float(), beta.float(), g=g.float(), qk_l2norm=True,
                                  mode=mode, backend="torch")
        err[mode] = rel_err(o, ref)
    assert err["parallel"] <= 2 * err["chunk"], err


def test_parallel_long_block_gradients_match_reference():
    # the fp64 gate sums of a long block keep exact gradients (g's gradient comes back in fp32)
    gen = torch.Generator().manual_seed(1)
    B, T, H, K, V = 1, 70, 1, 4, 3
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for D in (K, K, V))
    beta = torch.rand(B, T, H, generator=gen)
    for shape in ((B, T, H), (B, T, H, K)):
        g = (-torch.rand(*shape, generator=gen)).requires_grad_()
        leaves = [x.clone().requires_grad_() for x in (q, k, v, beta)]
        o, _ = linattn.delta_rule(*leaves, g=g, qk_l2norm=True, mode="parallel", backend="torch")
        o.square().sum().backward()
        ref_leaves = [x.double().requires_grad_() for x in (q, k, v, beta)]
        g64 = g.detach().double().requires_grad_()
        delta_rule_ref(*ref_leaves, g=g64, qk_l2norm=True)[0].square().sum().backward()
        assert g.grad.dtype == torch.float32
        for a, b in zip(leaves + [g], ref_leaves + [g64]):
            assert rel_err(a.grad, b.grad) < 1e-5


# ------------------------------------------------------------------ 35.1 a: grouped value heads

def _grouped(B=2, T=13, H=2, n=3, K=8, V=4, seed=0, gate=None, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    HV = H * n
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, HV, V, generator=gen, dtype=dtype)
    beta = torch.rand(B, T, HV, generator=gen, dtype=dtype)
    g = None
    if gate == "head":
        g = -torch.rand(B, T, HV, generator=gen, dtype=dtype)
    elif gate == "channel":
        g = -torch.rand(B, T, HV, K, generator=gen, dtype=dtype)
    S0 = torch.randn(B, HV, K, V, generator=gen, dtype=dtype)
    return q, k, v, beta, g, S0


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gate", [None, "head", "channel"])
@pytest.mark.parametrize("exact", [False, True])
def test_delta_rule_grouped_value_heads(backend, mode, gate, exact):
    q, k, v, beta, g, S0 = _grouped(gate=gate)
    ref_o, ref_S = delta_rule_ref(q, k, v, beta, g=g, exact=exact, qk_l2norm=True, S0=S0)
    o, S = linattn.delta_rule(q, k, v, beta, g=g, exact=exact, qk_l2norm=True, mode=mode, chunk_size=4,
                              initial_state=S0, output_final_state=True, backend=backend)
    assert o.shape == v.shape and S.shape == S0.shape
    assert rel_err(o, ref_o) < 1e-13 and rel_err(S, ref_S) < 1e-13
    # the reference itself, per value head: head j of the grouped call is the plain call on q/k head j // n
    j = 4
    o_j, S_j = delta_rule_ref(q[:, :, j // 3:j // 3 + 1], k[:, :, j // 3:j // 3 + 1], v[:, :, j:j + 1],
                              beta[:, :, j:j + 1], g=None if g is None else g[:, :, j:j + 1], exact=exact,
                              qk_l2norm=True, S0=S0[:, j:j + 1])
    assert rel_err(ref_o[:, :, j:j + 1], o_j) < 1e-15 and rel_err(ref_S[:, j:j + 1], S_j) < 1e-15


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gate", [None, "head", "channel"])
def test_delta_rule_grouped_gradients_and_varlen(mode, gate):
    q, k, v, beta, g, S0 = _grouped(B=1, T=11, gate=gate, seed=1)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, beta, S0)] + ([g.clone().requires_grad_()] if gate else [])
    o, S = linattn.delta_rule(*leaves[:4], g=leaves[5] if gate else None, qk_l2norm=True, mode=mode, chunk_size=4,
                              initial_state=leaves[4], output_final_state=True, backend="torch")
    (o.square().sum() + S.square().sum()).backward()
    refs = [x.clone().requires_grad_() for x in (q, k, v, beta, S0)] + ([g.clone().requires_grad_()] if gate else [])
    ro, rS = delta_rule_ref(*refs[:4], g=refs[5] if gate else None, qk_l2norm=True, S0=refs[4])
    (ro.square().sum() + rS.square().sum()).backward()
    for a, b in zip(leaves, refs):
        assert rel_err(a.grad, b.grad) < 1e-12
    # packed sequences: each document as if alone, one state row per document
    cu = torch.tensor([0, 4, 11])
    S0s = torch.cat([S0, S0.flip(0) * 0.5])
    o, S = linattn.delta_rule(q, k, v, beta, g=g, qk_l2norm=True, mode=mode, chunk_size=4, cu_seqlens=cu,
                              initial_state=S0s, output_final_state=True, backend="torch")
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        ro, rS = delta_rule_ref(q[:, a:b], k[:, a:b], v[:, a:b], beta[:, a:b], g=None if g is None else g[:, a:b],
                                qk_l2norm=True, S0=S0s[i:i + 1])
        assert rel_err(o[:, a:b], ro) < 1e-13 and rel_err(S[i:i + 1], rS) < 1e-13


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_prepared_grouped_problem_keeps_the_query_key_heads(backend):
    from linattn.ops.delta_core import prepare_delta, run_delta
    q, k, v, beta, g, S0 = _grouped(gate="head")
    p = prepare_delta(q, k, v, beta, g=g, qk_l2norm=True, initial_state=S0, output_final_state=True)
    # q and k are prepared once on their own 2 heads; a, g, v~ and the state are per value head
    assert p.value_groups == 3 and p.q.shape[2] == p.k.shape[2] == 2 and p.v.shape[2] == p.a.shape[2] == 6
    q_v, k_v, r_v = p.value_head_qkr()
    assert torch.equal(q_v, p.q.repeat_interleave(3, dim=2)) and torch.equal(k_v, p.k.repeat_interleave(3, dim=2))
    assert r_v is None
    o, S = run_delta(p, backend)
    ref_o, ref_S = delta_rule_ref(q, k, v, beta, g=g, qk_l2norm=True, S0=S0)
    assert rel_err(o, ref_o) < 1e-13 and rel_err(S, ref_S) < 1e-13


def test_grouped_heads_errors_name_the_shapes():
    q, k, v, beta, g, S0 = _grouped(H=2, n=3)
    with pytest.raises(LinattnError, match=r"HV = n \* H .*\(2, 13, 2, 8\).*\(2, 13, 5, 4\)"):
        linattn.delta_rule(q, k, v[:, :, :5], beta[:, :, :5])
    with pytest.raises(LinattnError, match="HV = n"):
        linattn.linear_attention(q, k, v[:, :, :5])
    with pytest.raises(LinattnError, match="beta"):
        linattn.delta_rule(q, k, v, beta[:, :, :2])
    with pytest.raises(LinattnError, match="initial_state"):
        linattn.delta_rule(q, k, v, beta, initial_state=S0[:, :2])


def test_comba_grouped_value_heads():
    from linattn.ops.reference import comba_ref
    q, k, v, beta, g, S0 = _grouped(gate="head")
    for mode in MODES:
        o, S = linattn.comba(q, k, v, beta, g=g, qk_l2norm=True, mode=mode, chunk_size=4, initial_state=S0,
                             output_final_state=True, backend="torch")
        ro, rS = comba_ref(q, k, v, beta, g=g, qk_l2norm=True, S0=S0)
        assert rel_err(o, ro) < 1e-13 and rel_err(S, rS) < 1e-13


LIN_GATES = ["none", "g-shared", "g-per-value-head", "diag-shared", "diag-per-value-head", "gamma-float",
             "gamma-shared", "gamma-per-value-head"]


def _lin_gate(name, B, T, H, HV, K, gen):
    """(kwargs for linear_attention, the log-gate for the reference)."""
    if name == "none":
        return {}, None
    if name.startswith("gamma"):
        gam = {"gamma-float": 0.8, "gamma-shared": torch.tensor([0.9, 0.5], dtype=torch.float64),
               "gamma-per-value-head": torch.linspace(0.5, 0.95, HV, dtype=torch.float64)}[name]
        lg = torch.log(torch.as_tensor(gam, dtype=torch.float64))
        heads = lg.numel() if lg.dim() else H
        return {"gamma": gam}, lg.expand(heads).view(1, 1, heads).expand(B, T, heads)
    heads = H if name.endswith("shared") else HV
    g = -torch.rand(B, T, heads, *((K,) if name.startswith("diag") else ()), generator=gen, dtype=torch.float64)
    return {"g": g}, g


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fm,gate", [("elu+1", g) for g in LIN_GATES]
                         + [("hadamard_exp", g) for g in LIN_GATES if not g.startswith("diag")])
def test_linear_attention_grouped_value_heads(backend, mode, gate, fm):
    from linattn.ops.reference import linear_attention_ref
    gen = torch.Generator().manual_seed(2)
    B, T, H, n, K, V = 1, 11, 2, 3, 4, 3
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H * n, V, generator=gen, dtype=torch.float64)
    kw, lg = _lin_gate(gate, B, T, H, H * n, K, gen)
    ref = linear_attention_ref(q, k, v, fm, log_gate=lg)
    o, st = linattn.linear_attention(q, k, v, feature_map=fm, mode=mode, chunk_size=4, output_final_state=True,
                                     backend=backend, **kw)
    assert o.shape == v.shape and st.kv.shape == (B, H * n, K, V) and st.z.shape == (B, H * n, K)
    assert rel_err(o, ref) < 1e-13

    def part(x, sl):
        return x[:, sl] if isinstance(x, torch.Tensor) and x.dim() >= 3 else x

    # a state carried across calls (the second call repeats q/k: its state is per value head)
    o1, s1 = linattn.linear_attention(q[:, :5], k[:, :5], v[:, :5], feature_map=fm, mode=mode, chunk_size=4,
                                      output_final_state=True, backend=backend,
                                      **{a: part(b, slice(0, 5)) for a, b in kw.items()})
    o2, s2 = linattn.linear_attention(q[:, 5:], k[:, 5:], v[:, 5:], feature_map=fm, mode=mode, chunk_size=4,
                                      initial_state=s1, output_final_state=True, backend=backend,
                                      **{a: part(b, slice(5, None)) for a, b in kw.items()})
    assert rel_err(torch.cat([o1, o2], dim=1), ref) < 1e-13
    assert rel_err(s2.kv, st.kv) < 1e-13 and rel_err(s2.z, st.z) < 1e-13


def test_linear_attention_grouped_folds_without_copying_qk():
    q, k = torch.randn(1, 9, 2, 4), torch.randn(1, 9, 2, 4)
    v = torch.randn(1, 9, 6, 3)
    p = linattn.prepare_linear_attention(q, k, v, g=-torch.rand(1, 9, 2))
    assert p.folded and p.q is q and p.k is k and p.v.shape == (1, 9, 2, 9)
    p = linattn.prepare_linear_attention(q, k, v, g=-torch.rand(1, 9, 6))       # a gate per value head: repeats
    assert not p.folded and p.q.shape == (1, 9, 6, 4)
    # gradients of the folded path against the reference
    from linattn.ops.reference import linear_attention_ref
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    g = -torch.rand(1, 9, 2, dtype=torch.float64)
    o, _ = linattn.linear_attention(*leaves, g=g, mode="chunk", chunk_size=4, backend="torch")
    o.square().sum().backward()
    refs = [x.double().requires_grad_() for x in (q, k, v)]
    linear_attention_ref(*refs, "elu+1", log_gate=g).square().sum().backward()
    for a, b in zip(leaves, refs):
        assert rel_err(a.grad, b.grad) < 1e-12


# ------------------------------------------------------------------ 35.1 c: layers

GROUPED_MIXERS = ["deltanet", "gated-deltanet", "efla", "kda", "mamba2-gla", "gla", "retnet", "linear-elu+1"]


def _layer(name, **kw):
    from linattn.models.registry import build_mixer
    torch.manual_seed(0)
    return build_mixer(name, 16, 2, n_value_heads=4, head_dim=8, chunk_size=4, **kw).double()


@pytest.mark.parametrize("name", GROUPED_MIXERS)
def test_grouped_layer_prefill_decode_and_packing(name):
    layer = _layer(name)
    assert layer.v_proj.out_features == 4 * 8 and layer.o_proj.in_features == 4 * 8
    x = torch.randn(1, 11, 16, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache = linattn.layers.LayerCache()
        steps = torch.cat([layer(x[:, :6], cache)] + [layer(x[:, t:t + 1], cache) for t in range(6, 11)], dim=1)
        cu = torch.tensor([0, 4, 11])
        packed = layer(x, cu_seqlens=cu)
        alone = torch.cat([layer(x[:, :4]), layer(x[:, 4:])], dim=1)
    state = cache.get("state")
    kv = state if isinstance(state, torch.Tensor) else state.kv
    assert kv.shape[1] == 4                                        # one state per value head
    assert rel_err(steps, full) < 1e-12 and rel_err(packed, alone) < 1e-12


@pytest.mark.parametrize("name", ["deltanet", "gated-deltanet", "efla", "kda"])
def test_grouped_delta_layer_is_the_grouped_operator(name):
    # the layer's own q, k, v, beta and gate through the fp64 reference, value head j on q/k head j // 2
    layer = _layer(name)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with torch.no_grad():
        q, k, v = layer._qkv(x, None)
        q, k = layer._prepare_qk(q, k)
        beta, g = layer.beta(x), layer.log_gate(x)
        assert beta.shape == (2, 9, 4) and (g is None or g.shape[:3] == (2, 9, 4))
        o = delta_rule_ref(q, k, v, beta, g=g, exact=layer.exact, scale=layer.scale,
                           qk_l2norm=layer.l2norm_convention if layer.qk_l2norm else False)[0]
        assert rel_err(layer(x), layer._out(o, x)) < 1e-12


def test_grouped_layers_refuse_bad_head_counts():
    from linattn.models.registry import build_mixer
    with pytest.raises(LinattnError, match="n_value_heads must be a positive multiple of n_heads"):
        build_mixer("gated-deltanet", 16, 2, n_value_heads=3)
    with pytest.raises(LinattnError, match="DeltaProduct has no grouped value heads"):
        build_mixer("delta-product", 16, 2, n_value_heads=4)
    with pytest.raises(ConfigError, match="n_value_heads"):
        LMConfig(vocab_size=8, n_heads=2, n_value_heads=3)
    cfg = LMConfig(vocab_size=8, d_model=16, n_heads=2, n_layers=2, n_value_heads=4,
                   mixer=["gated-deltanet", "softmax"])
    model = linattn.models.LanguageModel(cfg)
    assert model.config.n_value_heads == 4
    assert LMConfig.from_dict(cfg.to_dict()) == cfg


def test_gated_norm_matches_transformers_mamba2_and_kimi():
    tf = pytest.importorskip("transformers")
    from transformers.models.mamba2.modeling_mamba2 import MambaRMSNormGated

    from linattn.layers.common import GatedRMSNorm
    torch.manual_seed(0)
    x, gate = torch.randn(2, 5, 24), torch.randn(2, 5, 24)
    theirs = MambaRMSNormGated(24, group_size=8, eps=1e-5)
    ours = GatedRMSNorm(24, eps=1e-5, gate_before_norm=True, group_size=8)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
        assert torch.allclose(ours(x, gate), theirs(x, gate), rtol=1e-6, atol=1e-6)
    try:
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNormGated
    except ImportError:
        KimiLinearRMSNormGated = None
    kimi = GatedRMSNorm(24, eps=1e-5, gate_act="sigmoid")
    with torch.no_grad():
        kimi.weight.normal_()
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * kimi.weight * torch.sigmoid(gate)
        assert torch.allclose(kimi(x, gate), y, rtol=1e-6, atol=1e-6)
        if KimiLinearRMSNormGated is not None:   # transformers >= 5.2x: Kimi's own module
            theirs = KimiLinearRMSNormGated(24, eps=1e-5)
            theirs.weight.copy_(kimi.weight)
            assert torch.allclose(kimi(x, gate), theirs(x, gate), rtol=1e-6, atol=1e-6)
    assert tf is not None


@pytest.mark.parametrize("kw", [{"gate_act": "sigmoid"}, {"gate_before_norm": True},
                                {"norm_group_size": 16, "gate_before_norm": True}])
def test_layer_gated_norm_options(kw):
    from linattn.layers.common import gate_activation
    layer = _layer("gated-deltanet", **kw)
    x = torch.randn(1, 7, 16, dtype=torch.float64)
    with torch.no_grad():
        q, k, v = layer._qkv(x, None)
        o = layer._mix(q, k, v, x, None)                                     # [1, 7, 4, 8]
        gate = layer.g_proj(x).view(1, 7, 4, 8)
        act = gate_activation(kw.get("gate_act", "silu"), gate)
        w = layer.o_norm.weight
        if kw.get("norm_group_size"):          # Mamba2: gate, then RMS over groups of 16 of the 32 channels
            h = (o * act).reshape(1, 7, 2, 16)
            y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).reshape(1, 7, 32) * w
        elif kw.get("gate_before_norm"):
            h = o * act
            y = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * w).reshape(1, 7, 32)
        else:
            y = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * w * act).reshape(1, 7, 32)
        assert rel_err(layer(x), layer.o_proj(y)) < 1e-13
        cache = linattn.layers.LayerCache()
        steps = torch.cat([layer(x[:, t:t + 1], cache) for t in range(7)], dim=1)  # the general decoding path
        assert rel_err(steps, layer(x)) < 1e-12


@pytest.mark.parametrize("name", ["deltanet", "gated-deltanet", "efla-adaptive", "kda", "delta-product", "mamba2-gla",
                                  "gla"])
def test_fp64_layers_keep_beta_and_decay_in_fp64(name):
    # they were cast to fp32 even in an fp64 model
    from linattn.models.registry import build_mixer
    layer = build_mixer(name, 16, 2, **({"gate": True} if name == "delta-product" else {})).double()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    g = layer.log_gate(x)
    if hasattr(layer, "beta"):
        assert layer.beta(x).dtype == torch.float64
    if g is not None:
        assert g.dtype == torch.float64
    layer32 = build_mixer(name, 16, 2, **({"gate": True} if name == "delta-product" else {}))
    g32 = layer32.log_gate(x.float())
    assert g32 is None or g32.dtype == torch.float32


@pytest.mark.parametrize("fm,gate", [("elu+1", "scalar"), ("hadamard_exp", "scalar"), ("elu+1", "diagonal")])
def test_linear_parallel_fp32_as_accurate_as_chunk_at_T1000(fm, gate):
    # the same whole-sequence gate sum in linear_attention's parallel form: 4.7e-6 vs chunk's 3.1e-7 before
    from linattn.ops.reference import linear_attention_ref
    gen = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 1000, 2, 16, 16
    q, k, v = (torch.randn(B, T, H, D, generator=gen, dtype=torch.float64) for D in (K, K, V))
    g = -0.8 * torch.rand(B, T, H, *((K,) if gate == "diagonal" else ()), generator=gen, dtype=torch.float64)
    ref = linear_attention_ref(q, k, v, fm, log_gate=g)
    err = {}
    for mode in ("parallel", "chunk"):
        o, _ = linattn.linear_attention(q.float(), k.float(), v.float(), feature_map=fm, g=g.float(), mode=mode,
                                        backend="torch")
        err[mode] = rel_err(o, ref)
    assert err["parallel"] <= 2 * err["chunk"], err


def test_comba_grouped_value_heads_with_read_key():
    from linattn.ops.reference import comba_ref
    q, k, v, beta, g, S0 = _grouped(gate="head", seed=3)
    p = 0.5 * k.flip(1)
    for mode in MODES:
        o, S = linattn.comba(q, k, v, beta, p=p, g=g, qk_l2norm=True, mode=mode, chunk_size=4, initial_state=S0,
                             output_final_state=True, backend="torch")
        ro, rS = comba_ref(q, k, v, beta, p=p, g=g, qk_l2norm=True, S0=S0)
        assert rel_err(o, ro) < 1e-13 and rel_err(S, rS) < 1e-13


@pytest.mark.parametrize("gate", [None, "head", "channel"])
def test_delta_product_grouped_value_heads(gate):
    from linattn.ops.reference import delta_product_ref
    gen = torch.Generator().manual_seed(4)
    B, T, H, m, n, K, V = 1, 9, 2, 2, 2, 4, 3
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, n, K, generator=gen, dtype=torch.float64)
    v = torch.randn(B, T, H * m, n, V, generator=gen, dtype=torch.float64)
    beta = 2 * torch.rand(B, T, H * m, n, generator=gen, dtype=torch.float64)
    g = None if gate is None else -torch.rand(B, T, H * m, *((K,) if gate == "channel" else ()), generator=gen,
                                              dtype=torch.float64)
    S0 = torch.randn(B, H * m, K, V, generator=gen, dtype=torch.float64)
    ro, rS = delta_product_ref(q, k, v, beta, g=g, qk_l2norm=True, S0=S0)
    for mode in MODES:
        o, S = linattn.delta_product(q, k, v, beta, g=g, qk_l2norm=True, mode=mode, chunk_size=4, initial_state=S0,
                                     output_final_state=True, backend="torch")
        assert o.shape == (B, T, H * m, V)
        assert rel_err(o, ro) < 1e-13 and rel_err(S, rS) < 1e-13
    with pytest.raises(LinattnError, match="v must have shape"):
        linattn.delta_product(q, k, v[:, :, :3], beta[:, :, :3])


@pytest.mark.parametrize("name", [m for m in GROUPED_MIXERS if m != "kda"])   # KDA has no fast step
def test_grouped_layer_fast_decode_step(name, monkeypatch):
    # the single-token fast step (CPU, no grad, fp64 here) with grouped value heads: the general path's values
    from linattn.layers import fast_decode
    from linattn.layers.base import AttentionBase
    layer = _layer(name)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    fast_calls = []
    kind = layer.fast_step_kind()
    original = fast_decode.STEPS[kind]

    def spy(*a):
        out = original(*a)
        fast_calls.append(out is not None)
        return out

    with torch.no_grad():
        full = layer(x)
        cache = linattn.layers.LayerCache()
        monkeypatch.setitem(fast_decode.STEPS, kind, spy)
        steps = torch.cat([layer(x[:, :3], cache)] + [layer(x[:, t:t + 1], cache) for t in range(3, 8)], dim=1)
    assert fast_calls and all(fast_calls), fast_calls           # the fast step ran, and did not decline
    assert isinstance(layer, AttentionBase)
    assert rel_err(steps, full) < 1e-12
    with torch.no_grad():                                        # and the general path's state
        layer.fast_decode = False
        cache2 = linattn.layers.LayerCache()
        torch.cat([layer(x[:, :3], cache2)] + [layer(x[:, t:t + 1], cache2) for t in range(3, 8)], dim=1)
    s1, s2 = cache.get("state"), cache2.get("state")
    s1, s2 = (s if isinstance(s, torch.Tensor) else s.kv for s in (s1, s2))
    assert s1.shape == s2.shape and rel_err(s1, s2) < 1e-12
