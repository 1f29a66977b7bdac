"""int8 / int4 weights in the compiled CPU decode (cpu/csrc/qmatvec.h, models/decode_plan.py).

The products against the dequantized matrix's product in fp64, within a bound computed from the fp32 summation
(|y - y64| <= gamma_{m + 8} * sum |w x| and the bias / residual added: the integer weights and their scales are
exact in fp32, so nothing else can differ); whole models (block plans and the whole-model plan, a tied head
quantized separately) against the same model with the dequantized weights in fp64, within a multiple of PyTorch's
own fp32 error on that model; greedy `generate` against the quantized model's PyTorch path; the plan's guard on
every change of the quantized weights. The compiled calls are counted, so a comparison cannot pass by taking the
same path twice."""
import copy

import pytest
import torch

from linattn import LanguageModel, LMConfig
from linattn.cpu import decode as cpu_decode
from linattn.errors import LinattnError
from linattn.models import decode_plan
from linattn.quant import QuantizedLinear, quantize, quantized_modules
from tests.helpers import (
    CompiledDecodeCalls,
    StoredWeights as _Stored,
    check_product_threads,
    check_quantized_product as _check_product,
    dequantized_fp64,
    torch_decode_twin,
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

U32 = 2.0 ** -24
FORMATS = [("int8", None), ("int4", 32), ("int4", 64)]


def _qlinear(n, k, mode, group, seed=0, bias=False):
    return _Stored(n, k, mode, group, seed, bias)


# -- the products ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,group", FORMATS)
@pytest.mark.parametrize("n,k", [(16, 64), (16, 192), (48, 320), (4, 64), (32, 128), (13, 64), (1, 128), (6, 192),
                                 (8, 1088), (5, 2048)])
@pytest.mark.parametrize("B", [1, 3])
def test_product_matches_dequantized_fp64(mode, group, n, k, B):
    if mode == "int4" and k % group:
        pytest.skip("int4 needs in_features a multiple of the group")
    q = _qlinear(n, k, mode, group, bias=True)
    x = torch.randn(B, k, generator=torch.Generator().manual_seed(1))
    add = torch.randn(B, n, generator=torch.Generator().manual_seed(2))
    _check_product(q, x)
    _check_product(q, x, bias=q.bias, add=add)


@pytest.mark.parametrize("n,k", [(13, 37), (5, 1), (3, 16), (7, 100), (1, 17)])
def test_int8_odd_sizes(n, k):
    """in_features not a multiple of the vector (16) and out_features not of the 4 rows read at once."""
    q = _qlinear(n, k, "int8", None)
    for B in (1, 2):
        _check_product(q, torch.randn(B, k, generator=torch.Generator().manual_seed(B)))


@pytest.mark.parametrize("mode,group", FORMATS)
def test_product_threads(mode, group):
    """Big enough for the parallel rows (the threshold in qmatvec.h): 1 and 2 threads, the same bits."""
    check_product_threads(_qlinear(528, 512, mode, group, bias=True),
                          torch.randn(2, 512, generator=torch.Generator().manual_seed(3)))


@pytest.mark.parametrize("mode,group", FORMATS)
def test_product_hostile_inputs(mode, group):
    q = _qlinear(16, 64, mode, group)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4))
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    y = cpu_decode.weight_matvec(x, q.mode, q.stored, q.scales, q.group)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()
    col = q.dequantize(torch.float64)[:, 7]   # inf times a weight: +-inf, or NaN where the weight is 0
    want = torch.where(col == 0, float("nan"), torch.sign(col) * float("inf"))
    assert torch.equal(torch.isnan(y[2]), torch.isnan(want)) and torch.equal(y[2][col != 0].double(), want[col != 0])
    _check_product(q, torch.randn(2, 64, generator=torch.Generator().manual_seed(5)) * 1e-38)   # subnormal products
    _check_product(q, torch.randn(2, 64, generator=torch.Generator().manual_seed(6)) * 1e30)


