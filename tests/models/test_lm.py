"""LanguageModel: every mixer, hybrids, MoE, Hyper-Link, memory lobe, caches, config, generation."""
import io
import json

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.audit import check_causality
from linattn.errors import ConfigError, LinattnError, LinattnTypeError
from linattn.models import (
    CausalLM,
    LanguageModel,
    LMConfig,
    MoE,
    build_model,
    config_from_dict,
    config_to_dict,
    families,
    family as family_mod,
    get_family,
    mixers,
    register_family,
    registry,
)
from linattn.models.registry import build_mixer, mixer_config_kwargs, mixer_spec

DELTA = {"deltanet", "gated-deltanet", "efla", "efla-adaptive", "efla-loose"}
HAS_DELTA = hasattr(linattn, "delta_rule")
#: softmax attention fed back by linear attention: KV caches that grow like softmax attention's
KV_CACHE = {"fox", "deltaformer", "path"}
V = 61


pytestmark = pytest.mark.usefixtures("one_thread_module")


def mixer_params():
    return [pytest.param(m, marks=pytest.mark.skipif(m in DELTA and not HAS_DELTA, reason="no delta_rule yet"))
            for m in mixers()]


def tiny(mixer="linear-elu+1", **kw):
    args = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=2, mixer=mixer)
    args.update(kw)
    return LanguageModel(LMConfig(**args))


def ids_(B=2, T=12, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def decode_error(model, ids, prefill):
    """Max |logits| difference between the full forward and prefill + token-by-token decoding."""
    with torch.no_grad():
        full = model(ids).logits
        if prefill:
            out = model(ids[:, :prefill], use_cache=True)
            parts, cache = [out.logits], out.cache
        else:
            parts, cache = [], model.new_cache()
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t:t + 1], cache=cache)
            parts.append(out.logits)
    assert cache.seen_tokens == ids.shape[1]
    return (torch.cat(parts, dim=1) - full).abs().max().item()


# ---------------------------------------------------------------------------------------------
# every mixer
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mixer", mixer_params())
def test_mixer_forward_backward(mixer):
    model = tiny(mixer)
    ids = ids_()
    out = model(ids)
    assert out.logits.shape == (2, 12, V) and out.cache is None
    assert out.aux_loss.shape == () and out.aux_loss.item() == 0.0
    assert torch.isfinite(out.logits).all()
    loss = F.cross_entropy(out.logits.reshape(-1, V), ids_(seed=1).reshape(-1))
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None]
    assert not no_grad, f"parameters without gradient: {no_grad}"
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p.grad).all()]
    assert not bad, f"non-finite gradients: {bad}"
    zero = [n for n, p in model.named_parameters() if p.grad.abs().max() == 0]
    assert not zero, f"all-zero gradients: {zero}"


@pytest.mark.parametrize("mixer", mixer_params())
def test_mixer_decode_matches_forward(mixer):
    model = tiny(mixer)
    ids = ids_(T=14)
    assert decode_error(model, ids, prefill=0) <= 1e-4   # token by token from an empty cache
    assert decode_error(model, ids, prefill=9) <= 1e-4   # chunked prefill hands its state on


@pytest.mark.parametrize("mixer", mixer_params())
def test_mixer_causal_and_state_dict(mixer):
    model = tiny(mixer)
    report = check_causality(model, seq_len=10, batch_size=1)
    assert report.ok, str(report)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    torch.manual_seed(123)  # a different init: everything must come from the state dict
    clone = LanguageModel(LMConfig.from_json(model.config.to_json()))
    buf.seek(0)
    clone.load_state_dict(torch.load(buf))
    ids = ids_()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, clone(ids).logits)


@pytest.mark.parametrize("mixer", mixer_params())
def test_mixer_trains_under_bf16_autocast(mixer):
    """`linattn train --dtype bf16` on a CPU: forward and backward under autocast, finite, chunk > 64 tokens."""
    model = tiny(mixer, n_layers=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids_(B=2, T=70)).logits.float().pow(2).mean()
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters()
                                        if p.grad is not None)


