"""fla's mesa_net, forgetting_transformer, path_attn, deltaformer, rwkv7 and mamba2 checkpoints (issue 37 point 1):
the options their layers needed in linattn's (tested here without fla), then fla's OWN tiny models in fp64, saved
with save_pretrained, converted by `linattn.hf.import_fla`, whose linattn checkpoints must give fla's logits
(<= 1e-10) and greedy generations. fla's Triton kernels do not run on CPU: its layers call fla's naive references
or, where fla has none, linattn's fp64 references (each patch says which): FoX and DeltaFormer fla's naive ones (run
with fla's `.float()` casts keeping fp64, `_keep_fp64`); PaTH and MesaNet linattn's (fla's naive ones compute in
fp32 buffers); RWKV-7 linattn's token loop (fla has no naive one); Mamba2 an fp64 forward written here from Mamba2's
equations (fla's and transformers' CPU paths cast to fp32). A transformers Mamba2ForCausalLM folder is imported too."""
import pytest
import torch

from linattn.errors import CheckpointError, ConfigError
from linattn.models import LanguageModel, LMConfig

#: the compared length: the mapping is under test here (the operators' chunk boundaries have their own tests)
T_CHECK = 24


def _perturbed(model, seed=0, scale=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _rwkv_lm(**kw):
    c = dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, mixer="rwkv7", norm="layernorm", embed_norm=True,
             ffn="rwkv7", ffn_hidden=48, mixer_kwargs={"rwkv7": {"kk_norm": "rsqrt"}})
    c.update(kw)
    torch.manual_seed(0)
    return _perturbed(LanguageModel(LMConfig(**c)).double())


# -- options added for fla's models (no fla needed) ---------------------------------------------------------------

def test_rwkv7_block_options_decode_and_pack():
    # layernorm (with bias), the embeddings' norm in block 0 and RWKV-7's channel mix: decoding token by token and
    # packed documents give the full forward's logits (the channel mix's token shift keeps a state / restarts)
    m = _rwkv_lm()
    names = dict(m.named_parameters())
    assert "blocks.0.pre_norm.bias" in names and "blocks.1.pre_norm.weight" not in names
    assert "blocks.1.ffn.x_k" in names and "norm.bias" in names and names["blocks.0.ffn.key.weight"].shape == (48, 32)
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    full = m(ids).logits
    out = m(ids[:, :5], use_cache=True)
    steps = [out.logits]
    for t in range(5, 9):
        out = m(ids[:, t:t + 1], cache=out.cache)
        steps.append(out.logits)
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-12
    packed = m(ids.reshape(1, -1), cu_seqlens=torch.tensor([0, 9, 18])).logits
    assert (packed.reshape(2, 9, -1) - full).abs().max() < 1e-12
    # a document alone gives its own logits: the shift does not reach across the boundary
    assert (m(ids[1:]).logits - full[1:]).abs().max() < 1e-12


def test_rwkv7_block_options_defaults_keep_old_models():
    c = LMConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, mixer="rwkv7")
    assert c.norm == "rmsnorm" and not c.embed_norm
    d = c.to_dict()
    del d["norm"], d["embed_norm"]                     # a config saved before the fields existed
    assert LMConfig.from_dict(d) == c
    m = LanguageModel(c)
    assert all(type(b.norm1).__name__ == "RMSNorm" and b.pre_norm is None for b in m.blocks)
    with pytest.raises(ConfigError, match="norm must be one of"):
        LMConfig(vocab_size=50, norm="batchnorm")
    with pytest.raises(ConfigError, match="kk_norm"):
        LanguageModel(LMConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=2, mixer="rwkv7",
                               mixer_kwargs={"rwkv7": {"kk_norm": "l1"}}))


OPTIONS = [   # (mixer, mixer_kwargs) of the options added for fla's layers
    ("fox", {"n_kv_heads": 1, "qkv_bias": True, "qk_norm": True, "qk_norm_weight": "channel", "qk_norm_eps": 1e-5,
             "output_gate": True, "gate_act": "sigmoid", "output_norm": False}),
    ("deltaformer", {"stage1_query": "q", "beta_act": None, "qk_norm": True, "qk_norm_before_rope": True}),
    ("path", {"w_rank": None, "w_conv": False, "use_forget_gate": True, "n_kv_heads": 1}),
    ("path", {"w_conv_act": "silu", "w_conv_bias": True, "w_l2norm": "rsqrt"}),
    ("mesanet", {"v_conv": False, "scale": 1.0}),
    ("mamba2", {"d_per_channel": True, "norm_before_gate": True}),
    ("mamba2", {"gated_norm": False}),
    ("rwkv7", {"kk_norm": "rsqrt", "head_dim_v": 12, "short_conv": True}),
]