def test_product_bad_arguments():
    q = _qlinear(16, 64, "int4", 32)
    x = torch.randn(1, 64)
    with pytest.raises(LinattnError, match="scales"):
        cpu_decode.weight_matvec(x, "int4", q.stored, q.scales, 64)
    with pytest.raises(LinattnError, match="x must be float32"):
        cpu_decode.weight_matvec(x.double(), "int4", q.stored, q.scales, 32)
    with pytest.raises(LinattnError, match="fmt"):
        cpu_decode.weight_matvec(x, "int2", q.stored, q.scales, 32)
    with pytest.raises(LinattnError, match="W must be"):
        cpu_decode.weight_matvec(x, "int8", q.stored, q.scales)
    with pytest.raises(LinattnError, match="bias must be"):
        cpu_decode.weight_matvec(x, "int4", q.stored, q.scales, 32, bias=torch.zeros(3))


# -- whole models ------------------------------------------------------------------------------------------------
def _model(dtype=torch.float32, n_heads=16, d_model=64, head_dim=16, layers=2, vocab=96, **kw):
    """A small Gated DeltaNet LM whose value heads (16) let int4 take every projection; norms and biases moved."""
    torch.manual_seed(0)
    m = LanguageModel(LMConfig(vocab_size=vocab, d_model=d_model, n_layers=layers, n_heads=n_heads,
                               head_dim=head_dim, mixer="gated-deltanet", **kw)).to(dtype)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or "A_log" in n or n.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        m.embed.weight.mul_(4)   # logits of a few units: greedy ties are rare
    return m.eval()


def _step_logits(model, ids, prefill=3):
    """Logits of the prefill's last token and of every later token decoded one at a time on the cache."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        logits, cache = [out.logits[:, -1:]], out.cache
        for t in range(prefill, ids.shape[1]):
            logits.append(model(ids[:, t:t + 1], cache=cache).logits)
    return torch.cat(logits, 1)


def _assert_close_to_reference(qmodel, ids, calls):
    """The compiled decode's logits vs the dequantized model in fp64, within 4x the error of PyTorch's own fp32
    products on the same weights (the dequantized model in fp32, compiled decode off) plus a few ulps."""
    ours = _step_logits(qmodel, ids).double()
    assert calls.model + calls.block > 0
    n = calls.model + calls.block
    ref = _step_logits(torch_decode_twin(dequantized_fp64(qmodel)), ids)
    torch_fp32 = _step_logits(torch_decode_twin(dequantized_fp64(qmodel).float()), ids).double()
    assert calls.model + calls.block == n
    err, err_torch = (ours - ref).abs().max().item(), (torch_fp32 - ref).abs().max().item()
    bound = 4 * err_torch + 16 * U32 * ref.abs().max().item()
    assert err <= bound, f"compiled decode error {err:.3g} > {bound:.3g} (torch fp32: {err_torch:.3g})"
    return ours


@pytest.mark.parametrize("mode,group", FORMATS)
@pytest.mark.parametrize("tie", [True, False])
def test_model_plan_matches_dequantized(mode, group, tie, monkeypatch):
    """The whole-model plan (embedding, blocks, final norm, quantized head: a tied head gets its own), batch 2."""
    q = quantize(_model(tie_embeddings=tie), mode, group_size=group, compute="fp32",
                 activations="float")   # (the prefill's products)
    assert "lm_head" in quantized_modules(q)
    calls = CompiledDecodeCalls(monkeypatch)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    _assert_close_to_reference(q, ids, calls)
    assert calls.model == 6 and calls.block == 0


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4", 32)])
def test_model_plan_threads(mode, group, monkeypatch):
    """At 2 threads the big products (the head here) split their rows over the threads: the same logits, bit for
    bit, as at 1 thread (each row's sums are the same); the plan is rebuilt for the new thread count."""
    q = quantize(_model(d_model=256, vocab=1024), mode, group_size=group, compute="fp32", activations="float")
    calls = CompiledDecodeCalls(monkeypatch)
    ids = torch.randint(0, 1024, (2, 6), generator=torch.Generator().manual_seed(7))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _step_logits(q, ids, prefill=1)   # (a one-token prompt runs the compiled blocks too)
        built = decode_plan.rebuilds[0]
        torch.set_num_threads(2)
        two = _step_logits(q, ids, prefill=1)
    finally:
        torch.set_num_threads(old)
    assert calls.model == 10 and decode_plan.rebuilds[0] > built   # (the prompt: the block calls)
    assert torch.equal(one, two)


@pytest.mark.parametrize("mode,group", FORMATS)
def test_block_plans_match_dequantized(mode, group, monkeypatch):
    """The per-block plans (the whole-model step off), batch 1, a prompt of one token."""
    q = quantize(_model(), mode, group_size=group, compute="fp32", activations="float")
    q.compiled_decode = False
    calls = CompiledDecodeCalls(monkeypatch)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = q(ids[:, :1], use_cache=True)
        ours, cache = [out.logits], out.cache
        for t in range(1, ids.shape[1]):
            ours.append(q(ids[:, t:t + 1], cache=cache).logits)
    assert calls.block == 2 * ids.shape[1] and calls.model == 0   # (a one-token prompt decodes as a token)
    ref = dequantized_fp64(q)
    with torch.no_grad():
        want = ref(ids).logits
    torch_fp32 = torch_decode_twin(dequantized_fp64(q).float())
    with torch.no_grad():
        err_torch = (torch_fp32(ids).logits.double() - want).abs().max().item()
    err = (torch.cat(ours, 1).double() - want).abs().max().item()
    assert err <= 4 * err_torch + 16 * U32 * want.abs().max().item()


def test_int8_odd_width_model(monkeypatch):
    """d_model 40 and FFN width 72: rows not a multiple of the vector width (int8 takes any shape)."""
    q = quantize(_model(d_model=40, head_dim=8, n_heads=4, ffn_hidden=72), "int8", compute="fp32",
                 activations="float")
    calls = CompiledDecodeCalls(monkeypatch)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(2))
    _assert_close_to_reference(q, ids, calls)
    assert calls.model > 0


