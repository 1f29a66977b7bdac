"""Layers: shapes, incremental decoding == full forward, building blocks, argument checks."""
import pytest
import torch

import linattn
from linattn.errors import LinattnError, LinattnTypeError
from linattn.layers import (
    EFLA,
    AttentionBase,
    Cache,
    DeltaNet,
    GatedDeltaNet,
    KVCache,
    LayerCache,
    LinearAttention,
    RMSNorm,
    RotaryEmbedding,
    ShortConv,
    SoftmaxAttention,
    SwiGLU,
    check_cu_seqlens,
    packed_positions,
)
from linattn.models.registry import build_mixer, mixer_spec, mixers

HAS_DELTA = hasattr(linattn, "delta_rule")
needs_delta = pytest.mark.skipif(not HAS_DELTA, reason="linattn.delta_rule not available yet")


pytestmark = pytest.mark.usefixtures("one_thread_module")


def decode_matches(layer, x, prefill=5, atol=1e-4):
    """Full forward vs prefill of `prefill` tokens then token-by-token decoding."""
    with torch.no_grad():
        full = layer(x)
        cache = LayerCache()
        outs = [layer(x[:, :prefill], cache=cache)] if prefill else []
        for t in range(prefill, x.shape[1]):
            outs.append(layer(x[:, t:t + 1], cache=cache))
    step = torch.cat(outs, dim=1)
    assert step.shape == full.shape
    err = (step - full).abs().max().item()
    assert err <= atol, f"decode differs from the full forward by {err}"
    return cache


LINEAR_CASES = [
    dict(feature_map="elu+1"),
    dict(feature_map="hadamard_exp", rope=True, output_norm=False),
    dict(feature_map="sum_sq_euclid", rope=True, short_conv=True),
    dict(feature_map="cosformer", output_gate=True),
    dict(feature_map="favor+", scale=0.25),
    dict(feature_map="taylor2", normalize=False),
    dict(feature_map="identity", gate="retnet", normalize=False),
    dict(feature_map="identity", gate="scalar", normalize=False, short_conv=True, output_gate=True),
    dict(feature_map="identity", gate="diagonal", normalize=False),
    dict(feature_map="hadamard_exp", gate="diagonal"),
    dict(feature_map="elu+1", gate="scalar", rope=True),
]


