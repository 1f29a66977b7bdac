"""Layers: shapes, incremental decoding == full forward, building blocks, argument checks."""
import pytest
import torch

from linattn.layers import (EFLA, Cache, DeltaNet, GatedDeltaNet, KVCache, LayerCache, LinearAttention,
                            RMSNorm, RotaryEmbedding, ShortConv, SoftmaxAttention, SwiGLU)

import linattn

HAS_DELTA = hasattr(linattn, "delta_rule")
needs_delta = pytest.mark.skipif(not HAS_DELTA, reason="linattn.delta_rule not available yet")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only contend on the shared cores
    yield
    torch.set_num_threads(n)


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
    with pytest.raises(ValueError, match=r"\[B, T, 32\]"):
        layer(torch.randn(2, 5, 16))
    with pytest.raises(TypeError, match="LayerCache"):
        layer(torch.randn(2, 5, 32), cache={})
    c = Cache(2)
    assert c.layer(1, "mixer") is c.layer(1, "mixer") and c.nbytes() == 0
