"""Importing flash-linear-attention (fla) model folders (issue 37 point 1): the core (`linattn.hf.fla.core`: the
registry, errors, the CLI dispatch) and the types transformer, linear_attn, gla, retnet, plus the options their
layers needed in linattn's (tested without fla first).

The strong tests build fla's OWN tiny model in fp64 (tests/fla_cpu.py runs it on the CPU: torch forms of fla's
fused norms, rotary, short conv, flash-attn; the operators of its linear layers are fla's own naive references,
each patch says which), save it with save_pretrained, convert it with `linattn.hf.import_fla`, and require the
linattn checkpoint's fp64 logits to equal fla's (<= 1e-10) and its 10 greedy tokens to equal fla's."""
import json

import pytest
import torch

from linattn.errors import CheckpointError
from linattn.layers import SoftmaxAttention
from linattn.layers.cache import LayerCache

pytest.importorskip("transformers")
# tiny fp64 tensors on shared cores: threads only contend
pytestmark = pytest.mark.usefixtures("one_thread_module")

TOL = 1e-10


# -- options added to linattn's layers (no fla needed) -------------------------------------------------------------

def _perturbed(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def test_softmax_gqa_equals_the_layer_with_repeated_kv_heads():
    torch.manual_seed(0)
    gqa = _perturbed(SoftmaxAttention(32, 4, n_kv_heads=2, qkv_bias=True).double())
    full = SoftmaxAttention(32, 4, qkv_bias=True).double()
    sd = dict(gqa.state_dict())
    for n in ("k_proj", "v_proj"):   # kv head j serves query heads 2j, 2j+1
        for what in ("weight", "bias"):
            t = sd[f"{n}.{what}"]
            sd[f"{n}.{what}"] = t.view(2, 8, *t.shape[1:]).repeat_interleave(2, dim=0).reshape(32, *t.shape[1:])
    full.load_state_dict(sd)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    assert (gqa(x) - full(x)).abs().max() <= 1e-12
    assert gqa.k_proj.weight.shape == (16, 32)


@pytest.mark.parametrize("kw", [dict(n_kv_heads=2), dict(qk_norm=True), dict(heads=2, head_dim=16, n_kv_heads=1),
                                dict(n_kv_heads=1, window=3)])
def test_softmax_options_decode_token_by_token_like_the_full_forward(kw):
    torch.manual_seed(0)
    layer = _perturbed(SoftmaxAttention(32, 4, **kw).double())
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    full = layer(x)
    cache = LayerCache()
    steps = [layer(x[:, :3], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(3, 7)]
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-12


def test_softmax_qk_norm_normalises_each_head_before_rope():
    torch.manual_seed(0)
    layer = _perturbed(SoftmaxAttention(16, 2, qk_norm=True, rope=False).double())
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    q, k, _ = layer._qkv(x, None)
    qr = layer.q_proj(x).view(1, 5, 2, 8)
    want = qr * torch.rsqrt(qr.pow(2).mean(-1, keepdim=True) + 1e-5) * layer.q_norm.weight
    assert (q - want).abs().max() <= 1e-14
    assert sorted(n for n, _ in layer.named_parameters() if "norm" in n) == ["k_norm.weight", "q_norm.weight"]


def test_softmax_defaults_keep_the_plain_layer():
    names = sorted(SoftmaxAttention(32, 4).state_dict())
    assert names == ["k_proj.weight", "o_proj.weight", "q_proj.weight", "v_proj.weight"]


@pytest.mark.parametrize("kw", [dict(n_kv_heads=3), dict(n_kv_heads=0), dict(heads=0)])
def test_softmax_bad_head_options_are_errors(kw):
    from linattn.errors import LinattnError

    with pytest.raises(LinattnError, match="heads"):
        SoftmaxAttention(48, 4, **kw)


def test_linear_scale_after_map_scales_the_features_of_q():
    from linattn.layers import LinearAttention

    torch.manual_seed(0)
    s = 0.3
    layer = _perturbed(LinearAttention(32, 2, feature_map="elu+1", normalize=False, scale=s,
                                       scale_after_map=True).double())
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    q, k, v = layer._qkv(x, None)
    fq, fk = (torch.nn.functional.elu(q) + 1) * s, torch.nn.functional.elu(k) + 1      # phi(q) * s, not phi(s q)
    att = torch.einsum("bthk,bshk->bhts", fq, fk).tril()
    want = layer._out(torch.einsum("bhts,bshv->bthv", att, v), x)
    assert (layer(x) - want).abs().max() <= 1e-12
    from linattn.errors import LinattnError

    with pytest.raises(LinattnError, match="scale_after_map"):
        LinearAttention(32, 2, feature_map="hadamard_exp", scale_after_map=True)


@pytest.mark.parametrize("kw", [dict(gate="diagonal", output_gate=True, short_conv=True),
                                dict(gate="retnet", rope=True)])
def test_linear_gqa_equals_the_layer_with_repeated_kv_heads_and_decodes_like_it(kw):
    from linattn.layers import LinearAttention

    torch.manual_seed(0)
    kw = dict(feature_map="identity", normalize=False, **kw)
    gqa = _perturbed(LinearAttention(32, 4, n_kv_heads=2, **kw).double())
    full = LinearAttention(32, 4, **kw).double()
    sd = dict(gqa.state_dict())
    for name in ("k_proj.weight", "v_proj.weight", "k_conv.weight", "v_conv.weight", "gk_proj.1.weight",
                 "gk_proj.1.bias"):
        if name in sd:   # kv head j serves query heads 2j, 2j+1
            t = sd[name]
            sd[name] = t.view(2, 8, *t.shape[1:]).repeat_interleave(2, dim=0).reshape(32, *t.shape[1:])
    full.load_state_dict(sd)
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with torch.no_grad():
        y = gqa(x)
        assert (y - full(x)).abs().max() <= 1e-12
        cache = LayerCache()
        steps = [gqa(x[:, :4], cache=cache)] + [gqa(x[:, t:t + 1], cache=cache) for t in range(4, 9)]
    assert (torch.cat(steps, dim=1) - y).abs().max() <= 1e-12


@pytest.mark.parametrize("kind", ["hadamard", "hedgehog", "t2r", "dpfp"])
def test_learned_maps_decode_token_by_token_like_the_full_forward(kind):
    from linattn.layers import LinearAttention

    torch.manual_seed(0)
    layer = _perturbed(LinearAttention(32, 4, feature_map="identity", normalize=False, scale=0.3, scale_after_map=True,
                                       learned_map=kind).double())
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache = LayerCache()
        steps = [layer(x[:, :3], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(3, 7)]
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-12
    q = torch.randn(5, 8, dtype=torch.float64)
    assert layer.feature_map.phi(q).shape[-1] == layer.feature_map.feature_dim(8)


def test_linear_normalize_add_divides_by_the_normaliser_plus_the_number_and_decodes():
    from linattn.layers import LinearAttention

    torch.manual_seed(0)
    layer = _perturbed(LinearAttention(32, 2, feature_map="elu+1", normalize=False, normalize_add=1e-3,
                                       gate="retnet").double())
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    q, k, v = layer._qkv(x, None)
    fq, fk = torch.nn.functional.elu(q * layer.scale) + 1, torch.nn.functional.elu(k) + 1
    gamma = layer.gamma.double()
    t = torch.arange(6, dtype=torch.float64)
    decay = (gamma[:, None, None] ** (t[:, None] - t[None, :])).tril()                   # [H, T, S]
    att = torch.einsum("bthk,bshk->bhts", fq, fk) * decay
    want = torch.einsum("bhts,bshv->bthv", att, v) / (att.sum(-1).transpose(1, 2)[..., None] + 1e-3)
    with torch.no_grad():
        y = layer(x)
        assert (y - layer._out(want, x)).abs().max() <= 1e-12
        cache = LayerCache()
        steps = [layer(x[:, :2], cache=cache)] + [layer(x[:, i:i + 1], cache=cache) for i in range(2, 6)]
    assert (torch.cat(steps, dim=1) - y).abs().max() <= 1e-12


def test_linear_gate_min_floors_the_diagonal_log_decay():
    from linattn.layers import LinearAttention

    torch.manual_seed(0)
    kw = dict(feature_map="identity", normalize=False, gate="diagonal")
    free = _perturbed(LinearAttention(32, 2, **kw).double())
    floored = LinearAttention(32, 2, gate_min=-0.02, **kw).double()
    floored.load_state_dict(free.state_dict())
    x = 3 * torch.randn(2, 6, 32, dtype=torch.float64)
    g0, g1 = free.log_gate(x), floored.log_gate(x)
    assert g0.min() < -0.02 and (g1 - g0.clamp_min(-0.02)).abs().max() == 0


# -- fla's own models ------------------------------------------------------------------------------------------------

fla = pytest.importorskip("fla", reason="flash-linear-attention (the dev extra) is needed to build fla's models")

from linattn.hf import import_fla  # noqa: E402
from linattn.hf.fla import supported_types  # noqa: E402
from tests.fla_cpu import build_fla, check_import, fla_cpu, save_unshared  # noqa: E402


def _strong(model, tmp_path, **kw):
    res = check_import(model, tmp_path, **kw)
    assert res.max_err <= TOL, res.max_err
    assert res.greedy_equal, (res.fla_tokens, res.linattn_tokens)
    return res


TRANSFORMERS = {
    "gqa_qknorm_bias_untied": dict(num_heads=4, num_kv_heads=2, qk_norm=True, qkv_bias=True, tie_word_embeddings=False),
    "tied_window_unfused": dict(num_heads=2, window_size=5, tie_word_embeddings=True, fuse_norm=False,
                                fuse_swiglu=False, rope_theta=500.0, intermediate_size=96, norm_eps=1e-5),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_transformer(tmp_path, name):
    from fla.models import TransformerConfig

    with fla_cpu():
        model = build_fla(TransformerConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100,
                                            **TRANSFORMERS[name]))
        res = _strong(model, tmp_path)
    c = res.model.config
    assert c.mixer == "softmax" and c.tie_embeddings == model.config.tie_word_embeddings


def _transformer_folder(tmp_path, **kw):
    from fla.models import TransformerConfig

    with fla_cpu():
        kw = {"vocab_size": 50, **kw}
        model = build_fla(TransformerConfig(hidden_size=32, num_hidden_layers=1, num_heads=2, **kw))
        model.save_pretrained(tmp_path / "fla", safe_serialization=True)
    return tmp_path / "fla"


def _rewrite_weights(folder, change):
    from safetensors.torch import load_file, save_file

    f = folder / "model.safetensors"
    sd = load_file(str(f))
    change(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


def test_unsupported_model_type_lists_the_supported_types(tmp_path):
    from linattn.hf import import_hf

    folder = _transformer_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "hgrn2"
    (folder / "config.json").write_text(json.dumps(cfg))
    for fn in (import_fla, import_hf):
        with pytest.raises(CheckpointError, match="hgrn2") as e:
            fn(folder, tmp_path / "run")
        assert "transformer" in str(e.value) and "gla" in str(e.value)
    assert {"transformer", "linear_attn", "gla", "retnet"} <= set(supported_types())


def test_a_missing_tensor_is_named(tmp_path):
    folder = _transformer_folder(tmp_path)
    _rewrite_weights(folder, lambda sd: sd.pop("model.layers.0.attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.attn\.k_proj\.weight"):
        import_fla(folder, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["model.layers.0.attn.extra.weight", "model.something_else"])
def test_a_tensor_the_import_does_not_use_is_named(tmp_path, name):
    folder = _transformer_folder(tmp_path)
    _rewrite_weights(folder, lambda sd: sd.__setitem__(name, torch.zeros(3)))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        import_fla(folder, tmp_path / "run")


def test_an_option_linattn_lacks_is_an_error(tmp_path):
    folder = _transformer_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_act"] = "powlu"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="powlu"):
        import_fla(folder, tmp_path / "run")


def test_sharded_weights_and_existing_output(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _transformer_folder(tmp_path)
    sd = load_file(str(folder / "model.safetensors"))
    names = sorted(sd)
    half = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for f, ns in half.items():
        save_file({n: sd[n] for n in ns}, str(folder / f), metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, ns in half.items() for n in ns}}))
    step = import_fla(folder, tmp_path / "run")
    assert (step / "model.safetensors").is_file()
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        import_fla(folder, tmp_path / "run")
    import_fla(folder, tmp_path / "run", overwrite=True)


def test_bf16_weights_load_into_the_default_fp32_model(tmp_path):
    from fla.models import TransformerConfig

    from linattn import checkpoint as ckpt

    with fla_cpu():
        model = build_fla(TransformerConfig(hidden_size=32, num_hidden_layers=2, num_heads=2, vocab_size=50))
        model.to(torch.bfloat16).save_pretrained(tmp_path / "fla", safe_serialization=True)
        ids = torch.randint(0, 50, (1, 12))
        with torch.no_grad():
            ref = model.double()(input_ids=ids, use_cache=False).logits     # fp64 of the same bf16 weights
    lm = ckpt.load_checkpoint(import_fla(tmp_path / "fla", tmp_path / "run")).model
    assert next(lm.parameters()).dtype == torch.float32
    with torch.no_grad():
        assert (lm(ids).logits.double() - ref).abs().max() <= 1e-4


def test_the_tokenizer_comes_along_and_a_foreign_one_is_left_out_with_a_warning(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from linattn import checkpoint as ckpt
    from linattn.data.tokenizer import train_tokenizer

    folder = _transformer_folder(tmp_path, vocab_size=300)  # a tokenizer larger than the vocabulary is refused
    tok = train_tokenizer("def f(x):\n    return x + 1\n" * 50, vocab_size=300)
    (folder / "tokenizer.json").write_text(tok.backend.to_str())
    ck = ckpt.load_checkpoint(import_fla(folder, tmp_path / "run"))
    assert ck.tokenizer is not None and ck.tokenizer.encode("return x") == tok.encode("return x")
    (folder / "tokenizer.json").write_text(Tokenizer(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).to_str())
    with pytest.warns(UserWarning, match="without a tokenizer"):
        step = import_fla(folder, tmp_path / "run2")
    assert ckpt.load_checkpoint(step).tokenizer is None


def test_cli_import_hf_dispatches_to_fla_and_export_hf_takes_the_result(tmp_path, capsys):
    from linattn.cli import main
    from tests.fla_cpu import fla_logits, load_linattn

    folder = _transformer_folder(tmp_path, num_kv_heads=1)
    assert main(["import-hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 0
    assert "wrote" in capsys.readouterr().out
    from fla.models import TransformerForCausalLM

    with fla_cpu():
        model = TransformerForCausalLM.from_pretrained(folder, torch_dtype=torch.float64).eval()
        ids = torch.randint(0, 50, (1, 11))
        ref = fla_logits(model, ids)
    lm = load_linattn(tmp_path / "run")
    with torch.no_grad():
        assert (lm(ids).logits - ref).abs().max() <= TOL
    assert main(["export-hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
    with torch.no_grad():   # transformers' generate (its own cache, GQA kv heads) continues as linattn's does
        assert torch.equal(hf.generate(ids, max_new_tokens=6, do_sample=False), lm.generate(ids, 6, temperature=0))
    # an unsupported folder through the CLI: one line naming the supported types, exit status 2 (usage) or 1
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "not_a_type"
    (folder / "config.json").write_text(json.dumps(cfg))
    assert main(["import-hf", "--model", str(folder), "--out", str(tmp_path / "run2")]) != 0
    err = capsys.readouterr().err
    assert "not_a_type" in err and "transformer" in err


# -- the linear types: their operators in fp64 -----------------------------------------------------------------------
# fla's naive references (fla/ops/{gla,linear_attn,retention}/naive.py) compute in fp32 (`.float()`), which cannot
# meet 1e-10; each patch below is the same recurrence written in fp64 (token by token, from the formula), and
# checks itself against fla's naive reference in fp32 (so it computes what fla's kernel computes).

def _gated_scan(q, k, v, log_decay, scale):
    """o_t = scale q_t^T S_t, S_t = exp(log_decay_t) * S_{t-1} + k_t v_t^T; q, k [B, T, H, K], v [B, T, H, V],
    log_decay [B, T, H, K] (per feature), [B, T, H] (per head) or None; fp64."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(T):
        if log_decay is not None:
            a = log_decay[:, t].double().exp()
            S = S * (a[..., None] if a.dim() == 3 else a[..., None, None])
        S = S + k[:, t].double()[..., None] * v[:, t].double()[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t].double() * scale, S))
    return torch.stack(out, dim=1)


def _gla_op(q, k, v, gk=None, g=None, scale=None, initial_state=None, output_final_state=False, **kw):
    from fla.ops.gla.naive import naive_recurrent_gla

    assert initial_state is None and not output_final_state and kw.get("cu_seqlens") is None
    gk = gk if gk is not None else g
    o = _gated_scan(q, k, v, gk, q.shape[-1] ** -0.5 if scale is None else scale)
    o32, _ = naive_recurrent_gla(q, k, v, gk)
    assert (o32.double() - o).abs().max() <= 1e-4 * (1 + o.abs().max())
    return o.to(q.dtype), None


GLA_OPS = {f"fla.layers.gla.{n}": _gla_op for n in ("chunk_gla", "fused_chunk_gla", "fused_recurrent_gla")}

GLAS = {
    "plain": dict(num_heads=2),
    "conv_clamp_unfused_tied": dict(num_heads=4, expand_k=1.0, use_short_conv=True, clamp_min=-0.05, fuse_norm=False,
                                    tie_word_embeddings=True),
    "gqa_conv": dict(num_heads=4, num_kv_heads=2, use_short_conv=True),
    "relu_map": dict(num_heads=2, feature_map="relu"),
    "no_output_gate": dict(num_heads=2, use_output_gate=False, expand_v=2.0),
    "hybrid_attn": dict(num_heads=2, attn={"layers": [1], "num_heads": 4, "num_kv_heads": 2, "qkv_bias": True,
                                           "window_size": 9, "rope_theta": 1000.0}),
}


@pytest.mark.parametrize("name", sorted(GLAS))
def test_gla(tmp_path, name):
    from fla.models import GLAConfig

    with fla_cpu(GLA_OPS):
        model = build_fla(GLAConfig(hidden_size=64, num_hidden_layers=3, vocab_size=100, **GLAS[name]))
        res = _strong(model, tmp_path)
    mixers = res.model.config.mixer_list()
    assert mixers == (["gla", "softmax", "gla"] if "attn" in GLAS[name] else ["gla"] * 3)


def _retention_op(q, k, v, scale=None, initial_state=None, output_final_state=False, **kw):
    from fla.ops.retention.naive import naive_retention

    assert initial_state is None and not output_final_state and kw.get("cu_seqlens") is None
    H = q.shape[2]
    log_gamma = torch.log1p(-(2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64))))
    o = _gated_scan(q, k, v, log_gamma.expand(q.shape[0], q.shape[1], H), q.shape[-1] ** -0.5 if scale is None
                    else scale)
    o32 = naive_retention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    assert (o32.double() - o).abs().max() <= 1e-4 * (1 + o.abs().max())
    return o.to(q.dtype), None


RETNET_OPS = {f"fla.layers.multiscale_retention.{n}": _retention_op
              for n in ("chunk_retention", "fused_chunk_retention", "parallel_retention", "fused_recurrent_retention")}

RETNETS = {
    "plain": dict(num_heads=2),
    "gqa": dict(num_heads=4, num_kv_heads=1),
    "no_gate_unfused_tied": dict(num_heads=4, expand_v=1.0, use_output_gate=False, fuse_norm=False,
                                 tie_word_embeddings=True),
    "hybrid_attn": dict(num_heads=2, attn={"layers": [0], "num_heads": 2}),
}


@pytest.mark.parametrize("name", sorted(RETNETS))
def test_retnet(tmp_path, name):
    from fla.models import RetNetConfig

    with fla_cpu(RETNET_OPS):
        model = build_fla(RetNetConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100, **RETNETS[name]))
        res = _strong(model, tmp_path)
    assert res.model.config.mixer_list()[1] == "retnet"


def _linear_op(q, k, v, scale=None, initial_state=None, output_final_state=False, normalize=False, **kw):
    from fla.ops.linear_attn.naive import naive_recurrent_linear_attn

    assert initial_state is None and not output_final_state and kw.get("cu_seqlens") is None
    s = q.shape[-1] ** -0.5 if scale is None else scale
    o = _gated_scan(q, k, v, None, s)
    if normalize:   # fla: o / ((scale q) . cumsum k + 1e-10)
        o = o / ((q.double() * s * k.double().cumsum(1)).sum(-1, keepdim=True) + 1e-10)
    o32, _ = naive_recurrent_linear_attn(q, k, v, scale=scale, normalize=normalize)
    assert (o32.double() - o).abs().max() <= 1e-4 * (1 + o.abs().max())
    return o.to(q.dtype), None


LINEAR_OPS = {f"fla.layers.linear_attn.{n}": _linear_op
              for n in ("chunk_linear_attn", "fused_chunk_linear_attn", "fused_recurrent_linear_attn")}

LINEARS = {
    "elu": dict(num_heads=2, feature_map="elu"),
    "relu_expand_tied": dict(num_heads=4, feature_map="relu", expand_k=0.5, expand_v=2.0, tie_word_embeddings=True),
    "elu_gqa": dict(num_heads=4, num_kv_heads=2, feature_map="elu"),
    "hadamard_default": dict(num_heads=2),
    "hadamard_tied": dict(num_heads=2, feature_map="elementwise_product", tie_feature_map_qk=True),
    "hedgehog": dict(num_heads=4, feature_map="hedgehog"),
    "t2r_tied": dict(num_heads=2, feature_map="t2r", tie_feature_map_qk=True),
    "dpfp": dict(num_heads=4, feature_map="dpfp", expand_k=0.5),
    "elu_norm_qk": dict(num_heads=2, feature_map="elu", norm_q=True, norm_k=True),
    "hadamard_norm_k": dict(num_heads=2, norm_k=True),
    "elu_norm_feature_map": dict(num_heads=2, feature_map="elu", norm_feature_map=True),
    "identity_hybrid_attn": dict(num_heads=2, feature_map="identity", attn={"layers": [1], "num_heads": 2}),
}


@pytest.mark.parametrize("name", sorted(LINEARS))
def test_linear_attn(tmp_path, name):
    from fla.models import LinearAttentionConfig

    with fla_cpu(LINEAR_OPS):
        model = build_fla(LinearAttentionConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100, **LINEARS[name]))
        # fla's save_pretrained refuses its own tied feature maps (shared tensors): written name by name instead
        res = _strong(model, tmp_path, save=save_unshared if name.endswith("_tied") else None)
    fm = LINEARS[name].get("feature_map", "elementwise_product")
    assert res.model.config.mixer_list()[0] == "linear-" + {"elu": "elu+1", "relu": "relu"}.get(fm, "identity")
    if "num_kv_heads" in LINEARS[name]:
        assert res.model.blocks[0].mixer.k_proj.weight.shape[0] == 32


def test_hybrid_attention_layers_with_different_settings_are_an_error(tmp_path):
    from fla.models import GLAConfig

    with fla_cpu(GLA_OPS):
        model = build_fla(GLAConfig(hidden_size=32, num_hidden_layers=3, num_heads=2, vocab_size=50,
                                    attn=[{"layers": [0], "num_heads": 2}, {"layers": [2], "num_heads": 4}]))
        model.save_pretrained(tmp_path / "fla", safe_serialization=True)
    with pytest.raises(CheckpointError, match="one set of options"):
        import_fla(tmp_path / "fla", tmp_path / "run")