@pytest.mark.parametrize("mixer", [m for m in mixers() if not m.startswith(("softmax", "swa"))
                                   and (HAS_DELTA or m not in DELTA) and m not in KV_CACHE])
def test_linear_cache_is_constant_size(mixer):
    model = tiny(mixer, n_layers=1)
    sizes = []
    for T in (10, 1000):
        with torch.no_grad():
            out = model(ids_(B=1, T=T), use_cache=True)
            out = model(ids_(B=1, T=1), cache=out.cache)
        sizes.append(out.cache.nbytes())
    assert sizes[0] == sizes[1] > 0


def test_softmax_cache_grows():
    model = tiny("softmax", n_layers=1)
    sizes = [model(ids_(B=1, T=T), use_cache=True).cache.nbytes() for T in (10, 1000)]
    assert sizes[1] > sizes[0] > 0


@pytest.mark.parametrize("mixer", sorted(KV_CACHE))
def test_kv_cache_mixers_grow(mixer):
    model = tiny(mixer, n_layers=1)
    with torch.no_grad():
        sizes = [model(ids_(B=1, T=T), use_cache=True).cache.nbytes() for T in (10, 100)]
    assert sizes[1] > sizes[0] > 0


def test_hybrid_model():
    mix = ["linear-hadamard_exp", "softmax", "gla", "deltanet" if HAS_DELTA else "retnet"]
    model = tiny(mix, n_layers=4, ffn="moe", n_experts=3, top_k=2)
    assert [b.mixer_name for b in model.blocks] == mix
    ids = ids_(T=11)
    out = model(ids)
    assert out.logits.shape == (2, 11, V) and out.aux_loss.item() > 0
    assert decode_error(model, ids, prefill=4) <= 1e-4
    assert check_causality(model, seq_len=8, batch_size=1).ok


def test_mixer_overrides():
    model = tiny("linear-elu+1", rope=True, short_conv=True, head_dim=8,
                 mixer_kwargs={"linear-elu+1": {"output_gate": True}})
    m = model.blocks[0].mixer
    assert m.rope is not None and m.short_conv and m.head_dim == 8 and m.g_proj is not None
    assert decode_error(model, ids_(), prefill=5) <= 1e-4
    swa = tiny("swa", window=5).blocks[0].mixer
    assert swa.window == 5
    assert mixer_spec("ela-hadamard_exp").cls is linattn.layers.LinearAttention
    assert build_mixer("retnet", 32, 4).gate == "retnet"
    with pytest.raises(ValueError, match="valid mixers are: softmax"):
        build_mixer("nope", 32, 4)


# ---------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------

def naive_moe(moe: MoE, x):
    """Per-token loop reference of MoE.forward (without the aux loss)."""
    xf = x.reshape(-1, x.shape[-1])
    r = moe.route(xf)
    out = torch.zeros_like(xf)
    for n in range(xf.shape[0]):
        for e, w in zip(r.experts[n].tolist(), r.weights[n]):
            h = moe.expert(e, xf[n:n + 1])[0]
            b = moe.labels[e]
            out[n] += {"none": w * h, "eq14": w * h + b, "eq15": w * (h + b)}[moe.bias_mode]
    return out.view_as(x)


@pytest.mark.parametrize("bias", ["none", "eq14", "eq15"])
def test_moe_dispatch_matches_loop(bias):
    moe = MoE(16, n_experts=4, top_k=2, bias=bias)
    x = torch.randn(3, 7, 16)
    y, aux = moe(x)
    assert torch.allclose(y, naive_moe(moe, x), atol=1e-6)
    assert aux.item() > 0


