"""linattn.quantize on whole models: a linattn LanguageModel (projections, SwiGLU, MoE experts, memory lobe, tied
or untied head) and a kernelized transformers Qwen3.5 model, each against the same model with the dequantized
weights put back as float nn.Linear weights (fp64, where both compute the same products: equal to fp64
rounding); cached decoding on main's compiled decode path; the saved format; the refusals."""
import copy

import pytest
import torch
from torch import nn

import linattn
from linattn import LanguageModel, LMConfig
from linattn.errors import CheckpointError, LinattnError, LinattnTypeError
from linattn.quant import (
    QuantizedLinear,
    QuantizedMoE,
    is_quantized_dir,
    load_quantized,
    quantization_summary,
    quantized_modules,
    save_quantized,
)

FP64_RTOL = 1e-10      # fp64 rounding of the same products in a different order, through a few layers


def _config(**kw):
    args = dict(vocab_size=96, d_model=64, n_layers=2, n_heads=2, mixer="gated-deltanet", max_seq_len=64)
    args.update(kw)
    return LMConfig(**args)


def _model(dtype=torch.float64, **kw):
    torch.manual_seed(0)
    return LanguageModel(_config(**kw)).to(dtype).eval()


def _module(root, name):
    for part in name.split("."):
        root = getattr(root, part)
    return root


def dequantized_reference(model: nn.Module, qmodel: nn.Module) -> nn.Module:
    """`model` with every weight that `qmodel` quantized replaced by its dequantized value (in model's dtype)."""
    ref = copy.deepcopy(model)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for name, q in quantized_modules(qmodel).items():
            w = q.dequantize(torch.float64).to(dtype)
            parent, attr = name.rsplit(".", 1) if "." in name else ("", name)
            if parent.endswith(("experts_gate_up", "experts_down")):        # a QuantizedMoE's expert e
                moe_name, which = parent.rsplit(".", 1)
                stack = getattr(_module(ref, moe_name), "w_gate_up" if which == "experts_gate_up" else "w_down")
                stack[int(attr)] = w.t()
            elif name == "lm_head" and getattr(ref, "lm_head", 0) is None:    # a tied head: untied in the reference
                ref.lm_head = nn.Linear(w.shape[1], w.shape[0], bias=False).to(dtype)
                ref.lm_head.weight.copy_(w)
            else:   # a new Parameter: a head tied to the embedding is untied, the embedding keeps its float rows
                _module(ref, name).weight = nn.Parameter(w.clone())
    return ref


def _close(a, b, rtol=FP64_RTOL):
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= rtol * scale, (a - b).abs().max().item()