@pytest.mark.parametrize("mixer,kwargs", OPTIONS, ids=[f"{m}-{i}" for i, (m, _) in enumerate(OPTIONS)])
def test_fla_layer_options_decode_and_pack(mixer, kwargs):
    # each option set: prefill + token-by-token decoding and packed documents give the full forward's logits
    torch.manual_seed(0)
    c = LMConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=2, mixer=mixer, mixer_kwargs={mixer: kwargs},
                 chunk_size=4, ffn="none")
    m = _perturbed(LanguageModel(c).double())
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(1))
    full = m(ids).logits
    out = m(ids[:, :4], use_cache=True)
    steps = [out.logits]
    for t in range(4, 7):
        out = m(ids[:, t:t + 1], cache=out.cache)
        steps.append(out.logits)
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-10
    packed = m(ids.reshape(1, -1), cu_seqlens=torch.tensor([0, 7, 14])).logits
    assert (packed.reshape(2, 7, -1) - full).abs().max() < 1e-10


def test_fla_layer_options_bad_values():
    from linattn.errors import LinattnError
    from linattn.layers import DeltaFormer, FoX, PaTH
    cases = [
        (lambda: FoX(16, 2, n_kv_heads=3), "n_kv_heads"),
        (lambda: FoX(16, 2, qk_norm=True, qk_norm_weight="row"), "qk_norm_weight"),
        (lambda: FoX(16, 2, n_kv_heads=1, short_conv=True), "n_kv_heads"),
        (lambda: FoX(16, 2, qk_norm=True, qk_norm_before_rope=True, short_conv=True), "qk_norm_before_rope"),
        (lambda: PaTH(16, 2, w_conv_act="gelu"), "w_conv_act"),
        (lambda: PaTH(16, 2, w_l2norm="l1"), "w_l2norm"),
        (lambda: DeltaFormer(16, 2, beta_act="tanh"), "beta_act"),
        (lambda: DeltaFormer(16, 2, n_kv_heads=1), "n_kv_heads"),
    ]
    for build, name in cases:
        with pytest.raises(LinattnError, match=name):
            build()


@pytest.mark.parametrize("kwargs", [{"d_per_channel": True, "norm_before_gate": True}, {"gated_norm": False}])
def test_mamba2_block_options_match_equations(kwargs):
    # Mamba2Block's new options against the fp64 forward written from Mamba2's equations (_mamba2_torch_forward_fp64,
    # below), run on the block's own parameters under mamba_ssm's names
    from types import SimpleNamespace

    from linattn.layers.mamba2 import Mamba2Block
    torch.manual_seed(0)
    blk = _perturbed(Mamba2Block(16, 4, head_dim=8, state_size=4, n_groups=2, **kwargs).double())
    conv = torch.nn.Conv1d(blk.conv_dim, blk.conv_dim, 4, groups=blk.conv_dim, padding=3).double()
    with torch.no_grad():
        conv.weight.copy_(blk.conv.weight)
        conv.bias.copy_(blk.conv.bias)
    norm = None if blk.norm is None else SimpleNamespace(group_size=blk.norm.group_size or blk.d_inner,
                                                         eps=blk.norm.eps, weight=blk.norm.weight)
    ref = SimpleNamespace(num_heads=4, head_dim=8, n_groups=2, ssm_state_size=4, intermediate_size=blk.d_inner,
                          conv_dim=blk.conv_dim, in_proj=blk.in_proj, conv1d=conv, dt_bias=blk.dt_bias,
                          A_log=blk.A_log, D=blk.D, dt_limit=blk.dt_limit, norm=norm,
                          norm_before_gate=kwargs.get("norm_before_gate", False), out_proj=blk.o_proj)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    want = _mamba2_torch_forward_fp64(ref, x)[0]
    assert (blk(x) - want).abs().max() < 1e-12


# -- fla's own models, converted (need fla) -------------------------------------------------------------------------

def _fla():
    pytest.importorskip("fla", reason="flash-linear-attention is not installed (the dev extra pins 0.6.0)")
    from tests import fla_cpu
    return fla_cpu