def test_moe_routing():
    moe = MoE(16, n_experts=5, top_k=3)
    x = torch.randn(40, 16)
    r = moe.route(x)
    assert r.experts.shape == (40, 3) and r.weights.shape == (40, 3)
    assert torch.equal(r.experts, r.probs.topk(3, dim=-1).indices)          # the top-k experts
    assert torch.allclose(r.weights.sum(-1), torch.ones(40), atol=1e-6)     # renormalised
    assert torch.allclose(r.weights, r.probs.gather(1, r.experts) / r.probs.gather(1, r.experts).sum(-1, True))
    # aux loss = coef * E * sum_e f_e P_e (1 * coef when perfectly balanced)
    _, aux = moe(x)
    frac = torch.bincount(r.experts.flatten(), minlength=5).float() / 120
    assert aux.item() == pytest.approx(0.01 * 5 * (frac * r.probs.mean(0)).sum().item(), rel=1e-5)
    with pytest.raises(ValueError, match="top_k"):
        MoE(16, n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="bias"):
        MoE(16, bias="eq16")


def test_moe_aux_loss_in_model_output():
    model = tiny(ffn="moe", n_experts=4, top_k=2, aux_loss_coef=0.05)
    out = model(ids_())
    assert out.aux_loss.item() > 0 and out.aux_loss.requires_grad
    out.aux_loss.backward()
    assert model.blocks[0].ffn.router.weight.grad.abs().sum() > 0
    assert tiny(ffn="swiglu")(ids_()).aux_loss.item() == 0.0


def test_moe_bias_variants_differ_and_train():
    torch.manual_seed(0)
    base = tiny(ffn="moe", n_experts=4, top_k=2, moe_bias="none")
    ids, tgt = ids_(T=10), ids_(T=10, seed=5)
    logits, losses = {}, {}
    for bias in ("none", "eq14", "eq15"):
        model = tiny(ffn="moe", n_experts=4, top_k=2, moe_bias=bias, aux_loss_coef=0.0)
        model.load_state_dict(base.state_dict())  # same weights: only the bias form differs
        with torch.no_grad():
            logits[bias] = model(ids).logits
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        first = None
        for _ in range(8):
            out = model(ids)
            loss = F.cross_entropy(out.logits.reshape(-1, V), tgt.reshape(-1)) + out.aux_loss
            opt.zero_grad()
            loss.backward()
            if bias != "none":  # the label vectors (router rows) get the output's gradient
                assert model.blocks[0].ffn.router.weight.grad.abs().sum() > 0
            opt.step()
            first = loss.item() if first is None else first
        losses[bias] = (first, loss.item())
    assert not torch.allclose(logits["none"], logits["eq14"])
    assert not torch.allclose(logits["none"], logits["eq15"])
    assert not torch.allclose(logits["eq14"], logits["eq15"])
    for bias, (a, b) in losses.items():
        assert b < a - 0.1, f"{bias}: loss {a:.3f} -> {b:.3f}"


# ---------------------------------------------------------------------------------------------
# Hyper-Link, memory lobe, ELA preset
# ---------------------------------------------------------------------------------------------

def test_hyperlink_has_no_attention_residual():
    for residual, same in (("hyperlink", True), ("prenorm", False)):
        model = tiny(residual=residual, n_layers=1)
        block = model.blocks[0]
        with torch.no_grad():
            block.ffn.w_down.weight.zero_()  # FFN output 0
        x = torch.randn(2, 6, 32)
        y, _ = block(x)
        assert torch.equal(y, x) == same  # hyperlink: x + ffn(attn(norm x)) only
    model = tiny(residual="hyperlink", n_layers=1)
    assert model.blocks[0].norm2 is None
    block = model.blocks[0]
    x = torch.randn(2, 6, 32)
    expected = x + block.ffn(block.mixer(block.norm1(x)))
    assert torch.allclose(block(x)[0], expected, atol=1e-6)
    skip = tiny(residual="hyperlink", n_layers=1, hyperlink_ffn_skip=True).blocks[0]
    a = skip.mixer(skip.norm1(x))
    assert torch.allclose(skip(x)[0], x + a + skip.ffn(a), atol=1e-6)


