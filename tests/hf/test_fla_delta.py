"""Importing flash-linear-attention (fla) delta-family models (issue 37 point 1): the types delta_net,
gated_deltanet, kda, comba and gated_deltaproduct (src/linattn/hf/fla/<type>.py), and the options their layers
needed in linattn's (layers/delta.py, layers/delta_family.py), tested without fla first.

The strong tests build fla's OWN tiny model in fp64 (tests/fla_cpu.py runs it on the CPU), save it with
save_pretrained, convert it with `linattn.hf.import_fla`, and require the linattn checkpoint's fp64 logits to equal
fla's (<= 1e-10) and its 10 greedy tokens to equal fla's. fla's delta operators are replaced by linattn's fp64
references (ops/reference.py: delta_rule_ref, comba_ref, delta_product_ref), driven by fla's kernel arguments
(in-kernel gate, beta sigmoid, allow_neg_eigval, q/k(/p) L2 norm): fla's naive references (fla/ops/<op>/naive.py)
compute in fp32, which cannot show 1e-10. `test_references_agree_with_fla_naive` checks, in fp32, that each
replacement computes what fla's naive reference computes."""
import contextlib
import json
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from linattn.errors import LinattnError
from linattn.layers import EFLA, DeltaNet, GatedDeltaNet
from linattn.layers.cache import LayerCache
from linattn.layers.delta_family import KDA, Comba, DeltaProduct
from linattn.ops.reference import comba_ref, delta_product_ref, delta_rule_ref

TOL = 1e-10
# tiny fp64 tensors on shared cores: threads only contend
pytestmark = pytest.mark.usefixtures("one_thread_module")


def _perturbed(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


# -- options added to linattn's layers (no fla needed) -------------------------------------------------------------

def _manual(layer, x, *, qk_act="silu", silu_no_conv=False, sum_norm=False, beta_scale=1.0, beta_bias=True,
            use_beta=True, gate=None):
    """The delta-rule layer's output from the formula (fp64): projections, short conv (or not), the q/k/v activations
    of the options, beta, the log-gate, delta_rule_ref, the gated per-head RMSNorm, o_proj."""
    B, T, _ = x.shape
    H, HV, K, V = layer.n_heads, layer.n_value_heads, layer.head_dim, layer.head_dim_v

    def conv(name, u, act):
        if not layer.short_conv:
            return u
        w = getattr(layer, name).weight                                         # [C, 1, W]
        y = F.conv1d(F.pad(u.transpose(1, 2), (w.shape[-1] - 1, 0)), w, groups=u.shape[-1]).transpose(1, 2)
        return F.silu(y) if act else y

    q = conv("q_conv", layer.q_proj(x), qk_act == "silu")
    k = conv("k_conv", layer.k_proj(x), qk_act == "silu")
    v = conv("v_conv", layer.v_proj(x), True)
    if silu_no_conv and not layer.short_conv:
        v = F.silu(v)
        if qk_act == "silu":
            q, k = F.silu(q), F.silu(k)
    q, k = {"silu": lambda t: t, "relu": F.relu, "elu": lambda t: F.elu(t) + 1, "identity": lambda t: t}[qk_act](q), \
        {"silu": lambda t: t, "relu": F.relu, "elu": lambda t: F.elu(t) + 1, "identity": lambda t: t}[qk_act](k)
    q, k, v = q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, HV, V)
    l2 = "rsqrt"
    if sum_norm:
        q, k = (t / t.abs().sum(-1, keepdim=True).clamp_min(1e-6) for t in (q, k))
        l2 = False
    if use_beta:
        assert (layer.b_proj.bias is not None) == beta_bias
        beta = beta_scale * torch.sigmoid(layer.b_proj(x))
    else:
        beta = beta_scale * torch.ones(B, T, HV, dtype=x.dtype)
    o, _ = delta_rule_ref(q, k, v, beta, g=gate, scale=K ** -0.5, qk_l2norm=l2)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer.o_norm.eps) * layer.o_norm.weight
    if layer.g_proj is not None:
        o = o * F.silu(layer.g_proj(x).view(B, T, HV, V))
    return layer.o_proj(o.reshape(B, T, HV * V))