@pytest.mark.parametrize("kw", LINEAR_CASES, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_linear_attention_layer(kw):
    layer = LinearAttention(32, 4, **kw)
    x = torch.randn(2, 13, 32)
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    decode_matches(layer, x, prefill=4)
    decode_matches(layer, x, prefill=0)


def test_linear_gates():
    x = torch.randn(2, 5, 32)
    retnet = LinearAttention(32, 4, "identity", gate="retnet")
    assert torch.allclose(retnet.gamma, torch.tensor([1 - 2 ** (-5 - h) for h in range(4)]))
    scalar = LinearAttention(32, 4, "identity", gate="scalar")
    g = scalar.log_gate(x)
    assert g.shape == (2, 5, 4) and (g <= 0).all()
    diag = LinearAttention(32, 4, "sum_sq_euclid", gate="diagonal")
    g = diag.log_gate(x)
    assert g.shape == (2, 5, 4, 8 + 2) and (g <= 0).all()  # one gate per feature of phi (K + 2)
    with pytest.raises(ValueError, match="gate must be one of"):
        LinearAttention(32, 4, gate="bogus")
    with pytest.raises(ValueError, match="unknown feature_map"):
        LinearAttention(32, 4, feature_map="bogus")
    with pytest.raises(ValueError, match="divisible"):
        LinearAttention(30, 4)


def test_linear_layer_constant_cache():
    layer = LinearAttention(32, 4, "hadamard_exp", short_conv=True, rope=True)
    sizes = []
    for T in (10, 1000):
        c = LayerCache()
        with torch.no_grad():
            layer(torch.randn(1, T, 32), cache=c)
            layer(torch.randn(1, 1, 32), cache=c)
        sizes.append(c.nbytes())
        assert c.offset == T + 1
    assert sizes[0] == sizes[1] > 0


def test_softmax_layer_decode_and_window():
    x = torch.randn(2, 21, 32)
    decode_matches(SoftmaxAttention(32, 4), x, prefill=6)
    # small window and a tiny growth chunk so the KV cache gets trimmed while decoding
    layer = SoftmaxAttention(32, 4, window=4, kv_chunk=3)
    cache = decode_matches(layer, x, prefill=2)
    assert cache["kv"].length < 4 + 3
    with pytest.raises(ValueError, match="window"):
        SoftmaxAttention(32, 4, window=0)


def test_kv_cache_grows_in_chunks():
    kv = KVCache(chunk=8)
    k = torch.randn(1, 3, 2, 4)
    kv.append(k, k)
    assert kv.k.shape[1] == 8 and kv.length == 3
    n8 = kv.nbytes()
    for _ in range(2):
        kv.append(k, k)  # 9 tokens: one more chunk
    assert kv.k.shape[1] == 16 and kv.nbytes() == 2 * n8
    ks, vs, start = kv.append(k[:, :1], k[:, :1])
    assert ks.shape[1] == 10 and start == 0
    assert torch.equal(ks[:, :3], k)
    for _ in range(3):
        kv.append(k, k)  # 19 tokens: grows by half its size, in whole chunks (16 -> 24)
    assert kv.k.shape[1] == 24 and torch.equal(kv.k[:, 16:19], k)


@needs_delta
@pytest.mark.parametrize("cls,kw", [(DeltaNet, {}), (GatedDeltaNet, {}), (EFLA, {}),
                                    (EFLA, {"beta_mode": "adaptive"}), (EFLA, {"beta_mode": "loose"}),
                                    (DeltaNet, {"short_conv": False, "rope": True})])
def test_delta_layers(cls, kw):
    layer = cls(32, 4, **kw)
    x = torch.randn(2, 11, 32)
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"
    cache = decode_matches(layer, x, prefill=3)
    assert cache["state"].shape == (2, 4, 8, 8)


@needs_delta
def test_efla_beta_variants():
    x = torch.randn(2, 6, 32)
    sig, ada, loose = (EFLA(32, 4, beta_mode=m) for m in ("sigmoid", "adaptive", "loose"))
    ada.b_proj.load_state_dict(sig.b_proj.state_dict())
    loose.b_proj.load_state_dict(sig.b_proj.state_dict())
    with torch.no_grad():
        sig.b_proj.bias.fill_(3.0), ada.b_proj.bias.fill_(3.0), loose.b_proj.bias.fill_(3.0)
        assert torch.allclose(ada.beta(x), sig.beta(x), atol=1e-6)  # softplus(alpha) = 1 at init
        assert (sig.beta(x) < 1).all() and (loose.beta(x) > 1).any()  # loose beta has no upper bound
        ada.beta_alpha.fill_(2.0)
        assert torch.allclose(ada.beta(x), torch.nn.functional.softplus(torch.tensor(2.0)) * sig.beta(x))
    with pytest.raises(ValueError, match="beta_mode"):
        EFLA(32, 4, beta_mode="tight")
    assert GatedDeltaNet(32, 4).log_gate(x).le(0).all()


def test_short_conv_is_causal_and_resumable():
    conv = ShortConv(6, 4)
    x = torch.randn(2, 9, 6)
    y, _ = conv(x)
    x2 = x.clone()
    x2[:, 5:] += 1.0
    assert torch.equal(conv(x2)[0][:, :5], y[:, :5])
    y1, s = conv(x[:, :4])
    y2, s = conv(x[:, 4:5], s)
    y3, _ = conv(x[:, 5:], s)
    assert torch.allclose(torch.cat([y1, y2, y3], 1), y, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_short_conv_token_by_token_matches_the_whole_call(bias):
    # one-token calls take the dot-product path (decoding), longer ones conv1d: both the same conv
    conv = ShortConv(6, 4, bias=bias)
    if bias:
        torch.nn.init.normal_(conv.bias)
    x = torch.randn(2, 9, 6)
    state, steps = None, []
    for t in range(9):
        y_t, state = conv(x[:, t:t + 1], state)
        steps.append(y_t)
    whole, last = conv(x)
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-6, atol=1e-6)
    assert torch.equal(state, last)


def test_rope_relative_and_offset():
    rope = RotaryEmbedding(8, max_seq_len=4)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    dots = []
    for shift in (0, 3, 50):  # beyond max_seq_len: the table is extended
        qr = rope.apply(q, offset=shift + 5)
        kr = rope.apply(k, offset=shift + 2)
        dots.append((qr * kr).sum().item())
    assert dots[0] == pytest.approx(dots[1], abs=1e-5) and dots[0] == pytest.approx(dots[2], abs=1e-5)
    x = torch.randn(2, 6, 3, 8)
    assert torch.allclose(rope.apply(x)[:, 4:], rope.apply(x[:, 4:], offset=4), atol=1e-6)
    assert torch.allclose(rope.apply(x).norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)


def test_norm_and_swiglu():
    x = torch.randn(3, 5, 16) * 7
    y = RMSNorm(16)(x)
    assert torch.allclose(y.pow(2).mean(-1), torch.ones(3, 5), atol=1e-3)
    f = SwiGLU(16)
    assert f.hidden % 32 == 0 and f(x).shape == x.shape
    assert SwiGLU(16, hidden=16)(x).shape == x.shape


def test_layer_rejects_bad_inputs():
    layer = LinearAttention(32, 4)
    with pytest.raises(LinattnError, match=r"\[B, T, 32\]"):
        layer(torch.randn(2, 5, 16))
    with pytest.raises(LinattnTypeError, match="LayerCache"):
        layer(torch.randn(2, 5, 32), cache={})
    c = Cache(2)
    assert c.layer(1, "mixer") is c.layer(1, "mixer") and c.nbytes() == 0


# ---------------------------------------------------------------------------------------------
# scale: None means head_dim**-0.5 in every layer, resolved to a number
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,kw", [(LinearAttention, {}), (SoftmaxAttention, {}), (DeltaNet, {}),
                                    (GatedDeltaNet, {}), (EFLA, {}), (LinearAttention, {"head_dim": 6})])