def test_hyperlink_model_trains():
    model = tiny(residual="hyperlink", ffn="moe", final_norm=False, moe_bias="eq14")
    ids, tgt = ids_(T=10), ids_(T=10, seed=3)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        out = model(ids)
        loss = F.cross_entropy(out.logits.reshape(-1, V), tgt.reshape(-1)) + out.aux_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    assert decode_error(model, ids, prefill=3) <= 1e-4


def test_memory_lobe_causal():
    model = tiny(residual="hyperlink", memory_lobe="causal", ffn="moe")
    assert model.is_causal and model.blocks[0].lobe.mode == "causal"
    report = check_causality(model, seq_len=12, batch_size=1)
    assert report.ok, str(report)
    assert decode_error(model, ids_(), prefill=5) <= 1e-4
    prenorm = tiny(memory_lobe="causal")
    assert check_causality(prenorm, seq_len=8, batch_size=1).ok
    assert decode_error(prenorm, ids_(), prefill=0) <= 1e-4


def test_memory_lobe_bidirectional_needs_flag_and_leaks():
    with pytest.raises(ValueError, match="allow_future_leak"):
        LMConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, memory_lobe="bidirectional")
    cfg = LMConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, residual="hyperlink",
                   memory_lobe="bidirectional", allow_future_leak=True)
    with pytest.warns(UserWarning, match="later"):
        model = LanguageModel(cfg)
    assert not model.is_causal
    report = check_causality(model, seq_len=10, batch_size=1)
    assert not report.ok and report.offending_positions  # the audit catches the leak
    assert 0 in report.offending_positions and "FAILED" in str(report)
    with pytest.raises(ValueError, match="bidirectional"):
        model(ids_(), use_cache=True)
    out = model.generate(ids_(B=1, T=4), 3, temperature=0)  # falls back to full re-computation
    assert out.shape == (1, 7)


def test_ela_gpt_preset_matches_paper_parameter_counts():
    cfg = LMConfig.ela_gpt(6400)
    assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_experts, cfg.top_k) == (256, 4, 4, 4, 2)
    assert cfg.residual == "hyperlink" and not cfg.final_norm and cfg.tie_embeddings and cfg.ffn == "moe"
    model = LanguageModel(cfg.replace(residual="prenorm"))
    assert model.num_parameters() == 5_838_864  # the paper's FA/ELA-GPT count
    mix = model.blocks[0].mixer
    assert mix.rope is not None and mix.scale == 1.0 and mix.o_norm is None and not mix.short_conv
    assert mix.feature_map_name == "hadamard_exp"
    model = LanguageModel(cfg.replace(memory_lobe="causal"))
    assert model.num_parameters() == 6_624_272  # Hyper-Link + memory lobe
    sq = LMConfig.ela_gpt(100, kernel="sum_sq_euclid", d_model=32, n_heads=2)
    assert sq.mixer == "ela-sum_sq_euclid" and sq.d_model == 32
    with pytest.raises(ValueError, match="kernel"):
        LMConfig.ela_gpt(100, kernel="elu+1")


def test_num_parameters_tied_untied():
    tied, untied = tiny(), tiny(tie_embeddings=False)
    assert untied.num_parameters() - tied.num_parameters() == V * 32
    assert tied.num_parameters(exclude_embeddings=True) == untied.num_parameters(exclude_embeddings=True)
    assert tied.num_parameters() == sum(p.numel() for p in tied.parameters())


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------

def test_config_json_round_trip(tmp_path):
    cfg = LMConfig(vocab_size=V, d_model=32, n_layers=3, n_heads=2, mixer=["softmax", "gla", "retnet"],
                   ffn="moe", moe_bias="eq15", residual="hyperlink", memory_lobe="causal",
                   mixer_kwargs={"gla": {"output_gate": False}})
    assert LMConfig.from_json(cfg.to_json()) == cfg
    assert LMConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    path = tmp_path / "config.json"
    cfg.to_json(path)
    assert LMConfig.from_json(path) == cfg and LMConfig.from_json(str(path)) == cfg
    assert LanguageModel(cfg).blocks[1].mixer.g_proj is None


