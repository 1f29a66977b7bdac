"""`quantize(..., activations="int8")`: every product of a quantized layer rounds its input to int8 per block of 32.

The PyTorch path (compute="fp32") against fp64 with x rounded by the format's definition (tests/helpers.py); the
compiled decode's logits against the same model's PyTorch path (both compute sum w x^; they may round an x
differently only where fp32 noise moves it across a rounding boundary, so the two agree far more closely than
either agrees with the float-activation model); saving and loading keeps the setting; refusals. The products
themselves: tests/cpu/test_qmatvec_a8.py."""
import ctypes
import json

import pytest
import safetensors.torch
import torch

from linattn import LanguageModel, LMConfig
from linattn.cpu import decode as cpu_decode
from linattn.cpu.qlayout import step_scales
from linattn.errors import LinattnError
from linattn.quant import QuantizedLinear, load_quantized, quantization_summary, quantize, quantized_modules
from linattn.quant.cli import load_for_inference
from linattn.quant.store import save_quantized
from tests.helpers import CompiledDecodeCalls, rounded_activations_fp64, torch_decode_twin

FORMATS = [("int8", None), ("int4", 32), ("int4", 64)]
U32 = 2.0 ** -24


@pytest.mark.parametrize("mode,group", FORMATS)
def test_layer_pytorch_path_rounds_activations(mode, group):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 128, generator=g), torch.randn(48, generator=g)
    layer = QuantizedLinear.from_weight(w, b, mode, group, compute="fp32", activations="int8")
    x = torch.randn(2, 3, 128, generator=g) * 3
    y = layer(x).double().reshape(6, 48)
    xhat, _ = rounded_activations_fp64(x.reshape(6, 128))
    W = layer.dequantize(torch.float64)
    ref = xhat @ W.t() + b.double()
    mag = xhat.abs() @ W.abs().t() + b.double().abs()
    n = 128 + 8
    assert ((y - ref).abs() <= n * U32 / (1 - n * U32) * mag * 2).all()   # (x^ rounded to fp32 once: one more ulp)
    exact = QuantizedLinear.from_weight(w, b, mode, group, compute="fp32", activations="float")(x)
    exact = exact.double().reshape(6, 48)
    assert (y - exact).abs().max() > 100 * (y - ref).abs().max()   # the rounding is there
    # the bf16 path takes the rounded x too (then rounds it to bf16, as it rounds every x)
    fast = QuantizedLinear.from_weight(w, b, mode, group, activations="int8")
    assert fast.activations == "int8" and torch.isfinite(fast(x)).all()


def test_stored_weights_and_summary():
    g = torch.Generator().manual_seed(1)
    q8 = QuantizedLinear.from_weight(torch.randn(16, 64, generator=g), None, "int8", activations="int8")
    q4 = QuantizedLinear.from_weight(torch.randn(16, 64, generator=g), None, "int4", 64, activations="int8")
    assert q8.stored_weights()[0] == "int8_a8" and q4.stored_weights()[0] == "int4_a8"
    assert QuantizedLinear.from_weight(torch.randn(16, 64), None, "int4", activations="float").stored_weights()[0] \
        == "int4"
    assert "activations='int8'" in repr(q4)
    model = LanguageModel(LMConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, mixer="gated-deltanet"))
    assert quantization_summary(quantize(model, "int8", activations="int8"))["activations"] == "int8"
    assert quantization_summary(quantize(model, "int8", activations="float"))["activations"] == "float"


def _model(n_heads=16, d_model=64, head_dim=16, layers=2, vocab=96, tie=True):
    torch.manual_seed(0)
    m = LanguageModel(LMConfig(vocab_size=vocab, d_model=d_model, n_layers=layers, n_heads=n_heads,
                               head_dim=head_dim, mixer="gated-deltanet", tie_embeddings=tie))
    with torch.no_grad():
        m.embed.weight.mul_(4)
    return m.eval()


def _step_logits(model, ids, prefill=3):
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        logits, cache = [out.logits[:, -1:]], out.cache
        for t in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(logits, 1).double()


@pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")
@pytest.mark.parametrize("mode,group", FORMATS)
@pytest.mark.parametrize("tie", [True, False])
def test_compiled_decode_matches_pytorch_path(mode, group, tie, monkeypatch):
    base = _model(tie=tie)
    q = quantize(base, mode, group_size=group, compute="fp32", activations="int8")
    exact = quantize(base, mode, group_size=group, compute="fp32", activations="float")
    calls = CompiledDecodeCalls(monkeypatch)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    ours = _step_logits(q, ids)
    assert calls.model == 6
    torch_path = _step_logits(torch_decode_twin(q), ids)
    float_act = _step_logits(torch_decode_twin(exact), ids)
    assert calls.model == 6   # (the twins ran PyTorch's path)
    err, moved = (ours - torch_path).abs().max().item(), (torch_path - float_act).abs().max().item()
    assert moved > 1e-3 and err <= 0.05 * moved + 64 * U32 * torch_path.abs().max().item()