def test_scale_none_is_head_dim_default(cls, kw):
    layer = cls(32, 4, **kw)
    assert isinstance(layer.scale, float) and layer.scale == layer.head_dim ** -0.5
    assert cls(32, 4, scale=1.0, **kw).scale == 1.0 and cls(32, 4, scale=2, **kw).scale == 2.0
    for bad in ("head_dim**-0.5", True, [1.0]):
        with pytest.raises(LinattnTypeError, match="scale"):
            cls(32, 4, scale=bad, **kw)


def test_layers_declare_config_fields():
    base = set(AttentionBase.config_fields)
    assert {"head_dim", "rope", "short_conv", "max_seq_len", "norm_eps", "rope_base", "layer_idx"} <= base
    assert set(LinearAttention.config_fields) == base | {"chunk_size", "n_value_heads"}
    assert set(DeltaNet.config_fields) == set(EFLA.config_fields) == base | {"chunk_size", "l2norm_convention",
                                                                            "n_value_heads"}
    assert set(SoftmaxAttention.config_fields) == base | {"window"}


# ---------------------------------------------------------------------------------------------
# packed sequences (cu_seqlens)
# ---------------------------------------------------------------------------------------------

DOC_LENS = (5, 17, 9)


def packed_offsets(lens=DOC_LENS):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)