@pytest.mark.parametrize("kw,match", [
    (dict(mixer="linear-bogus"), "valid mixers are: softmax, swa, linear-identity"),
    (dict(mixer=["softmax"]), "n_layers"),
    (dict(ffn="mlp"), "ffn"),
    (dict(ffn="moe", n_experts=2, top_k=3), "top_k"),
    (dict(moe_bias="eq14"), "needs ffn='moe'"),
    (dict(ffn="moe", moe_bias="eq16"), "moe_bias"),
    (dict(residual="postnorm"), "residual"),
    (dict(memory_lobe="sideways"), "memory_lobe"),
    (dict(d_model=31), "divisible"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(mixer_kwargs={"nope": {}}), "mixer_kwargs"),
    (dict(window=0), "window"),
])
def test_bad_configs(kw, match):
    args = dict(vocab_size=V, d_model=32, n_layers=2, n_heads=2)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        LMConfig(**args)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown LMConfig fields"):
        LMConfig.from_dict({"vocab_size": 5, "d_modle": 3})
    model = tiny()
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.randn(2, 5))
    with pytest.raises(ValueError, match="cache"):
        model(ids_(), cache=tiny(n_layers=3).new_cache())
    with pytest.raises(LinattnTypeError):
        LanguageModel({"vocab_size": 5})
    with pytest.raises(LinattnError, match="targets"):
        model(ids_(), targets=ids_(T=5))


# ---------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------

def test_generate_greedy_matches_full_forward():
    model = tiny("softmax")
    prompt = ids_(B=2, T=5)
    out = model.generate(prompt, 6, temperature=0)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    seq = prompt
    with torch.no_grad():
        for _ in range(6):  # reference: re-run the whole sequence, take the argmax
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    assert torch.equal(model.generate(prompt, 6, temperature=1.0, top_k=1), seq)


def test_generate_sampling_and_stream():
    model = tiny("gla")
    model.train()
    prompt = [1, 2, 3]
    a = model.generate(prompt, 8, temperature=0.9, top_p=0.9, seed=7)
    b = model.generate(prompt, 8, temperature=0.9, top_p=0.9, generator=torch.Generator().manual_seed(7))
    c = model.generate(prompt, 8, temperature=0.9, top_p=0.9, generator=7)
    assert a.shape == (11,) and torch.equal(a, b) and torch.equal(a, c)
    assert model.training  # restored after generation
    toks = list(model.stream(prompt, 8, temperature=0.9, top_p=0.9, seed=7))
    assert all(isinstance(t, int) for t in toks) and toks == a[3:].tolist()
    assert model.generate(prompt, 0).tolist() == prompt
    # eos stops the stream (and is yielded)
    eos = toks[2]
    stopped = list(model.stream(prompt, 8, temperature=0.9, top_p=0.9, seed=7, eos_token_id=eos))
    assert stopped[-1] == eos and len(stopped) == toks.index(eos) + 1
    batch = list(model.stream(ids_(B=3, T=2), 2, temperature=0))
    assert len(batch) == 2 and batch[0].shape == (3,)


def test_sample_next_filters():
    from linattn.models import sample_next
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]]).repeat(200, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample_next(logits, 1.0, top_k=2, generator=g).tolist()) <= {2, 3}
    assert set(sample_next(logits, 1.0, top_p=0.5, generator=g).tolist()) == {2}
    assert sample_next(logits, 0.0).eq(2).all()
    with pytest.raises(ValueError, match="top_p"):
        sample_next(logits, 1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)


# ---------------------------------------------------------------------------------------------
# mixer config fields: each mixer declares what it takes; nothing in lm.py knows mixers
# ---------------------------------------------------------------------------------------------