def test_moe_experts_and_head_take_the_setting():
    """Every quantized layer rounds: a MoE's experts, the tied head's own copy, the projections."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=64, d_model=64, n_layers=1, n_heads=4, mixer="softmax", ffn="moe",
                                   n_experts=4, top_k=2, expert_hidden=64))
    q = quantize(model, "int4", activations="int8")
    mods = quantized_modules(q)
    assert any("experts_gate_up" in n for n in mods) and "lm_head" in mods
    assert {m.activations for m in mods.values()} == {"int8"}


def test_save_load_keeps_activations(tmp_path):
    q = quantize(_model(), "int4", activations="int8", compute="fp32")
    out = save_quantized(q, tmp_path / "q")
    loaded, _ = load_quantized(out)
    assert {m.activations for m in quantized_modules(loaded).values()} == {"int8"}
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, q(ids).logits)


def test_refusals():
    w = torch.randn(16, 64)
    for bad in ("int4", "fp8", "", 8):
        with pytest.raises(LinattnError, match="activations must be one of"):
            QuantizedLinear.from_weight(w, None, "int8", activations=bad)
        with pytest.raises(LinattnError, match="activations must be one of"):
            quantize(_model(), "int8", activations=bad)
    with pytest.raises(LinattnError, match="--activations needs --quantize"):
        load_for_inference("runs/nowhere", "cpu", None, None, "int8")


def test_default_activations_by_mode(tmp_path):
    """Without `activations` both modes' products round x to int8 (stored formats int8_a8 / int4_a8, the same
    rounding as activations="int8", bit for bit); "float" keeps the exact products; a folder records what it was
    written with (an int8 folder written with float activations, the old default, loads with them), and one written
    before the setting existed (no "activations" key) loads with float activations."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(32, 64, generator=g), torch.randn(3, 64, generator=g)
    for mode in ("int8", "int4"):
        q = QuantizedLinear.from_weight(w, None, mode, compute="fp32")
        assert q.activations == "int8" and q.stored_weights()[0] == f"{mode}_a8"
        assert torch.equal(q(x), QuantizedLinear.from_weight(w, None, mode, compute="fp32", activations="int8")(x))
        exact = QuantizedLinear.from_weight(w, None, mode, compute="fp32", activations="float")
        assert exact.stored_weights()[0] == mode and not torch.equal(q(x), exact(x))
    model = _model()
    assert quantization_summary(quantize(model, "int4"))["activations"] == "int8"
    assert quantization_summary(quantize(model, "int8"))["activations"] == "int8"
    assert quantization_summary(quantize(model, "int8", activations="float"))["activations"] == "float"
    out = save_quantized(quantize(model, "int8", compute="fp32", activations="float"), tmp_path / "f")
    loaded, _ = load_quantized(out)
    assert {m.activations for m in quantized_modules(loaded).values()} == {"float"}
    out = save_quantized(quantize(model, "int4", compute="fp32"), tmp_path / "q")
    manifest = json.loads((out / "quantized.json").read_text())
    assert manifest["activations"] == "int8"
    del manifest["activations"]   # a folder from before the setting: float activations, as then
    (out / "quantized.json").write_text(json.dumps(manifest))
    loaded, _ = load_quantized(out)
    assert {m.activations for m in quantized_modules(loaded).values()} == {"float"}


@pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")
@pytest.mark.parametrize("group", [32, 64])
def test_int4_a8_plan_reads_step_order_file_keeps_rows(group, tmp_path, monkeypatch):
    """An int4-a8 model's plan reads a copy of the head's scales in the product's steps' order (cpu/qlayout.py);
    the layer's `scales`, its state dict and the saved file keep them by rows (the format of folders written before
    round 15), and the loaded folder decodes to the same logits, bit for bit."""
    q = quantize(_model(tie=False, vocab=112), "int4", group_size=group, compute="fp32", activations="int8")
    head = quantized_modules(q)["lm_head"]
    rows = head.scales.clone()
    calls = CompiledDecodeCalls(monkeypatch)
    ids = torch.randint(0, 112, (2, 7), generator=torch.Generator().manual_seed(4))
    ours = _step_logits(q, ids)
    assert calls.model == 4
    n, ng = rows.shape
    plan = q._model_plan.plan
    read = torch.frombuffer(bytearray(ctypes.string_at(plan.sc_head, n * ng * 2)), dtype=torch.int16).view(n, ng)
    assert torch.equal(read, step_scales(rows).view(torch.int16))
    assert not torch.equal(read, rows.view(torch.int16))
    assert torch.equal(head.scales.view(torch.int16), rows.view(torch.int16))
    assert torch.equal(q.state_dict()["lm_head.scales"].view(torch.int16), rows.view(torch.int16))
    out = save_quantized(q, tmp_path / "q")
    saved = safetensors.torch.load_file(str(out / "quantized.safetensors"))
    assert torch.equal(saved["lm_head.scales"].view(torch.int16), rows.view(torch.int16))
    loaded, _ = load_quantized(out)
    assert torch.equal(_step_logits(loaded, ids), ours)
    assert calls.model == 8