def packed_vs_separate(module, x, cu):
    """(outputs of the packed call, outputs of each document run alone, outputs of the unpacked call)."""
    with torch.no_grad():
        packed = module(x, cu_seqlens=cu)
        alone = torch.cat([module(x[:, a:b]) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
        joined = module(x)
    return packed, alone, joined


MIXER_VARIANTS = [pytest.param(m, force, id=f"{m}{'-conv-rope' if force else ''}",
                               marks=pytest.mark.skipif(not HAS_DELTA and issubclass(mixer_spec(m).cls, DeltaNet),
                                                        reason="no delta_rule"))
                  for m in mixers() for force in ({}, {"rope": True, "short_conv": True})]


@pytest.mark.parametrize("name,force", MIXER_VARIANTS)
def test_every_mixer_keeps_packed_documents_apart(name, force):
    """A packed batch of 3 uneven documents == each document run alone (state, short conv, RoPE
    and softmax attention all restart at every document), for every registered mixer."""
    torch.manual_seed(0)
    kw = dict(force)
    if "chunk_size" in mixer_spec(name).config_fields:
        kw["chunk_size"] = 4   # several chunks per document, chunk borders off the document borders
    layer = build_mixer(name, 32, 2, **kw)
    cu = packed_offsets()
    x = torch.randn(1, int(cu[-1]), 32)
    packed, alone, joined = packed_vs_separate(layer, x, cu)
    assert packed.shape == x.shape
    err = (packed - alone).abs().max().item()
    assert err <= 1e-5, f"{name}: packed documents differ from separate runs by {err}"
    # without cu_seqlens the later documents do see the earlier ones (the test can tell)
    assert (joined[:, 5:] - alone[:, 5:]).abs().max().item() > 1e-4
    # gradients flow through the packed path
    x.requires_grad_(True)
    layer(x, cu_seqlens=cu).square().sum().backward()
    assert torch.isfinite(x.grad).all()
    g = x.grad.clone()
    x.grad = None   # the last document's loss reaches no earlier document
    layer(x, cu_seqlens=cu)[:, 22:].square().sum().backward()
    assert x.grad[:, :22].abs().max() == 0 and x.grad[:, 22:].abs().max() > 0 and g.abs().max() > 0


def test_short_conv_packed_matches_separate():
    torch.manual_seed(0)
    for bias in (False, True):
        conv = ShortConv(6, 4, bias=bias)
        if bias:
            torch.nn.init.normal_(conv.bias)
        cu = packed_offsets((1, 2, 7, 3))   # documents shorter than the kernel too
        x = torch.randn(1, 13, 6)
        y, state = conv(x, cu_seqlens=cu)
        assert state is None
        alone = torch.cat([conv(x[:, a:b])[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
        assert torch.allclose(y, alone, atol=1e-6)
        assert torch.allclose(conv(x, cu_seqlens=torch.tensor([0, 13]))[0], conv(x)[0], atol=1e-6)
    with pytest.raises(LinattnError, match="state"):
        conv(x, conv(x)[1], cu_seqlens=cu)


def test_rope_positions_restart_per_document():
    rope = RotaryEmbedding(8)
    cu = packed_offsets()
    pos = packed_positions(cu, 31)
    assert pos.tolist() == list(range(5)) + list(range(17)) + list(range(9))
    x = torch.randn(1, 31, 2, 8)
    y = rope.apply(x, positions=pos)
    assert torch.allclose(y[:, 5:22], rope.apply(x[:, 5:22]), atol=1e-6)
    assert torch.equal(rope.apply(x, positions=torch.arange(31)), rope.apply(x))
    with pytest.raises(LinattnError, match="positions"):
        rope.apply(x, positions=torch.arange(30))


@pytest.mark.parametrize("cu,match", [
    ([0, 5, 31], None),
    ([0, 5, 30], "end at T = 31"),
    ([1, 5, 31], "start at 0"),
    ([0, 5, 5, 31], "strictly increasing"),
    ([31], "shape"),
])
def test_cu_seqlens_checks(cu, match):
    t = torch.tensor(cu, dtype=torch.int64)
    if match is None:
        assert torch.equal(check_cu_seqlens(t, 1, 31), t)
        return
    with pytest.raises(LinattnError, match=match):
        check_cu_seqlens(t, 1, 31)


def test_packed_argument_errors():
    layer = LinearAttention(32, 4, short_conv=True)
    cu = packed_offsets()
    with pytest.raises(LinattnError, match="batch size 1"):
        layer(torch.randn(2, 31, 32), cu_seqlens=cu)
    with pytest.raises(LinattnError, match="cache"):
        layer(torch.randn(1, 31, 32), cache=LayerCache(), cu_seqlens=cu)
    with pytest.raises(LinattnTypeError, match="cu_seqlens"):
        layer(torch.randn(1, 31, 32), cu_seqlens=[0, 5, 31])
    with pytest.raises(LinattnError, match="integer"):
        layer(torch.randn(1, 31, 32), cu_seqlens=cu.float())


def test_every_registered_mixer_declares_that_it_packs_documents():
    """`Block` trusts the class attribute instead of reading forward's signature: the two must agree."""
    import inspect

    from linattn.models import build_mixer, mixers

    for name in mixers():
        layer = build_mixer(name, 16, 2)
        takes = "cu_seqlens" in inspect.signature(layer.forward).parameters
        assert getattr(layer, "supports_cu_seqlens", False) == takes, name


def test_packed_offsets_are_read_from_the_host_once_per_call(monkeypatch):
    """The model, every layer, its short convolutions and its operator check the same cu_seqlens: one host read
    (a device-to-host sync on CUDA) for the whole forward; offsets changed in place are read and checked again."""
    from linattn import LanguageModel, LMConfig

    model = LanguageModel(LMConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, mixer="gated-deltanet"))
    ids, cu = torch.randint(0, 32, (1, 11)), torch.tensor([0, 4, 11])
    reads, tolist = [], torch.Tensor.tolist

    def counting(self):
        if self is cu:
            reads.append(1)
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    model(ids, cu_seqlens=cu)
    assert len(reads) == 1
    cu[1] = 11   # in place: an empty second document, which the next call must see
    with pytest.raises(LinattnError, match="strictly increasing"):
        model(ids, cu_seqlens=cu)
    assert len(reads) == 2