def _token_shift(x, cu_seqlens=None, cache=None, output_cache=False, chunk_indices=None):
    """fla's token_shift (x_{t-1} - x_t, zero before the first token), torch form; fla's full-sequence calls only."""
    assert cu_seqlens is None and cache is None
    delta = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1) - x
    return (delta, x[:, -1:]) if output_cache else delta


def _rwkv7_ops():
    """fla has no naive RWKV-7 recurrence: its chunk and fused-recurrent kernels become linattn's fp64 token loop
    (ops/reference.rwkv7_ref, written from the formula); its fused helpers their own torch references."""
    from fla.ops.rwkv7.fused_addcmul import torch_addcmul_rwkv7
    from fla.ops.rwkv7.fused_k_update import k_update_ref
    from fla.ops.rwkv7.gate_output_correction import gate_output_correction_ref

    from linattn.ops.reference import rwkv7_ref

    def chunk(r, w, k, v, a, b, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None, **kw):
        assert cu_seqlens is None
        o, S = rwkv7_ref(r, w, k, v, a, b, scale=scale, S0=initial_state)
        return o, (S if output_final_state else None)

    def recurrent(r, w, k, v, kk, a, scale=1.0, initial_state=None, output_final_state=False, cu_seqlens=None, **kw):
        return chunk(r, w, k, v, -kk, kk * a, scale, initial_state, output_final_state, cu_seqlens)

    return {"fla.layers.rwkv7.chunk_rwkv7": chunk, "fla.layers.rwkv7.fused_mul_recurrent_rwkv7": recurrent,
            "fla.modules.token_shift.token_shift": _token_shift,
            "fla.ops.rwkv7.fused_addcmul.fused_addcmul_rwkv7": torch_addcmul_rwkv7,
            "fla.ops.rwkv7.fused_k_update.fused_k_rwkv7": lambda k, a, ka, **kw: k_update_ref(k, a, ka),
            "fla.ops.rwkv7.gate_output_correction.gate_output_correction": gate_output_correction_ref}


def test_rwkv7_import_matches_fla(tmp_path):
    # fla's default fuse_norm=True: kk through fla's l2_norm, x * rsqrt(sum x^2 + 1e-6) (F.normalize is 3.5e-6 off)
    fc = _fla()
    import warnings

    from fla.models import RWKV7Config
    with fc.fla_cpu(_rwkv7_ops()), warnings.catch_warnings():
        warnings.simplefilter("ignore")   # fla's RWKV-7 warns on construction
        model = fc.build_fla(RWKV7Config(hidden_size=64, num_hidden_layers=3, head_dim=16, vocab_size=100,
                                         decay_low_rank_dim=8, a_low_rank_dim=8, gate_low_rank_dim=16,
                                         v_low_rank_dim=8, intermediate_size=96, fuse_norm=True))
        res = fc.check_import(model, tmp_path, T=T_CHECK)
    assert res.max_err <= 1e-10, res.max_err
    assert res.greedy_equal, (res.fla_tokens, res.linattn_tokens)
    cfg = res.model.config
    assert (cfg.mixer, cfg.norm, cfg.embed_norm, cfg.ffn) == ("rwkv7", "layernorm", True, "rwkv7")
    assert cfg.mixer_kwargs["rwkv7"]["kk_norm"] == "rsqrt"
    # fla's unfused path (fuse_norm=False) normalises kk with F.normalize: the option follows the config
    from linattn.hf.fla.core import _read_config, fla_to_linattn, read_fla_weights
    folder = tmp_path / "fla_model"
    flacfg = {**_read_config(folder), "fuse_norm": False}
    assert fla_to_linattn(flacfg, read_fla_weights(folder))[0].mixer_kwargs["rwkv7"]["kk_norm"] == "normalize"