CASES = {
    "gdn-swiglu-tied": dict(),
    "gdn-swiglu-untied": dict(tie_embeddings=False),
    "softmax-moe": dict(mixer="softmax", ffn="moe", n_experts=4, top_k=2, expert_hidden=64),
    "ela-gpt-lobe": dict(mixer="ela-hadamard_exp", ffn="moe", n_experts=4, top_k=2, residual="hyperlink",
                         final_norm=False, memory_lobe="causal"),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mode, group", [("int8", None), ("int4", 32), ("int4", 64)])
def test_lm_logits_equal_the_dequantized_reference(case, mode, group):
    model = _model(**CASES[case])
    qmodel = linattn.quantize(model, mode, group_size=group, compute="fp32", activations="float")
    ref = dequantized_reference(model, qmodel)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _close(qmodel(ids).logits, ref(ids).logits)
    names = quantized_modules(qmodel)
    assert "lm_head" in names and isinstance(qmodel.lm_head, QuantizedLinear)
    assert isinstance(qmodel.embed, nn.Embedding) and torch.equal(qmodel.embed.weight, model.embed.weight)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    n_left = sum(type(m) is nn.Linear for m in qmodel.modules())
    skipped = quantization_summary(qmodel)["skipped"]
    moe = [m for m in qmodel.modules() if isinstance(m, QuantizedMoE)]
    assert n_left == len(skipped) + len(moe)          # every linear is quantized, skipped (named) or a router
    tied = model.lm_head is None
    assert len(moe) == (2 if CASES[case].get("ffn") == "moe" else 0)
    assert len(names) == n_linear - n_left + sum(2 * m.n_experts for m in moe) + tied
    assert not quantized_modules(model)                                   # the float model is untouched


def test_int4_leaves_shapes_it_cannot_take_in_float_and_names_them():
    qmodel = linattn.quantize(_model(), "int4")
    skipped = quantization_summary(qmodel)["skipped"]
    # Gated DeltaNet's beta / gate projections have n_heads = 2 outputs (torch's int4 packing needs 16)
    assert skipped and all("multiple of 16" in why for why in skipped.values())
    assert all(type(_module(qmodel, n)) is nn.Linear for n in skipped)
    int8 = linattn.quantize(_model(), "int8")
    assert quantization_summary(int8)["skipped"] == {}


def test_the_float_model_is_kept_unless_inplace():
    model = _model(torch.float32)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    linattn.quantize(model, "int8")
    assert not quantized_modules(model) and all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    same = linattn.quantize(model, "int8", inplace=True)
    assert same is model and quantized_modules(model)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_cached_decoding_equals_the_full_forward_and_the_float_models_compiled_decode(mode):
    """main's compiled decode takes only nn.Linear weights: the quantized blocks step aside to the per-block
    PyTorch path, whose decoded logits equal the full forward's and the float reference's compiled decode."""
    model = _model()
    qmodel = linattn.quantize(model, mode, compute="fp32", activations="float")
    ref = dequantized_reference(model, qmodel)
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = qmodel(ids).logits
        for m in (qmodel, ref):
            out = m(ids[:, :5], use_cache=True)
            steps = [out.logits[:, -1]]
            for t in range(5, 12):
                out = m(ids[:, t:t + 1], cache=out.cache)
                steps.append(out.logits[:, -1])
            _close(torch.stack(steps, 1), full[:, 4:])
        x = torch.zeros(1, 1, 64, dtype=torch.float64)
        for block in qmodel.blocks:
            if hasattr(block, "fast_parts"):
                assert block.fast_parts(x) is None             # the quantized SwiGLU is not an nn.Linear
        greedy = qmodel.generate(ids[:, :4], 16, temperature=0)
        assert torch.equal(greedy, ref.generate(ids[:, :4], 16, temperature=0))


def test_bf16_compute_generates_on_the_fast_kernels():
    model = _model(torch.float32)
    for mode in ("int8", "int4"):
        qmodel = linattn.quantize(model, mode)
        with torch.no_grad():
            out = qmodel.generate(torch.tensor([[1, 2, 3]]), 8, temperature=0)
        assert out.shape == (1, 11)


def test_refusals():
    model = _model(torch.float32)
    qmodel = linattn.quantize(model, "int8")
    with pytest.raises(LinattnError, match="already quantized"):
        linattn.quantize(qmodel, "int4")
    with pytest.raises(LinattnError, match="mode must be one of"):
        linattn.quantize(model, "fp8")
    with pytest.raises(LinattnError, match="group_size must be one of"):
        linattn.quantize(model, "int4", group_size=48)
    with pytest.raises(LinattnError, match="compute must be one of"):
        linattn.quantize(model, "int8", compute="int8")
    with pytest.raises(LinattnTypeError, match="nn.Module"):
        linattn.quantize(model.state_dict(), "int8")
    ids = torch.randint(0, 96, (1, 8))
    loss = qmodel(ids, targets=ids).loss                    # the embedding still has grads: the forward runs
    with pytest.raises(LinattnError, match="backward through quantized weights"):
        loss.backward()
    with pytest.raises(LinattnError, match="CPU only"):
        linattn.quantize(LanguageModel(_config()).to("meta"), "int8")
    bad = _model(torch.float32)
    with torch.no_grad():
        bad.blocks[0].ffn.w_down.weight[0, 0] = float("nan")
    with pytest.raises(LinattnError, match="blocks.0.ffn.w_down.*NaN or inf"):
        linattn.quantize(bad, "int8")


@pytest.mark.parametrize("case", ["gdn-swiglu-tied", "softmax-moe"])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_saved_format_round_trip(tmp_path, case, mode):
    qmodel = linattn.quantize(_model(torch.float32, **CASES[case]), mode)
    out = save_quantized(qmodel, tmp_path / "q")
    assert is_quantized_dir(out) and (out / "quantized.safetensors").is_file()
    loaded, tokenizer = load_quantized(out)
    assert tokenizer is None
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, qmodel(ids).logits)
        assert torch.equal(loaded(ids[:, :1]).logits, qmodel(ids[:, :1]).logits)   # the packed-kernel path too
    assert quantization_summary(loaded) == quantization_summary(qmodel)
    with pytest.raises(CheckpointError, match="exists"):
        save_quantized(qmodel, out)
    save_quantized(qmodel, out, overwrite=True)