def _gdn_gate(layer, x):
    return -torch.exp(layer.A_log) * F.softplus(layer.a_proj(x) + layer.dt_bias)


@pytest.mark.parametrize("cls", [DeltaNet, GatedDeltaNet])
def test_delta_defaults_keep_the_layer(cls):
    """The default layers: b_proj with a bias, the q/k/v convolutions with SiLU, L2-normalised q/k (the formula)."""
    torch.manual_seed(0)
    layer = _perturbed(cls(32, 2).double())
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    gate = _gdn_gate(layer, x) if cls is GatedDeltaNet else None
    assert (layer(x) - _manual(layer, x, gate=gate)).abs().max() <= 1e-12
    assert layer.q_conv.activation == "silu" and layer.b_proj.bias is not None
    # without a short convolution the default is the plain projections
    layer = _perturbed(cls(32, 2, short_conv=False).double())
    gate = _gdn_gate(layer, x) if cls is GatedDeltaNet else None
    assert (layer(x) - _manual(layer, x, gate=gate)).abs().max() <= 1e-12


@pytest.mark.parametrize("kw, man", [
    (dict(beta_bias=False), dict(beta_bias=False)),
    (dict(use_beta=False), dict(use_beta=False)),
    (dict(allow_negative_eigenvalues=True), dict(beta_scale=2.0)),
    (dict(use_beta=False, allow_negative_eigenvalues=True), dict(use_beta=False, beta_scale=2.0)),
    (dict(qk_activation="relu"), dict(qk_act="relu")),
    (dict(qk_activation="elu"), dict(qk_act="elu")),
    (dict(qk_activation="identity", qk_norm="sum"), dict(qk_act="identity", sum_norm=True)),
    (dict(short_conv=False, activation_without_conv=True), dict(silu_no_conv=True)),
    (dict(short_conv=False, activation_without_conv=True, qk_activation="relu"), dict(silu_no_conv=True,
                                                                                      qk_act="relu")),
])
def test_deltanet_fla_options_follow_the_formula(kw, man):
    torch.manual_seed(0)
    layer = _perturbed(DeltaNet(32, 2, **kw).double())
    x = torch.randn(2, 9, 32, dtype=torch.float64, requires_grad=True)
    if not kw.get("use_beta", True):
        assert not hasattr(layer, "b_proj")
    got, want = layer(x), _manual(layer, x, **man)
    assert (got - want).abs().max() <= 1e-12
    params = [x] + list(layer.parameters())   # gradients too (the chunk form's backward through the options)
    for a, b in zip(torch.autograd.grad(got.square().sum(), params), torch.autograd.grad(want.square().sum(), params)):
        assert (a - b).abs().max() <= 1e-10


@pytest.mark.parametrize("kw", [dict(beta_bias=False), dict(use_beta=False), dict(allow_negative_eigenvalues=True),
                                dict(qk_activation="elu", qk_norm="sum"),
                                dict(short_conv=False, activation_without_conv=True)])