def test_int4_skipped_projection_falls_back(monkeypatch):
    """int4 with 2 value heads leaves the beta / decay projections (2 rows) in float: the fused projection would mix
    formats, so the block runs its usual path, with the same results as the compiled decode switched off."""
    q = quantize(_model(n_heads=2, head_dim=32), "int4")
    assert any("b_proj" in k for k in q._linattn_quant_skipped)
    calls = CompiledDecodeCalls(monkeypatch)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(3))
    got = _step_logits(q, ids)
    assert calls.model == 0 and calls.block == 0
    assert torch.equal(got, _step_logits(torch_decode_twin(q), ids))


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4", 32)])
def test_bf16_and_fp64_models(mode, group, monkeypatch):
    """A bf16 model's plan computes in fp32 (bf16 logits); an fp64 model's quantized linears are not planned (the
    plans compute quantized products in fp32 only): its usual path runs."""
    calls = CompiledDecodeCalls(monkeypatch)
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(4))
    qb = quantize(_model(torch.bfloat16), mode, group_size=group)
    got = _step_logits(qb, ids)
    assert got.dtype == torch.bfloat16 and calls.model > 0
    ref = _step_logits(torch_decode_twin(dequantized_fp64(qb)), ids)
    assert (got.double() - ref).abs().max() <= 0.05 * ref.abs().max()   # bf16 embedding rows and logits
    n = calls.model + calls.block
    qd = quantize(_model(torch.float64), mode, group_size=group)
    got = _step_logits(qd, ids)
    assert calls.model + calls.block == n
    assert torch.equal(got, _step_logits(torch_decode_twin(qd), ids))


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4", 32)])
def test_generate_greedy_matches_pytorch_path(mode, group, monkeypatch):
    """Greedy `generate` on the compiled decode gives the tokens of the quantized model's PyTorch path (torch's packed
    kernels, bf16 activations): both paths' logits along the PyTorch path's tokens are within REL of the largest
    logit (bf16 rounding of every product's inputs, 2^-9 relative, through two layers), so wherever the top two
    logits are further apart than twice that, the choices must agree (at every such step teacher-forced, and in
    `generate`'s own output up to the first step where they are not; then either choice is right); most steps
    are checked."""
    rel = 0.02
    q = quantize(_model(tie_embeddings=False), mode, group_size=group)   # (a tied head repeats the last token)
    calls = CompiledDecodeCalls(monkeypatch)
    prompt = torch.randint(0, 96, (2, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = q.generate(prompt, 24, temperature=0)
    assert calls.model > 0
    torch_path = torch_decode_twin(q)
    n = calls.model
    with torch.no_grad():
        theirs = torch_path.generate(prompt, 24, temperature=0)
    theirs_logits = _step_logits(torch_path, theirs[:, :-1], prefill=4)
    assert calls.model == n
    ours_logits = _step_logits(q, theirs[:, :-1], prefill=4)
    scale = theirs_logits.abs().amax(-1, keepdim=True)
    assert ((ours_logits - theirs_logits).abs() <= rel * scale).all()
    top2 = theirs_logits.topk(2, -1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * rel * scale[..., 0]
    # every clear step along the PyTorch path's tokens (the compiled decode teacher-forced on them) ...
    assert torch.equal(ours_logits.argmax(-1)[clear], theirs[:, 4:][clear])
    # ... and generate's own tokens up to each row's first step that is not clear
    for b in range(prompt.shape[0]):
        first = int(clear[b].logical_not().nonzero()[0]) if not clear[b].all() else clear.shape[1]
        assert torch.equal(ours[b, :4 + first], theirs[b, :4 + first]), f"row {b}"
    assert len(set(theirs[:, 4:].flatten().tolist())) > 8   # not one token repeated
    assert clear.sum() >= clear.numel() // 2, f"only {int(clear.sum())} of {clear.numel()} steps clear of ties"


# -- the guard ---------------------------------------------------------------------------------------------------
def _decode_one(model, cache, tok):
    with torch.no_grad():
        return model(tok, cache=cache).logits


def _guard_case(change, monkeypatch, mode="int8", group=None):
    """Decodes a few tokens (plan built), applies change(model), decodes one more: the result must be the changed
    model's PyTorch path on a copy of the cache (fp32 products: the same to fp32 rounding; a stale plan is off by
    the change). Returns how many plans were built for the token after the change."""
    q = quantize(_model(layers=1), mode, group_size=group, compute="fp32")
    ids = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = q(ids[:, :3], use_cache=True).cache
        _decode_one(q, cache, ids[:, 3:4])
        change(q)
    twin_cache = copy.deepcopy(cache)
    built = decode_plan.rebuilds[0]
    got = _decode_one(q, cache, ids[:, 4:5])
    rebuilt = decode_plan.rebuilds[0] - built
    want = _decode_one(torch_decode_twin(q), twin_cache, ids[:, 4:5])
    err = (got - want).abs().max().item()
    assert err <= 1e-4 * want.abs().max().item(), f"stale plan: error {err:.3g}"
    return rebuilt


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4", 32)])
def test_guard_requantized_module(mode, group, monkeypatch):
    """A projection of the fused q/k/v/... product, the output projection, an FFN matrix and the head replaced by
    newly quantized ones (other values): rebuilt."""
    def requantize(name):
        def change(model):
            parent, _, attr = name.rpartition(".")
            old = getattr(model.get_submodule(parent) if parent else model, attr)
            w = old.dequantize() * 1.5 + 0.01
            setattr(model.get_submodule(parent) if parent else model, attr,
                    QuantizedLinear.from_weight(w, old.bias, mode, group, compute="fp32"))
        return change

    for name in ("blocks.0.mixer.k_proj", "blocks.0.mixer.o_proj", "blocks.0.ffn.w_down", "lm_head"):
        assert _guard_case(requantize(name), monkeypatch, mode, group) > 0, name


@pytest.mark.parametrize("mode,group", [("int8", None), ("int4", 32)])
def test_guard_in_place_weight_and_scale_writes(mode, group, monkeypatch):
    """In-place writes to the stored integers or scales: the fused projection (a copy) is rebuilt; the matrices read
    in place (o_proj, FFN, head) give the new values either way."""
    def flip(name, what):
        def change(model):
            t = getattr(model.get_submodule(name), what)
            if what == "scales":
                t.mul_(2)
            elif mode == "int8":
                t.neg_()
            else:
                t.copy_((t & 0xF0) | (15 - (t & 15)).clamp_min(1))
        return change

    assert _guard_case(flip("blocks.0.mixer.q_proj", "qweight"), monkeypatch, mode, group) > 0
    assert _guard_case(flip("blocks.0.mixer.v_proj", "scales"), monkeypatch, mode, group) > 0
    for name in ("blocks.0.mixer.o_proj", "blocks.0.ffn.w_gate_up", "lm_head"):
        _guard_case(flip(name, "qweight"), monkeypatch, mode, group)
        _guard_case(flip(name, "scales"), monkeypatch, mode, group)


def test_guard_load_state_dict(monkeypatch):
    """Loading another quantized model's state (different weights, in place): the same results as that model."""
    other = quantize(_model(layers=1), "int8", compute="fp32")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.1)
        for m in quantized_modules(other).values():
            m.scales.mul_(1.5)
    sd = other.state_dict()
    assert _guard_case(lambda model: model.load_state_dict(sd), monkeypatch) > 0


def test_guard_bias_and_hook(monkeypatch):
    """A bias set in place on a quantized projection; a forward hook on a quantized module (the plan steps aside)."""
    def set_bias(model):
        model.blocks[0].mixer.g_proj.register_buffer("bias", torch.ones(model.blocks[0].mixer.g_proj.out_features))

    assert _guard_case(set_bias, monkeypatch) > 0
    seen = []
    _guard_case(lambda model: model.blocks[0].ffn.w_down.register_forward_hook(lambda *a: seen.append(1)),
                monkeypatch)
    assert seen


# -- the bench rows ----------------------------------------------------------------------------------------------
def test_bench_infer_quantized_rows_and_bytes(tmp_path, capsys):
    """`linattn bench infer --dtypes int8,int4`: rows whose bytes are the stored integers, scales and biases (not
    torch's derived int4 layout), the input embedding as one row and the quantized tied head once."""
    import json

    from linattn.bench import infer
    from linattn.cli import main

    q = quantize(_model(), "int4")
    floats = sum(t.numel() * t.element_size() for n, t in q.named_parameters() if n != "embed.weight")
    stored = sum(m.stored_bytes() for m in quantized_modules(q).values())
    row = q.embed.weight.shape[1] * 4
    assert infer.model_decode_bytes(q) == floats + stored + row
    rc = main(["bench", "infer", "--shape", "tiny", "--engines", "linattn", "--dtypes", "fp32,int8,int4",
               "--prompt", "4", "--decode", "2", "--repeats", "1", "--threads", "1", "--bandwidth-mib", "16",
               "--out", str(tmp_path), "--quiet"])
    assert rc == 0 and "decode/floor" in capsys.readouterr().out
    rows = {r["dtype"]: r for r in json.loads((tmp_path / "infer.json").read_text())["records"]}
    assert rows["int4"]["bytes"] < rows["int8"]["bytes"] < rows["fp32"]["bytes"]
    assert all(r["decode_tok_s"] > 0 and r["over_floor"] > 0 for r in rows.values())


@pytest.mark.parametrize("mode,group", FORMATS)
def test_hybrid_model_plan_reads_quantized_softmax_projections(mode, group, monkeypatch):
    """A hybrid (Gated DeltaNet and softmax attention with grouped KV heads and an output gate): the softmax
    block's q / k / v / gate / o projections are read quantized by the same one compiled call per token."""
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=16, head_dim=16,
                   mixer=["gated-deltanet", "softmax"],
                   mixer_kwargs={"softmax": dict(heads=4, n_kv_heads=2, head_dim=16, output_gate=True)})
    m = LanguageModel(cfg)
    with torch.no_grad():
        m.embed.weight.mul_(4)
    q = quantize(m.eval(), mode, group_size=group, compute="fp32", activations="float")
    names = quantized_modules(q)
    assert {f"blocks.1.mixer.{n}_proj" for n in "qkvgo"} <= set(names), sorted(names)
    calls = CompiledDecodeCalls(monkeypatch)
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(3))
    _assert_close_to_reference(q, ids, calls)
    assert calls.model == 5 and calls.block == 0