LM_FIELDS = {f.name for f in __import__("dataclasses").fields(LMConfig)}


@pytest.mark.parametrize("mixer", mixers())
def test_mixer_config_fields_are_config_fields(mixer):
    spec = mixer_spec(mixer)
    assert spec.config_fields, f"{mixer} declares no config fields"
    assert set(spec.config_fields) <= LM_FIELDS | {registry.LAYER_IDX}
    cfg = LMConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, mixer=mixer, head_dim=8, rope=True,
                   short_conv=True, window=7, chunk_size=16, max_seq_len=99, norm_eps=1e-5)
    kw = mixer_config_kwargs(mixer, cfg, 1)
    expected = {f: (1 if f == registry.LAYER_IDX else getattr(cfg, f)) for f in spec.config_fields
                if f == registry.LAYER_IDX or getattr(cfg, f) is not None}   # None fields are left out
    assert kw == expected
    layer = LanguageModel(cfg).blocks[1].mixer
    assert layer.head_dim == 8 and layer.rope is not None and layer.short_conv and layer.layer_idx == 1
    if "chunk_size" in spec.config_fields:
        assert layer.chunk_size == 16
    if "window" in spec.config_fields:
        assert layer.window == 7


def test_config_fields_none_means_mixer_default():
    cfg = LMConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, mixer="swa")
    kw = mixer_config_kwargs("swa", cfg, 0)
    assert "window" not in kw and "rope" not in kw and "head_dim" not in kw and kw["max_seq_len"] == 2048
    assert LanguageModel(cfg).blocks[0].mixer.window == 256      # the registry entry's default
    assert tiny("softmax").blocks[0].mixer.window is None        # the layer's own default
    assert "chunk_size" not in kw                                # softmax attention does not take it
    kw = mixer_config_kwargs("gla", cfg.replace(mixer="gla", mixer_kwargs={"gla": {"chunk_size": 3}}), 0)
    assert kw["chunk_size"] == 3                                 # mixer_kwargs win


class _Probe(torch.nn.Module):
    """A mixer outside the built-ins: records the keyword arguments it was built with."""
    config_fields = ("chunk_size", "window", "layer_idx")
    built = []

    def __init__(self, d_model, n_heads, **kwargs):
        super().__init__()
        self.kwargs = kwargs
        _Probe.built.append(kwargs)
        self.proj = torch.nn.Linear(d_model, d_model)

    def forward(self, x, cache=None, cu_seqlens=None):
        return self.proj(x)


def test_new_mixer_gets_exactly_its_declared_fields(monkeypatch):
    from linattn.layers import registry as mixer_registry  # the registry's dict lives there (issue 38)
    monkeypatch.setattr(mixer_registry, "_REGISTRY", dict(mixer_registry._REGISTRY))
    registry.register_mixer("probe", _Probe, {"extra": 1}, "test mixer")
    _Probe.built.clear()
    model = tiny("probe", window=5, chunk_size=8)
    assert _Probe.built == [{"extra": 1, "rope": False, "short_conv": False, "chunk_size": 8, "window": 5,
                             "layer_idx": i} for i in range(2)]
    assert model(ids_()).logits.shape == (2, 12, V)
    # a spec can override the class attribute; fields the config lacks are a ConfigError
    registry.register_mixer("probe2", _Probe, {}, config_fields=("not_a_field",))
    with pytest.raises(ConfigError, match="not_a_field"):
        tiny("probe2")
    registry.register_mixer("probe3", _Probe, {}, config_fields=())
    _Probe.built.clear()
    tiny("probe3", n_layers=1)
    assert _Probe.built == [{"rope": False, "short_conv": False}]
    registry.unregister_mixer("probe3")

    class NoPacking(_Probe):
        def forward(self, x, cache=None):
            return self.proj(x)

    registry.register_mixer("nopack", NoPacking, {}, config_fields=())
    ids, cu = packed_ids()
    with pytest.raises(LinattnError, match="'nopack'.*cu_seqlens"):
        tiny("nopack")(ids, cu_seqlens=cu)
    assert "probe3" not in registry.mixers()
    with pytest.raises(ConfigError, match="already registered"):
        registry.register_mixer("probe", _Probe)