def test_saved_format_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(LinattnError, match="not quantized"):
        save_quantized(_model(torch.float32), tmp_path / "f")
    out = save_quantized(linattn.quantize(_model(torch.float32), "int8"), tmp_path / "q")
    manifest = (out / "quantized.json").read_text()
    (out / "quantized.json").write_text(manifest.replace('"version": 1', '"version": 99'))
    with pytest.raises(CheckpointError, match="version 1"):
        load_quantized(out)
    (out / "quantized.json").write_text(manifest)
    (out / "quantized.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="cannot load the quantized model"):
        load_quantized(out)


# --------------------------------------------------------------------------- transformers models (kernelized)

def _qwen3_5(dtype):
    transformers = pytest.importorskip("transformers")
    cls, cfg_cls = getattr(transformers, "Qwen3_5ForCausalLM", None), getattr(transformers, "Qwen3_5TextConfig", None)
    if cls is None or cfg_cls is None:
        pytest.skip("this transformers has no Qwen3.5")
    torch.manual_seed(0)
    cfg = cfg_cls(vocab_size=96, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                  linear_conv_kernel_dim=4, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    return cls(cfg).to(dtype).eval()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_kernelized_qwen3_5_equals_its_dequantized_reference(mode):
    model = _qwen3_5(torch.float64)
    from linattn.hf import kernelize

    kernelize(model)
    qmodel = linattn.quantize(model, mode, compute="fp32", activations="float")
    assert isinstance(qmodel.lm_head, QuantizedLinear)                       # the tied head: its own copy
    assert qmodel.model.embed_tokens.weight.dtype == torch.float64
    ref = dequantized_reference(model, qmodel)
    ids = torch.randint(3, 96, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _close(qmodel(ids).logits, ref(ids).logits)
        g = qmodel.generate(ids[:, :5], max_new_tokens=12, do_sample=False)
        assert torch.equal(g, ref.generate(ids[:, :5], max_new_tokens=12, do_sample=False))
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert len(quantized_modules(qmodel)) + len(quantization_summary(qmodel)["skipped"]) == n_linear


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_kernelized_qwen3_5_prefill_takes_the_cpus_path(mode, monkeypatch):
    """A kernelized transformers model's prefill runs its quantized projections through `QuantizedLinear` and so
    through `product_path`'s choice: without bf16 instructions every many-rows product takes the fp32 path, and
    its logits stay within bf16 rounding of the bf16 path's."""
    from linattn.hf import kernelize
    from linattn.quant import linear as qlinear

    model = _qwen3_5(torch.float32)
    kernelize(model)
    qmodel = linattn.quantize(model, mode, activations="float")
    ids = torch.randint(3, 96, (2, 66), generator=torch.Generator().manual_seed(3))   # 132 rows a product
    logits, paths = {}, {}
    for native in (True, False):
        seen = []
        real = qlinear.product_path
        monkeypatch.setattr(qlinear, "native_bf16", lambda native=native: native)
        monkeypatch.setattr(qlinear, "product_path", lambda m, r, b: seen.append((r, real(m, r, b))) or seen[-1][1])
        with torch.no_grad():
            logits[native] = qmodel(ids).logits
        paths[native] = seen
        monkeypatch.setattr(qlinear, "product_path", real)
    n_quantized = len(quantized_modules(qmodel))
    assert len(paths[False]) == n_quantized and {p for _, p in paths[False]} == {"fp32"}
    assert {r for r, _ in paths[False]} == {132}
    assert {p for _, p in paths[True]} == {"bf16"}
    _close(logits[False], logits[True], rtol=0.05)