@pytest.mark.parametrize("cls", [DeltaNet, GatedDeltaNet])
def test_delta_options_decode_token_by_token_like_the_full_forward(cls, kw):
    """The decoding path (the fast step where it applies, else the general one) gives the full forward's values."""
    torch.manual_seed(0)
    layer = _perturbed(cls(32, 2, n_value_heads=4, **kw).double())
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    full = layer(x)
    cache = LayerCache()
    with torch.no_grad():
        steps = [layer(x[:, :3], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(3, 7)]
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-12


@pytest.mark.parametrize("cls, kw", [
    (KDA, dict(output_gate_rank=8, gate_lower_bound=-5.0, beta_bias=False, gate_act="sigmoid", n_value_heads=4)),
    (KDA, dict(short_conv=False, activation_without_conv=True, allow_negative_eigenvalues=True)),
    (Comba, dict(correction_before_norm=True, beta_bias=False, gate_act="sigmoid")),
    (Comba, dict(inner_decay=False, short_conv=False, activation_without_conv=True)),
    (DeltaProduct, dict(n_householder=3, beta_bias=False, gate=True, short_conv=False, activation_without_conv=True)),
])
def test_family_options_decode_token_by_token_like_the_full_forward(cls, kw):
    torch.manual_seed(0)
    layer = _perturbed(cls(32, 2, **kw).double())
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    full = layer(x)
    cache = LayerCache()
    with torch.no_grad():
        steps = [layer(x[:, :3], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(3, 7)]
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-12


def test_delta_option_errors():
    for kw, word in ((dict(qk_activation="gelu"), "qk_activation"), (dict(qk_norm="l1"), "qk_norm")):
        with pytest.raises(LinattnError, match=word):
            DeltaNet(32, 2, **kw)
    with pytest.raises(LinattnError, match="qk_norm"):
        Comba(32, 2, qk_norm="sum")
    with pytest.raises(LinattnError, match="allow_negative_eigenvalues"):
        EFLA(32, 2, allow_negative_eigenvalues=True)
    with pytest.raises(LinattnError, match="output_gate_rank"):
        KDA(32, 2, output_gate_rank=0)
    with pytest.raises(LinattnError, match="gate_lower_bound"):
        KDA(32, 2, gate_lower_bound=1.0)


def test_family_defaults_keep_their_parameters():
    """The option defaults keep each layer's parameters (names, biases, the full-rank output gate)."""
    names = {cls: sorted(cls(32, 2).state_dict()) for cls in (KDA, Comba, DeltaProduct)}
    assert "b_proj.bias" in names[KDA] and "g_proj.weight" in names[KDA] and "g_proj.1.bias" not in names[KDA]
    assert {"p_gain", "d", "b_proj.bias"} <= set(names[Comba])
    assert "b_proj.bias" in names[DeltaProduct]


def test_kda_options_follow_the_formula():
    torch.manual_seed(0)
    layer = _perturbed(KDA(32, 2, output_gate_rank=8, gate_lower_bound=-5.0, beta_bias=False).double())
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    f = layer.f_proj(x).view(2, 9, 2, 16) + layer.dt_bias.view(2, 16)
    g = -5.0 * torch.sigmoid(torch.exp(layer.A_log)[:, None] * f)
    assert isinstance(layer.g_proj, torch.nn.Sequential) and layer.g_proj[1].bias is not None
    assert (layer.log_gate(x) - g).abs().max() <= 1e-14
    default = _perturbed(KDA(32, 2).double())
    f = default.f_proj(x).view(2, 9, 2, 16) + default.dt_bias.view(2, 16)
    assert (default.log_gate(x) + torch.exp(default.A_log)[:, None] * F.softplus(f)).abs().max() <= 1e-14


@pytest.mark.parametrize("before, inner, hv", [(False, False, 2), (False, True, 2), (True, False, 2), (True, True, 2),
                                               (True, True, 4), (False, True, 4)])
def test_comba_normalisation_order(before, inner, hv):
    """correction_before_norm=False (the default): q, k normalised, then p = sigmoid(c) k, q - d p; True (fla's):
    p and q - d p from the raw q, k, then q, k, p normalised. hv = 4: grouped value heads."""
    torch.manual_seed(0)
    layer = _perturbed(Comba(32, 2, correction_before_norm=before, inner_decay=inner, n_value_heads=hv).double())
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    q, k, v = layer._qkv(x, None)

    def l2(t):
        return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6)

    if not before:
        q, k = l2(q), l2(k)
    p = torch.sigmoid(layer.p_gain)[:, None] * k if inner else k
    q = q - layer.d[:, None] * p
    if before:
        q, k, p = l2(q), l2(k), l2(p)
    beta = torch.sigmoid(layer.b_proj(x))
    o, _ = comba_ref(q, k, v, beta, p=p, g=_gdn_gate(layer, x))
    assert (layer._mix(*layer._qkv(x, None), x, None) - o).abs().max() <= 1e-12
    assert hasattr(layer, "p_gain") == inner


# -- the fla import ----------------------------------------------------------------------------------------------

def _l2(x):
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _state_in(S, v_first):
    return None if S is None else (S.transpose(-1, -2) if v_first else S)


def _out(o, S, v, output_final_state, v_first):
    return o.to(v.dtype), (_state_in(S, v_first) if output_final_state else None)


def _beta(beta, sigmoid, neg):
    return (2.0 if neg else 1.0) * torch.sigmoid(beta) if sigmoid else beta


def gated_delta_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
                     cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                     dt_bias=None, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
                     **unused):
    """fla's chunk_ / fused_recurrent_gated_delta_rule (and delta_rule: g None) by delta_rule_ref, in fp64."""
    assert cu_seqlens is None
    if use_gate_in_kernel:
        g = -torch.exp(A_log) * F.softplus(g + dt_bias)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=v.dtype)
    beta = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    o, S = delta_rule_ref(q, k, v, beta, g=g, scale=scale, qk_l2norm="rsqrt" if use_qk_l2norm_in_kernel else False,
                          S0=_state_in(initial_state, state_v_first))
    return _out(o, S, v, output_final_state, state_v_first)