def _mamba2_torch_forward_fp64(self, x, last_state=None, use_cache=False, attention_mask=None):
    """fla's Mamba2.torch_forward (its CPU path, which casts A, x, B, C to fp32) in fp64, written here from Mamba2's
    equations on the mixer's own parameters: in_proj -> z | xBC | dt; causal depthwise conv + SiLU; head h reads the
    B/C group h // (H / G) (mamba_ssm's kernels); dt = clamp(softplus(dt + dt_bias)); h_t = exp(dt A) h_{t-1} +
    dt x_t B_t^T, y_t = h_t C_t + D x_t; gated RMSNorm per group (gate before or after the norm) or y * silu(z)."""
    assert last_state is None and attention_mask is None
    Bsz, T, _ = x.shape
    H, P, G, N = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size
    z, xbc, dt = self.in_proj(x).split([self.intermediate_size, self.conv_dim, H], dim=-1)
    xbc = torch.nn.functional.silu(self.conv1d(xbc.transpose(1, 2))[..., :T].transpose(1, 2))
    xs, b, c = xbc.split([self.intermediate_size, G * N, G * N], dim=-1)
    xs = xs.view(Bsz, T, H, P)
    b = b.view(Bsz, T, G, N).repeat_interleave(H // G, dim=2)
    c = c.view(Bsz, T, G, N).repeat_interleave(H // G, dim=2)
    dt = torch.nn.functional.softplus(dt + self.dt_bias).clamp(self.dt_limit[0], self.dt_limit[1])
    A = -torch.exp(self.A_log)
    D = self.D.view(H, -1)
    h = x.new_zeros(Bsz, H, P, N)
    ys = []
    for t in range(T):
        h = h * torch.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * xs[:, t])[..., None] * b[:, t, :, None]
        ys.append((h * c[:, t, :, None]).sum(-1) + D * xs[:, t])
    y = torch.stack(ys, 1).reshape(Bsz, T, H * P)
    if self.norm is None:
        y = y * torch.nn.functional.silu(z)
    else:
        if not self.norm_before_gate:
            y = y * torch.nn.functional.silu(z)
        yg = y.unflatten(-1, (-1, self.norm.group_size))
        y = (yg * torch.rsqrt(yg.pow(2).mean(-1, keepdim=True) + self.norm.eps)).flatten(-2) * self.norm.weight
        if self.norm_before_gate:
            y = y * torch.nn.functional.silu(z)
    return self.out_proj(y), None, None


@pytest.mark.parametrize("variant", [
    {},                                                                   # Mamba2's defaults, two B/C groups
    {"D_has_hdim": True, "norm_before_gate": True, "use_bias": True, "dt_limit": (0.01, float("inf")),
     "use_conv_bias": False, "tie_word_embeddings": True},                 # fla's options
])
def test_mamba2_import_matches_fla(tmp_path, variant):
    fc = _fla()
    from fla.layers.mamba2 import Mamba2 as FlaMamba2
    from fla.models import Mamba2Config

    cfg = dict(hidden_size=64, num_hidden_layers=2, head_dim=16, state_size=8, n_groups=2, expand=2,
               vocab_size=100, residual_in_fp32=False)   # fp32 residuals would round the fp64 comparison
    cfg.update(variant)
    ops = {"fla.layers.mamba2.Mamba2.torch_forward": _mamba2_torch_forward_fp64}
    with fc.fla_cpu(ops):
        model = fc.build_fla(Mamba2Config(**cfg))
        assert all(isinstance(layer.mixer, FlaMamba2) for layer in model.backbone.layers)
        res = fc.check_import(model, tmp_path, T=T_CHECK)
    assert res.max_err <= 1e-10, res.max_err
    assert res.greedy_equal, (res.fla_tokens, res.linattn_tokens)
    assert res.model.config.mixer == "mamba2" and res.model.config.ffn == "none"
    if not variant:   # a folder whose weights lack a tensor: the error names it
        from linattn.hf.fla.core import _read_config, fla_to_linattn, read_fla_weights
        folder = tmp_path / "fla_model"
        weights = read_fla_weights(folder)
        del weights["backbone.layers.1.mixer.D"]
        with pytest.raises(CheckpointError, match=r"backbone\.layers\.1\.mixer\.D"):
            fla_to_linattn(_read_config(folder), weights)


def _keep_fp64(fn):
    """fn with `Tensor.float()` keeping fp64 tensors fp64 while it runs: fla's layers and naive references cast
    gates and operands to fp32 (`.float()`), which would round an fp64 comparison to 1e-7. Only fla's code runs
    under it (linattn's model is called outside)."""
    def run(*args, **kwargs):
        orig = torch.Tensor.float
        torch.Tensor.float = lambda t, *a, **k: t if t.dtype == torch.float64 else orig(t, *a, **k)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.float = orig
    return run


def _check(fc, model, tmp_path):
    model.forward = _keep_fp64(model.forward)
    res = fc.check_import(model, tmp_path, T=T_CHECK)
    assert res.max_err <= 1e-10, res.max_err
    assert res.greedy_equal, (res.fla_tokens, res.linattn_tokens)
    return res


@pytest.mark.parametrize("variant", [{"num_kv_heads": 2, "qkv_bias": True, "qk_norm": True, "use_output_gate": True}])
def test_forgetting_transformer_import_matches_fla(tmp_path, variant):
    fc = _fla()
    from fla.models import ForgettingTransformerConfig
    from fla.ops.forgetting_attn.naive import naive_forgetting_attn

    def fox(q, k, v, g, cu_seqlens=None, **kw):       # fla's naive reference (GQA included), in fp64
        assert cu_seqlens is None
        return naive_forgetting_attn(q, k, v, g)

    with fc.fla_cpu({"fla.layers.forgetting_attn.parallel_forgetting_attn": fox}):
        model = fc.build_fla(ForgettingTransformerConfig(hidden_size=64, num_hidden_layers=2, num_heads=4,
                                                         vocab_size=100, intermediate_size=96, **variant))
        res = _check(fc, model, tmp_path)
    assert res.model.config.mixer == "fox"
    # fla applies window_size only when decoding (its forward ignores it): refused, naming it
    from linattn.hf.fla.core import _read_config, fla_to_linattn, read_fla_weights
    folder = tmp_path / "fla_model"
    with pytest.raises(CheckpointError, match="window_size"):
        fla_to_linattn({**_read_config(folder), "window_size": 8}, read_fla_weights(folder))


def _l2norm_fp64(x, eps=1e-6, output_dtype=None):
    """fla's l2_norm, keeping fp64 (fla's PaTH asks for an fp32 output)."""
    y = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
    return y if output_dtype is None or x.dtype == torch.float64 else y.to(output_dtype)


@pytest.mark.parametrize("variant", [
    {"num_kv_heads": 1},                                              # low-rank w, w's short conv, GQA
    {"use_forget_gate": True, "use_low_rank_w": False, "use_w_shortconv": False},
])
def test_path_attn_import_matches_fla(tmp_path, variant):
    fc = _fla()
    from fla.models import PaTHAttentionConfig

    from linattn.ops.reference import path_attention_ref

    def path(q, k, v, w, beta, g=None, scale=None, cu_seqlens=None, **kw):
        # fla's naive_path_attn computes in fp32 (x.to(torch.float), fp32 buffers): linattn's fp64 reference of
        # PaTH's definition instead (explicit Householder products)
        assert cu_seqlens is None
        G = q.shape[2] // k.shape[2]       # grouped k/v heads: each k/v head (with its w, beta) serves G query heads
        k, v, w, beta = (t.repeat_interleave(G, dim=2) for t in (k, v, w, beta))
        return path_attention_ref(q, k, v, w, beta, g=g, scale=scale).to(q.dtype), None

    ops = {"fla.layers.path_attn.parallel_path_attn": path, "fla.layers.path_attn.l2_norm": _l2norm_fp64}
    with fc.fla_cpu(ops):
        model = fc.build_fla(PaTHAttentionConfig(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=100,
                                                 intermediate_size=48, **variant))
        res = _check(fc, model, tmp_path)
    assert res.model.config.mixer == "path"


@pytest.mark.parametrize("variant", [{"qkv_bias": True, "qk_norm": True, "rope_theta": 500.0}])
def test_deltaformer_import_matches_fla(tmp_path, variant):
    fc = _fla()
    from fla.models import DeltaFormerConfig
    from fla.ops.deltaformer.naive import naive_deltaformer_attn

    def deltaformer(q, k, v, beta=None, attention_mask=None, cu_seqlens=None, **kw):   # fla's naive, fp64
        assert attention_mask is None and cu_seqlens is None
        return naive_deltaformer_attn(q, k, v, beta)

    with fc.fla_cpu({"fla.layers.deltaformer.deltaformer_attn": deltaformer}):
        model = fc.build_fla(DeltaFormerConfig(hidden_size=64, num_hidden_layers=2, num_heads=4, vocab_size=100,
                                               intermediate_size=96, **variant))
        res = _check(fc, model, tmp_path)
    assert res.model.config.mixer == "deltaformer"


def test_deltaformer_negative_beta_matches_reference():
    # fla's DeltaFormer feeds b_proj(x) unbounded as beta: every form of the operator takes negative values and
    # agrees with the fp64 reference (stage one's solve has a unit diagonal for any beta)
    from linattn.ops import deltaformer
    from linattn.ops.reference import deltaformer_ref
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 11, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    beta = 2 * torch.randn(2, 11, 2, generator=g, dtype=torch.float64)
    assert beta.min() < 0
    ref = deltaformer_ref(q, k, v, beta, stage1_query="q")[0]
    for mode in ("parallel", "chunk", "recurrent"):
        o = deltaformer(q, k, v, beta, stage1_query="q", mode=mode, block_size=4)
        assert (o - ref).abs().max() < 1e-10, mode


def _mesa_chunk_fp64(q, k, v, g, beta, lamb, h_kk_init=None, h_kv_init=None, output_final_state=False,
                     max_CG_iteration=30, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kw):
    """fla's chunk_mesa_net: its naive references compute in fp32 (`.float()`, fp32 buffers), so linattn's fp64
    reference of MesaNet's equation (ops/reference.mesa_net_ref, a dense solve per token) with q unscaled, after
    fla's in-kernel L2 norm (x * rsqrt(sum x^2 + 1e-6))."""
    from linattn.ops.reference import mesa_net_ref
    assert cu_seqlens is None and h_kk_init is None
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm_fp64(q), _l2norm_fp64(k)
    o, (Hs, Gs) = mesa_net_ref(q, k, v, beta, g, lamb, scale=1.0)
    return o.to(q.dtype), Hs, Gs


@pytest.mark.parametrize("variant", [
    {"attn": {"layers": [1], "num_heads": 2}},               # a hybrid: fla's softmax Attention in layer 1
    {"use_output_gate": True, "use_short_conv": False, "lambda_lower_bound": 0.5},
])
def test_mesa_net_import_matches_fla(tmp_path, variant):
    fc = _fla()
    from fla.models import MesaNetConfig

    with fc.fla_cpu({"fla.layers.mesa_net.chunk_mesa_net": _mesa_chunk_fp64}):
        model = fc.build_fla(MesaNetConfig(hidden_size=64, num_hidden_layers=3, num_heads=2, head_dim=16,
                                           vocab_size=100, intermediate_size=96, **variant))
        res = _check(fc, model, tmp_path)
    want = ["mesanet", "softmax", "mesanet"] if "attn" in variant else "mesanet"
    assert res.model.config.mixer == want


def test_mamba2_import_of_transformers_folder(tmp_path, monkeypatch):
    # transformers' Mamba2ForCausalLM saves the same names under the same model_type "mamba2" (its config says
    # layer_norm_epsilon / time_step_limit): the import reads it too. transformers' CPU path computes in fp32, so its
    # mixer and RMSNorm run the fp64 equations here (on the model's own parameters); no fla needed.
    from types import SimpleNamespace

    transformers = pytest.importorskip("transformers")
    mm = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    from tests import fla_cpu as fc

    def mixer(self, hidden_states, cache=None, attention_mask=None, **kw):
        ns = SimpleNamespace(num_heads=self.num_heads, head_dim=self.head_dim, n_groups=self.n_groups,
                             ssm_state_size=self.ssm_state_size, intermediate_size=self.intermediate_size,
                             conv_dim=self.conv_dim, in_proj=self.in_proj, conv1d=self.conv1d, dt_bias=self.dt_bias,
                             A_log=self.A_log, D=self.D, dt_limit=self.time_step_limit, norm_before_gate=False,
                             norm=SimpleNamespace(group_size=self.norm.group_size, eps=self.norm.variance_epsilon,
                                                  weight=self.norm.weight), out_proj=self.out_proj)
        return _mamba2_torch_forward_fp64(ns, hidden_states)[0]

    def rms(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)

    monkeypatch.setattr(mm.Mamba2Mixer, "forward", mixer)
    monkeypatch.setattr(mm.Mamba2RMSNorm, "forward", rms)
    torch.manual_seed(0)
    cfg = transformers.Mamba2Config(vocab_size=100, hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2,
                                    num_hidden_layers=2, residual_in_fp32=False, layer_norm_epsilon=1e-4)
    model = fc.perturb(transformers.Mamba2ForCausalLM(cfg).double().eval())
    with torch.no_grad():                 # transformers' init makes A = 1..H, D = 1: spread them
        for layer in model.backbone.layers:
            layer.mixer.A_log.uniform_(-1, 1.5)
            layer.mixer.D.normal_(1, 0.5)
    res = _check(fc, model, tmp_path)      # (its head casts the logits to fp32: kept fp64 there)
    assert res.model.config.norm_eps == 1e-4 and res.model.config.mixer_kwargs["mamba2"]["norm_eps"] == 1e-4