def test_unknown_mixer_kwarg_is_a_config_error():
    with pytest.raises(ConfigError, match="linear-elu\\+1"):
        tiny(mixer_kwargs={"linear-elu+1": {"bogus_option": 1}})
    with pytest.raises(ConfigError, match="mixer_kwargs"):
        LMConfig(vocab_size=V, mixer_kwargs={"gla": ["not", "a", "dict"]})


# ---------------------------------------------------------------------------------------------
# scales: no string sentinels; the numbers every mixer used before
# ---------------------------------------------------------------------------------------------

#: q scale of every built-in mixer (unchanged from the first version): 1.0 = no scaling
UNSCALED = {f"linear-{fm}" for fm in linattn.FEATURE_MAP_NAMES if fm != "favor+"} | {"ela-hadamard_exp",
                                                                                     "ela-sum_sq_euclid", "rwkv7",
                                                                                     "mamba2"}


@pytest.mark.parametrize("mixer", mixers())
@pytest.mark.parametrize("head_dim", [None, 8])
def test_mixer_scales_are_numbers(mixer, head_dim):
    spec = mixer_spec(mixer)
    assert not any(isinstance(v, str) and "**" in v for v in spec.defaults.values())
    model = tiny(mixer, head_dim=head_dim)
    layer = model.blocks[0].mixer
    hd = head_dim or 16
    assert isinstance(layer.scale, float)
    assert layer.scale == (1.0 if mixer in UNSCALED else hd ** -0.5), (mixer, layer.scale)


# ---------------------------------------------------------------------------------------------
# packed documents through the whole model
# ---------------------------------------------------------------------------------------------