def kda_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
             allow_neg_eigval=False, lower_bound=None, state_v_first=False, cu_seqlens=None, **unused):
    """fla's chunk_kda / fused_recurrent_kda by delta_rule_ref (per-channel gate), in fp64."""
    assert cu_seqlens is None
    if use_gate_in_kernel:
        HV = g.shape[2]
        f = g + dt_bias.view(HV, -1)
        if lower_bound is not None:
            g = lower_bound * torch.sigmoid(torch.exp(A_log).view(HV, 1) * f)
        else:
            g = -torch.exp(A_log).view(HV, 1) * F.softplus(f)
    beta = _beta(beta, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    o, S = delta_rule_ref(q, k, v, beta, g=g, scale=scale, qk_l2norm="rsqrt" if use_qk_l2norm_in_kernel else False,
                          S0=_state_in(initial_state, state_v_first))
    return _out(o, S, v, output_final_state, state_v_first)


def comba_rule(q, k, v, p, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
               use_qk_l2norm_in_kernel=False, **unused):
    """fla's chunk_comba / fused_recurrent_comba by comba_ref (q, k and p L2-normalised in the kernel), in fp64."""
    assert cu_seqlens is None
    if use_qk_l2norm_in_kernel:
        q, k, p = _l2(q), _l2(k), _l2(p)
    o, S = comba_ref(q, k, v, beta, p=p, g=g, scale=scale, S0=initial_state)
    return _out(o, S, v, output_final_state, False)


def delta_product_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                       num_householder=1, use_qk_l2norm_in_kernel=False, **unused):
    """fla's chunk_gated_delta_product by delta_product_ref: k, v, beta hold n sub-steps per token ((t n))."""
    assert cu_seqlens is None
    B, T, H, K = q.shape
    n = num_householder
    k = k.view(B, T, n, H, K).transpose(2, 3)
    vv = v.view(B, T, n, H, v.shape[-1]).transpose(2, 3)
    beta = beta.view(B, T, n, H).transpose(2, 3)
    o, S = delta_product_ref(q, k, vv, beta, g=g, scale=scale,
                             qk_l2norm="rsqrt" if use_qk_l2norm_in_kernel else False, S0=initial_state)
    return _out(o, S, v, output_final_state, False)


def causal_conv1d(x, weight, bias=None, activation=None, initial_state=None, output_final_state=False, **unused):
    """fla's causal_conv1d (the fused q|k|v convolution of Gated DeltaNet without a cache): x [B, T, D], w [D, W]."""
    assert initial_state is None
    from tests.fla_cpu import depthwise_causal_taps

    y = depthwise_causal_taps(F.pad(x.transpose(1, 2), (weight.shape[-1] - 1, 0)), weight, bias).transpose(1, 2)
    return (F.silu(y) if activation in ("silu", "swish") else y), None


def test_references_agree_with_fla_naive():
    """Each replacement above computes what fla's own naive reference computes (fla/ops/<op>/naive.py, fp32), on
    the same inputs, with the gate / beta / L2 norm fla's kernels apply in front (fla's naive_kda_gate and
    naive_kda_lowerbound_gate for KDA's). Comba: fla's naive_chunk_comba (its kernels' recurrence: the prediction
    reads the undecayed state; naive_recurrent_comba reads the decayed one and agrees with neither)."""
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (the dev extra pins 0.6.0)")
    from fla.ops.comba.naive import naive_chunk_comba
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    from fla.ops.kda.gate import naive_kda_gate, naive_kda_lowerbound_gate
    from fla.ops.kda.naive import naive_recurrent_kda

    torch.manual_seed(0)
    B, T, H, K, V, n = 2, 21, 2, 8, 16, 2
    q, k, p = (torch.randn(B, T, H, K) for _ in range(3))
    v, b, a = torch.randn(B, T, H, V), torch.randn(B, T, H), torch.randn(B, T, H)
    A_log, dt_bias = torch.rand(H), torch.randn(H)
    qn, kn = _l2(q), _l2(k)

    def close(x, y):
        assert (x - y).abs().max() <= 1e-4 * (1 + y.abs().max()), (x - y).abs().max()

    g = -torch.exp(A_log) * F.softplus(a + dt_bias)
    for neg in (False, True):
        o, S = gated_delta_rule(q, k, v, a, b, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg,
                                output_final_state=True)
        ro, rS = naive_recurrent_gated_delta_rule(qn, kn, v, (2.0 if neg else 1.0) * torch.sigmoid(b), g,
                                                  output_final_state=True)
        close(o, ro), close(S, rS)
    o, _ = gated_delta_rule(q, k, v, None, torch.sigmoid(b), use_qk_l2norm_in_kernel=True)
    ro, _ = delta_rule_recurrence(*(t.transpose(1, 2) for t in (qn, kn, v, torch.sigmoid(b))))
    close(o, ro.transpose(1, 2))
    gk, dtk = torch.randn(B, T, H, K), torch.randn(H * K)
    for bound in (None, -5.0):
        o, _ = kda_rule(q, k, v, gk, b, A_log=A_log, dt_bias=dtk, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                        use_beta_sigmoid_in_kernel=True, lower_bound=bound)
        gate = naive_kda_gate(gk, A_log, dtk) if bound is None else naive_kda_lowerbound_gate(gk, A_log, dtk, bound)
        ro, _ = naive_recurrent_kda(qn, kn, v, gate, torch.sigmoid(b))
        close(o, ro)
    beta = torch.sigmoid(b)
    o, _ = comba_rule(q, k, v, p, g, beta, use_qk_l2norm_in_kernel=True)
    ro, _ = naive_chunk_comba(qn, kn, v, _l2(p), g, beta, chunk_size=8)
    close(o, ro)
    kk, vv, bb = torch.randn(B, T * n, H, K), torch.randn(B, T * n, H, V), torch.rand(B, T * n, H)
    o, _ = delta_product_rule(q, kk, vv, g, bb, num_householder=n, use_qk_l2norm_in_kernel=True)
    ro, _ = naive_recurrent_gated_delta_product(qn, _l2(kk), vv, g, bb, K ** -0.5, num_householder=n)
    close(o, ro)


OPS = {
    "delta_net": {"fla.layers.delta_net.chunk_delta_rule": gated_delta_rule,
                  "fla.layers.delta_net.fused_recurrent_delta_rule": gated_delta_rule},
    "gated_deltanet": {"fla.layers.gated_deltanet.chunk_gated_delta_rule": gated_delta_rule,
                       "fla.layers.gated_deltanet.fused_recurrent_gated_delta_rule": gated_delta_rule,
                       "fla.layers.gated_deltanet.causal_conv1d": causal_conv1d},
    "kda": {"fla.layers.kda.chunk_kda": kda_rule, "fla.layers.kda.fused_recurrent_kda": kda_rule},
    "comba": {"fla.layers.comba.chunk_comba": comba_rule, "fla.layers.comba.fused_recurrent_comba": comba_rule},
    "gated_deltaproduct": {"fla.layers.gated_deltaproduct.chunk_gated_delta_product": delta_product_rule,
                           "fla.layers.gated_deltaproduct.fused_recurrent_gated_delta_rule": gated_delta_rule},
}

ATTN = {"layers": [1], "num_heads": 4, "num_kv_heads": 2}
MIXERS = {"delta_net": "deltanet", "gated_deltanet": "gated-deltanet", "kda": "kda", "comba": "comba",
          "gated_deltaproduct": "delta-product"}