def packed_ids(lens=(5, 17, 9), seed=0):
    ids = ids_(B=1, T=sum(lens), seed=seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    return ids, cu


def check_packed(model, lens=(5, 17, 9), atol=1e-5):
    ids, cu = packed_ids(lens)
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu).logits
        alone = torch.cat([model(ids[:, a:b]).logits for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1)
    err = (packed - alone).abs().max().item()
    assert err <= atol, f"packed documents differ from separate runs by {err}"


@pytest.mark.parametrize("mixer", mixer_params())
def test_mixer_model_packed_documents(mixer):
    check_packed(tiny(mixer, chunk_size=4))


def test_packed_documents_with_lobe_moe_and_hybrid():
    mix = ["gla", "softmax", "deltanet" if HAS_DELTA else "retnet", "linear-hadamard_exp"]
    check_packed(tiny(mix, n_layers=4, ffn="moe", n_experts=3, top_k=2, residual="hyperlink",
                      memory_lobe="causal", chunk_size=4, short_conv=True))
    with pytest.warns(UserWarning):
        leaky = tiny(residual="hyperlink", memory_lobe="bidirectional", allow_future_leak=True)
    check_packed(leaky)   # the bidirectional lobe sums over each document only


def test_packed_loss_and_errors():
    model = tiny("gated-deltanet" if HAS_DELTA else "gla")
    ids, cu = packed_ids()
    tgt = ids_(B=1, T=31, seed=4)
    out = model(ids, cu_seqlens=cu, targets=tgt)
    assert torch.allclose(out.loss, F.cross_entropy(out.logits.reshape(-1, V), tgt.reshape(-1)))
    out.loss.backward()
    with pytest.raises(LinattnError, match="cache"):
        model(ids, cu_seqlens=cu, use_cache=True)
    with pytest.raises(LinattnError, match="cache"):
        model(ids, cache=model.new_cache(), cu_seqlens=cu)
    with pytest.raises(LinattnError, match="batch size 1"):
        model(ids.repeat(2, 1), cu_seqlens=cu)
    with pytest.raises(LinattnError, match="end at"):
        model(ids, cu_seqlens=cu[:-1])


# ---------------------------------------------------------------------------------------------
# model families: every registered family follows CausalLM
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", families())
def test_every_family_follows_the_protocol(name):
    fam = get_family(name)
    assert fam.tiny_config is not None, f"family {name!r} registers no tiny_config"
    assert CausalLM in fam.model_cls.__mro__ and not family_mod.protocol_problems(fam.model_cls)
    torch.manual_seed(0)
    cfg = fam.tiny_config(V)
    assert type(cfg) is fam.config_cls
    d = config_to_dict(cfg)
    assert d["arch"] == name and config_from_dict(json.loads(json.dumps(d))) == cfg
    model = build_model(d)
    assert isinstance(model, fam.model_cls) and isinstance(model, CausalLM)
    assert model.config == cfg and model.is_causal is True
    assert 0 < model.num_parameters(exclude_embeddings=True) < model.num_parameters()
    model.eval()
    ids = ids_(B=2, T=13)
    # forward with targets: a loss, and gradients
    out = model(ids[:, :-1], targets=ids[:, 1:])
    assert out.logits.shape == (2, 12, V) and out.cache is None and out.aux_loss.shape == ()
    assert torch.isfinite(out.loss)
    assert torch.allclose(out.loss, F.cross_entropy(out.logits.reshape(-1, V), ids[:, 1:].reshape(-1)), atol=1e-6)
    out.loss.backward()
    # cached decoding == the no-cache logits
    with torch.no_grad():
        full = model(ids).logits
        step = model(ids[:, :6], use_cache=True)
        parts, cache = [step.logits], step.cache
        for t in range(6, 13):
            step = model(ids[:, t:t + 1], cache=cache)
            parts.append(step.logits)
            cache = step.cache
    assert (torch.cat(parts, dim=1) - full).abs().max().item() <= 1e-4
    fresh = model.new_cache()
    assert fresh is not None and fresh is not cache
    # generate with a cache == greedy re-runs without one; stream yields the same tokens
    prompt = ids[:, :5]
    gen = model.generate(prompt, 4, temperature=0)
    seq = prompt
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(gen, seq)
    assert [t.tolist() for t in model.stream(prompt, 4, temperature=0)] == seq[:, 5:].T.tolist()
    # packed documents: kept apart, or refused with a clear error
    pids, cu = packed_ids()
    if getattr(fam.model_cls, "supports_cu_seqlens", False):
        check_packed(model)
    else:
        with pytest.raises(LinattnError, match="cu_seqlens"):
            model(pids, cu_seqlens=cu)


def test_register_family_checks_the_protocol(monkeypatch):
    monkeypatch.setattr(family_mod, "_FAMILIES", dict(family_mod._FAMILIES))

    class NoGenerate(torch.nn.Module):
        def forward(self, input_ids, cache=None, *, use_cache=False, targets=None, cu_seqlens=None):
            ...

        def new_cache(self):
            ...

        def stream(self, input_ids, max_new_tokens, **kw):
            ...

        def num_parameters(self, exclude_embeddings=False):
            ...

        @property
        def is_causal(self):
            return True

    with pytest.raises(ConfigError, match="generate"):
        register_family("broken", LMConfig, NoGenerate)

    class BadForward(LanguageModel):
        def forward(self, input_ids, cache=None):   # no use_cache / targets / cu_seqlens
            return super().forward(input_ids, cache)

    with pytest.raises(ConfigError, match="use_cache"):
        register_family("broken", LMConfig, BadForward)
    with pytest.raises(ConfigError, match="already registered"):
        register_family("lm", LMConfig, LanguageModel)
    register_family("lm2", LMConfig, LanguageModel)   # a conforming class registers
    assert "lm2" in families()