@contextlib.contextmanager
def fp64_float_in_fla_layers():
    """fla's Comba and GatedDeltaProduct layers compute their gate with `.float()` (fp32, also in an fp64 model:
    ~1e-8 off the fp64 logits); inside, `.float()` called from fla's code keeps an fp64 tensor fp64, so the
    comparison tests the mapping, not fla's fp32 rounding (as fla_cpu does with the rotary tables)."""
    orig = torch.Tensor.float

    def float_(self, *args, **kwargs):
        if self.dtype == torch.float64 and sys._getframe(1).f_globals.get("__name__", "").startswith("fla."):
            return self
        return orig(self, *args, **kwargs)

    torch.Tensor.float = float_
    try:
        yield
    finally:
        torch.Tensor.float = orig


def _run(tmp_path, model_type, **kw):
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (the dev extra pins 0.6.0)")
    from transformers import AutoConfig

    from tests.fla_cpu import build_fla, check_import, fla_cpu

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # fla warns about use_short_conv=False and Comba's correction_factor
        cfg = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=3, vocab_size=100, **kw)
        with fla_cpu(OPS[model_type]), fp64_float_in_fla_layers():
            model = build_fla(cfg)
            res = check_import(model, tmp_path)
    assert res.max_err <= TOL, res.max_err
    assert res.greedy_equal, (res.fla_tokens, res.linattn_tokens)
    mixers = res.model.config.mixer
    mixers = [mixers] * 3 if isinstance(mixers, str) else mixers
    want = {MIXERS[model_type]} | ({"softmax"} if "attn" in kw else set())
    assert set(mixers) == set(want) and (mixers[1] == "softmax") == ("attn" in kw), mixers
    print(f"{model_type} {kw}: max |logits error| {res.max_err:.2e}, greedy equal {res.greedy_equal}")
    return res


GDN_CASES = {
    "defaults": dict(num_heads=2, head_dim=16),                        # expand_v 2, output gate, short conv
    "hybrid_gva_sigmoid_negeig": dict(num_heads=2, head_dim=16, num_v_heads=4, attn=ATTN,
                                      output_gate_activation="sigmoid", allow_neg_eigval=True),
    "no_gate_no_conv": dict(num_heads=2, head_dim=16, use_gate=False, use_short_conv=False, expand_v=1.0),
}


@pytest.mark.parametrize("case", list(GDN_CASES))
def test_gated_deltanet_import_matches_fla(tmp_path, case):
    _run(tmp_path, "gated_deltanet", **GDN_CASES[case])


DELTANET_CASES = {
    "defaults": dict(num_heads=2),                                     # silu, l2, beta, no gate (fla-hub's)
    "hybrid_gate_relu_sum_nobeta": dict(num_heads=2, attn=ATTN, use_gate=True, qk_activation="relu", qk_norm="sum",
                                        use_beta=False),
    "noconv_elu_negeig_expand": dict(num_heads=2, use_short_conv=False, qk_activation="elu", allow_neg_eigval=True,
                                     expand_k=0.5, expand_v=2.0),
}


@pytest.mark.parametrize("case", list(DELTANET_CASES))
def test_delta_net_import_matches_fla(tmp_path, case):
    _run(tmp_path, "delta_net", **DELTANET_CASES[case])


KDA_CASES = {
    "defaults": dict(num_heads=2, head_dim=16),
    "hybrid_gva_bounded_negeig_noconv": dict(num_heads=2, head_dim=16, num_v_heads=4, attn=ATTN, safe_gate=True,
                                             lower_bound=-5.0, allow_neg_eigval=True, use_short_conv=False,
                                             expand_v=2.0),
}


@pytest.mark.parametrize("case", list(KDA_CASES))
def test_kda_import_matches_fla(tmp_path, case):
    _run(tmp_path, "kda", **KDA_CASES[case])


COMBA_CASES = {
    "defaults": dict(num_heads=2, head_dim=16),
    "hybrid_gva_no_gate_noconv": dict(num_heads=2, head_dim=16, num_v_heads=4, attn=ATTN, use_output_gate=False,
                                      use_short_conv=False, expand_v=1.0),
}


@pytest.mark.parametrize("case", list(COMBA_CASES))
def test_comba_import_matches_fla(tmp_path, case):
    _run(tmp_path, "comba", **COMBA_CASES[case])


GDP_CASES = {
    "defaults": dict(num_heads=2, head_dim=16),                        # one Householder step, no forget gate
    "hybrid_two_steps_forget_negeig": dict(num_heads=2, head_dim=16, attn=ATTN, num_householder=2,
                                           use_forget_gate=True, allow_neg_eigval=True),
    "noconv_nogate_three_steps": dict(num_heads=2, head_dim=16, use_short_conv=False, use_output_gate=False,
                                      num_householder=3, expand_v=1.0),
}


@pytest.mark.parametrize("case", list(GDP_CASES))
def test_gated_deltaproduct_import_matches_fla(tmp_path, case):
    _run(tmp_path, "gated_deltaproduct", **GDP_CASES[case])


def _fla_state(model_type, **kw):
    """(config.json dict, fla tensors) of a tiny random fla model (no forward: fla's kernels are not needed)."""
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (the dev extra pins 0.6.0)")
    from transformers import AutoConfig, AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(model_type, hidden_size=32, num_hidden_layers=2, vocab_size=50, **kw)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg)
    return json.loads(cfg.to_json_string()), dict(model.state_dict())


def test_fla_weights_missing_a_tensor_or_with_an_unknown_one_are_named():
    from linattn.errors import CheckpointError
    from linattn.hf.fla import fla_to_linattn

    cfg, weights = _fla_state("gated_deltanet", num_heads=2, head_dim=8)
    config, state = fla_to_linattn(cfg, weights)
    assert config.mixer == "gated-deltanet" and config.n_value_heads == 2 and state["blocks.1.mixer.A_log"] is not None
    lacking = {k: v for k, v in weights.items() if k != "model.layers.1.attn.dt_bias"}
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.attn\.'?dt_bias"):
        fla_to_linattn(cfg, lacking)
    extra = dict(weights, **{"model.layers.0.attn.q_conv1d.bias": torch.zeros(16)})   # conv_bias: not fla's models'
    with pytest.raises(CheckpointError, match="q_conv1d.bias"):
        fla_to_linattn(cfg, extra)


@pytest.mark.parametrize("model_type, kw, word", [
    ("gated_deltanet", dict(num_heads=2, head_dim=8, num_v_heads=3), "num_v_heads"),
    ("gated_deltanet", dict(num_heads=2, head_dim=8, expand_v=0.3), "expand_v"),
])
def test_fla_options_linattn_lacks_are_errors(model_type, kw, word):
    pytest.importorskip("transformers")
    from linattn.errors import CheckpointError
    from linattn.hf.fla import fla_to_linattn

    cfg = {"model_type": model_type, "hidden_size": 32, "num_hidden_layers": 2, "vocab_size": 50, **kw}
    with pytest.raises(CheckpointError, match=word):
        fla_to_linattn(cfg, {})


@pytest.mark.parametrize("model_type, kw", [
    ("kda", dict(num_heads=2, head_dim=8, num_v_heads=4, lower_bound=-5.0, allow_neg_eigval=True)),
    ("gated_deltanet", dict(num_heads=2, head_dim=8, output_gate_activation="sigmoid", use_short_conv=False)),
    ("delta_net", dict(num_heads=2, qk_activation="elu", qk_norm="sum", use_beta=False)),
])
def test_imported_checkpoint_exports_to_transformers(tmp_path, model_type, kw):
    """An imported checkpoint with the new layer options goes through export_hf: transformers' model gives linattn's
    logits and greedy tokens (the options travel in the model config's mixer_kwargs)."""
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (the dev extra pins 0.6.0)")
    from transformers import AutoConfig, AutoModelForCausalLM

    from linattn import checkpoint as ckpt
    from linattn.hf import export_hf, import_fla
    from tests.fla_cpu import perturb

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(model_type, hidden_size=32, num_hidden_layers=2, vocab_size=50, **kw)
        torch.manual_seed(0)
        perturb(AutoModelForCausalLM.from_config(cfg).double()).save_pretrained(tmp_path / "fla")
    import_fla(tmp_path / "fla", tmp_path / "run")
    export_hf(tmp_path / "run", tmp_path / "hf")
    # export_hf loads the checkpoint in fp32 (its weights rounded), so the reference is that model, run in fp64
    lm = ckpt.load_checkpoint(tmp_path / "run").model.double().eval()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
    ids = torch.randint(0, 50, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - lm(ids).logits).abs().max() <= 1e-12
        assert torch.equal(hf.generate(ids, max_new_tokens=5, do_sample=False), lm.generate(ids, 5, temperature=0))
