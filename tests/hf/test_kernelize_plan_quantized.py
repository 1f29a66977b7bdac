"""A quantized kernelized transformers model (`linattn.quantize`, int8 / int4) decodes through the whole-model plan
(hf/kernelize_plan*.py), the plan reading the integers and scales as stored.

Every described architecture that takes quantized weights: greedy `generate` through the plan against the same
quantized model with the plan switched off (`LINATTN_CPU_KERNELS=0`: transformers' forward, each `QuantizedLinear`
run by PyTorch), batch 2, and a left-padded batch: the same tokens, and logits within 4x the error of that PyTorch
path against the same quantized model in fp64 (the integers and scales are exact in both; only the summation and,
with int8 activations, the activations' rounding can differ) plus a few ulps. The models are quantized with
`compute="fp32"`, so the PyTorch path's products are fp32 ones on the dequantized matrix, as the plan's. The
compiled calls are counted, so a comparison cannot pass with the model stepping aside. Where the plan does not read
a quantized model, the step-aside reason names why."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import kernelize, kernelize_plan as plan  # noqa: E402
from linattn.models import decode_plan  # noqa: E402
from linattn.quant import quantize, quantized_modules  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf import kernelize_models as km, plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import transformers_torch_code  # noqa: E402, F401  (autouse)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

U32 = 2.0 ** -24

#: the tiny models of tests/hf/kernelize_models.py whose float plan the quantized one follows (transformers'
#: `Mamba2ForCausalLM.forward` reads `lm_head.weight.dtype`: a quantized head's `weight` is a `WeightInfo`)
ARCHS = ["qwen3_5", "qwen3_next", "qwen3_5_moe", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "minimax", "bamba",
         "granitemoehybrid", "nemotron_h", "mamba2"]
#: where the plan's second products read quantized rows (csrc/decode_mla.h, csrc/decode_moe.h): MLA's kv_b_proj
#: (q_b_proj with a low-rank q) and a Qwen MoE block's shared-expert gate
SECOND_PRODUCTS = {"qwen3_next": ("mlp.shared_expert_gate",), "qwen3_5_moe": ("mlp.shared_expert_gate",),
                   "kimi_linear": ("self_attn.kv_b_proj",), "bailing_hybrid": ("self_attn.kv_b_proj",)}

#: (mode, group, activations): int8 with float and int8 activations; int4 (group 32) with int8 activations (its
#: default) and float ones, where the model's shapes let int4 take every fused part (`_int4_model`)
INT8 = [("int8", None, "float"), ("int8", None, "int8")]
INT4 = [("int4", 32, "int8"), ("int4", 32, "float")]


def _kernelized(arch):
    """The kernelized tiny model of `arch`, hooked (its float model decodes through the plan)."""
    _, fast, _ = km.pair(arch)
    assert "forward" in fast.__dict__, f"{arch}: the float model is not hooked"
    return fast


def _quantized(fast, mode, group, activations):
    q = quantize(fast, mode, group_size=group, compute="fp32", activations=activations)
    assert "forward" in q.__dict__   # (the deep copy keeps the hook, bound to the copy)
    return q


def _int4_model():
    """A Qwen3.5 whose every projection int4 takes (16 value heads: `in_proj_b` / `in_proj_a` of 16 rows; a vocabulary
    of 96): the fused `[q | k | v | b | a | z]` all int4."""
    cfg = transformers.Qwen3_5TextConfig(**dict(km.ATTN, vocab_size=96, tie_word_embeddings=False),
                                         **dict(km.GDN, linear_num_value_heads=16), num_hidden_layers=2,
                                         layer_types=["linear_attention", "full_attention"])
    return pd.perturbed_pair(transformers.Qwen3_5ForCausalLM, cfg, moved=("norm", "A_log", "dt_bias"))[1]


def _int4_mla(arch):
    """A Kimi Linear / Bailing hybrid (a KDA layer, then an MLA layer) whose MLA projections int4 takes whole: a
    low-rank q (q_a_proj / q_b_proj over a rank of 32), a latent of 64 (two int4 groups a row; + 16 rope dims:
    kv_a_proj's 80 rows), kv_b_proj's 64 / 256 rows; KDA's 16 heads of 16 (Bailing's 16 heads: its g_proj gate of
    16 rows)."""
    own = {"kimi_linear": ("KimiLinear", dict(head_dim=None, linear_head_dim=16, linear_num_heads=16,
                                              linear_conv_kernel_dim=4)),
           "bailing_hybrid": ("BailingHybrid", dict(num_attention_heads=16, num_key_value_heads=16,
                                                    short_conv_kernel_size=4, n_group=1, topk_group=1))}
    name, kw = own[arch]
    cfg = getattr(transformers, f"{name}Config")(
        **dict(km.ATTN, **dict(dict(num_key_value_heads=4, vocab_size=96, tie_word_embeddings=False), **kw)),
        num_hidden_layers=2,
        moe_intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=64,
        q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=8, qk_nope_head_dim=8, mlp_layer_types=["dense", "sparse"],
        layer_types=["linear_attention", "full_attention"])
    return pd.perturbed_pair(getattr(transformers, f"{name}ForCausalLM"), cfg, moved=("norm",))[1]


def _int4_mamba2():
    """A Mamba2ForCausalLM whose every projection int4 takes: 16 heads of 4 (in_proj's 2 * 64 + 2 * 2 * 8 + 16 = 176
    rows), a vocabulary of 96; dt and in_proj raised as kernelize_models.pair does (the scan counts)."""
    cfg = transformers.Mamba2Config(vocab_size=96, hidden_size=32, num_heads=16, head_dim=4, state_size=8, n_groups=2,
                                    expand=2, conv_kernel=4, num_hidden_layers=2, chunk_size=8, pad_token_id=0,
                                    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.dt_bias.fill_(0.5)
            layer.mixer.in_proj.weight.mul_(10.0)
    assert kernelize(model).compiled_decode
    return model


def _fp64(q):
    """q with every floating tensor in fp64 (the QuantizedLinears' scales too: their products then dequantize in fp64,
    the int8 activations rounded in fp64)."""
    twin = copy.deepcopy(q).double()
    if hasattr(twin, "set_experts_implementation"):
        twin.set_experts_implementation("eager")   # (torch._grouped_mm has no fp64)
    return twin


def _generate_three(q, ids, n, monkeypatch, **kw):
    """(through the plan, the PyTorch path, the PyTorch path in fp64) greedy `generate`s of n tokens, and the compiled
    calls the first made."""
    calls = CompiledDecodeCalls(monkeypatch)
    got = pd.generate(q, ids, n, **kw)
    compiled = calls.model
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    want = pd.generate(q, ids, n, **kw)
    ref = pd.generate(_fp64(q), ids, n, **kw)
    monkeypatch.delenv("LINATTN_CPU_KERNELS")
    assert calls.model == compiled   # (the other two ran transformers' forward)
    return got, want, ref, compiled


def _check_within_bound(got, want, ref):
    """The same tokens; the plan's logits within 4x the PyTorch path's own error (against fp64) plus 16 ulps of the
    largest logit."""
    assert torch.equal(got.sequences, want.sequences) and torch.equal(want.sequences, ref.sequences)
    ours, theirs, exact = (torch.stack(g.logits).double() for g in (got, want, ref))
    err, err_torch = (ours - theirs).abs().max().item(), (theirs - exact).abs().max().item()
    bound = 4 * err_torch + 16 * U32 * exact.abs().max().item()
    assert err <= bound, f"plan error {err:.3g} > {bound:.3g} (PyTorch fp32: {err_torch:.3g})"


def _check_generate(q, monkeypatch, B=2, T=6, n=6):
    ids = pd.prompt(B, T)
    got, want, ref, compiled = _generate_three(q, ids, n, monkeypatch)
    assert compiled == n - 1   # every decoded token one compiled call (the prompt is transformers' prefill)
    _check_within_bound(got, want, ref)


@pytest.mark.parametrize("mode,group,activations", INT8)
@pytest.mark.parametrize("arch", ARCHS)
def test_int8_generate_through_the_plan(arch, mode, group, activations, monkeypatch):
    fast = _kernelized(arch)
    q = _quantized(fast, mode, group, activations)
    why = plan._ARCHITECTURES[type(q).__name__].describe(q)
    assert not isinstance(why, str), why
    mods = quantized_modules(q)
    for name in SECOND_PRODUCTS.get(arch, ()):
        assert any(n.endswith(name) for n in mods), name   # (quantized, and read so by the plan)
    _check_generate(q, monkeypatch)


@pytest.mark.parametrize("mode,group,activations", INT4)
def test_int4_generate_through_the_plan(mode, group, activations, monkeypatch):
    q = _quantized(_int4_model(), mode, group, activations)
    assert not q._linattn_quant_skipped   # (every linear layer int4: the fused parts and the head)
    _check_generate(q, monkeypatch, B=3, T=5, n=8)


@pytest.mark.parametrize("mode,group,activations", INT4)
@pytest.mark.parametrize("arch", ["kimi_linear", "bailing_hybrid"])
def test_int4_mla_generate_through_the_plan(arch, mode, group, activations, monkeypatch):
    """MLA's second products int4 (kv_b_proj, q_b_proj; with int8 activations the cached latents rounded as the
    layer rounds them): read as stored by the latent-attention block, the first product int4 too."""
    q = _quantized(_int4_mla(arch), mode, group, activations)
    mods = quantized_modules(q)
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
        assert mods[f"model.layers.1.self_attn.{name}"].mode == "int4", name
    assert not isinstance(plan._ARCHITECTURES[type(q).__name__].describe(q), str)
    _check_generate(q, monkeypatch, B=2, T=5, n=7)


@pytest.mark.parametrize("mode,group,activations", INT4)
def test_int4_mamba2_generate_through_the_plan(mode, group, activations, monkeypatch):
    """transformers' own Mamba2ForCausalLM quantized int4, every projection and the head: its forward reads
    `lm_head.weight.dtype`, which the quantized head answers (`WeightInfo`) without a float copy."""
    q = _quantized(_int4_mamba2(), mode, group, activations)
    assert not q._linattn_quant_skipped and type(q.lm_head).__name__ == "QuantizedLinear"
    _check_generate(q, monkeypatch, B=2, T=5, n=7)


def test_quantized_head_weight_info_follows_the_model_dtype():
    """A quantized layer's `weight` is its float layer's dtype, device and shape, converted with the model (the fp64
    twin's head takes fp64 hidden states), and no tensor: a product through it fails."""
    q = quantize(km.build("mamba2").eval(), "int8", compute="fp32")
    info = q.lm_head.weight
    assert (info.dtype, info.device.type, tuple(info.shape)) == (torch.float32, "cpu", (km.V, 32))
    assert not isinstance(info, torch.Tensor) and "_float_like" not in q.state_dict()
    assert _fp64(q).lm_head.weight.dtype == torch.float64 and copy.deepcopy(q).to(torch.bfloat16).lm_head.weight.dtype \
        == torch.bfloat16
    with pytest.raises(TypeError):
        torch.nn.functional.linear(torch.ones(1, 32), info)


def test_quantized_glm5_next_runs_transformers_forward(monkeypatch):
    """Glm5-Next (kernelized, no plan description: its DSA indexer) reads `weights_proj.weight.dtype` in its
    forward: quantized, the kernelized model generates as the same quantized model unkernelized (the same integers:
    quantizing is deterministic), logits within fp32 rounding."""
    ref, fast, _ = km.pair("glm5_next")
    qr, qf = (quantize(m, "int8", compute="fp32") for m in (ref, fast))
    assert "model.language_model.layers.1.self_attn.indexer.weights_proj" in quantized_modules(qf)
    ids = pd.prompt(2, 5)
    got, want = pd.generate(qf, ids, 5), pd.generate(qr, ids, 5)
    assert torch.equal(got.sequences, want.sequences)
    assert pd.close(torch.stack(got.logits), torch.stack(want.logits), 1e-4)


@pytest.mark.parametrize("arch", ["qwen3_5", "olmo_hybrid", "bamba", "minimax"])
def test_left_padded_generate(arch, monkeypatch):
    """A left-padded batch: the compiled calls of the float model for the same prompt (the plan steps aside where
    the mask enters every token's attention), the PyTorch path's tokens and logits within the bound."""
    fast = _kernelized(arch)
    q = _quantized(fast, "int8", None, "float")
    ids = pd.prompt(2, 7)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    calls = CompiledDecodeCalls(monkeypatch)
    pd.generate(fast, ids, 6, attention_mask=mask)
    float_calls, calls.model = calls.model, 0
    got, want, ref, compiled = _generate_three(q, ids, 6, monkeypatch, attention_mask=mask)
    assert compiled == float_calls
    _check_within_bound(got, want, ref)


def test_quantized_before_kernelize_is_hooked(monkeypatch):
    """quantize, then kernelize: the model is hooked and decodes through the plan."""
    model = km.build("qwen3_5").eval()
    q = quantize(model, "int8", compute="fp32")
    assert kernelize(q).compiled_decode
    _check_generate(q, monkeypatch)


def test_fused_parts_in_different_formats_step_aside(monkeypatch):
    """int4 on the tiny Qwen3.5 (4 value heads): `in_proj_b` / `in_proj_a` (4 rows) stay float beside int4 q | k | v
    and z, and one fused product reads one format: the model steps aside, saying so, and generates as PyTorch does."""
    q = quantize(_kernelized("qwen3_5"), "int4", group_size=32, compute="fp32")
    assert {"model.layers.0.linear_attn.in_proj_b", "model.layers.0.linear_attn.in_proj_a"} <= set(
        q._linattn_quant_skipped)
    why = plan._ARCHITECTURES["Qwen3_5ForCausalLM"].describe(q)
    assert isinstance(why, str) and "different formats" in why, why
    ids = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    got = pd.generate(q, ids, 4)
    assert calls.model == 0
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    want = pd.generate(q, ids, 4)
    assert torch.equal(got.sequences, want.sequences)


@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("arch", ["kimi_linear", "qwen3_5_moe"])
def test_bf16_second_products_through_the_plan(arch, activations, monkeypatch):
    """A bf16 model with MLA's kv_b_proj or a shared-expert gate int8: the plan reads their integers (computing in
    fp32), teacher-forced on the PyTorch path's tokens, bf16 logits within bf16's rounding of that path's (which
    rounds every activation to bf16); every token one compiled call."""
    _, fast, _ = km.pair(arch, torch.bfloat16)
    q = quantize(fast, "int8", compute="fp32", activations=activations)
    assert not isinstance(plan._ARCHITECTURES[type(q).__name__].describe(q), str)
    ids = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    twin = copy.deepcopy(q)

    def on(plan_on):
        if plan_on:
            monkeypatch.delenv("LINATTN_CPU_KERNELS", raising=False)
        else:
            monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")

    with torch.no_grad():
        caches = []
        for m, plan_on in ((q, True), (twin, False)):
            on(plan_on)
            caches.append(m(ids, use_cache=True).cache)
        tok = ids[:, -1:]
        for _ in range(4):
            lg = []
            for m, c, plan_on in ((q, caches[0], True), (twin, caches[1], False)):
                on(plan_on)
                lg.append(m(tok, cache=c).logits)
            assert lg[0].dtype == lg[1].dtype == torch.bfloat16
            assert pd.close(lg[0].float(), lg[1].float(), 0.05)
            tok = lg[1].argmax(-1)
    on(True)
    assert calls.model == 4


@pytest.mark.parametrize("arch,layer,fields", [
    ("kimi_linear", 1, {"mla_Wkb": "model.layers.1.self_attn.kv_b_proj"}),
    ("qwen3_5_moe", 0, {"Wsg": "model.layers.0.mlp.shared_expert_gate"})])
def test_second_products_read_their_integers_in_place(arch, layer, fields, monkeypatch):
    """The plan points a second product's fields at the QuantizedLinear's own integers and scales, in its format
    (no dequantized copy)."""
    q = _quantized(_kernelized(arch), "int8", None, "int8")
    ids = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        q(ids[:, -1:], cache=q(ids, use_cache=True).cache)
    assert calls.model == 1
    block, mods = q._linattn_model_plan.keep[0][layer], quantized_modules(q)
    for field, name in fields.items():
        m = mods[name]
        assert getattr(block, field) == m.qweight.data_ptr() and getattr(block, f"sc_{field}") == m.scales.data_ptr()
        assert getattr(block, f"fmt_{field}") == cpu_decode.WEIGHT_FORMATS["int8_a8"]


def _int8_decoded_once(monkeypatch):
    """An int8 (float activations) quantized model after a 5-token prompt and one cached token, which took the
    compiled model call once: (model, ids, cache, the calls' counter)."""
    q = _quantized(_int4_model(), "int8", None, "float")
    ids = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        cache = q(ids, use_cache=True).cache
        q(ids[:, -1:], cache=cache)
    assert calls.model == 1
    return q, ids, cache, calls


def test_quantized_weights_are_read_in_place_or_stacked(monkeypatch):
    """The plan points at the QuantizedLinears' own integers where a product is one layer (the out projections, the
    down projections, the head), and at a stacked copy of the fused parts' integers and scales; an in-place write of
    a fused part's integers fails the plan's guard (the copy follows the integers' versions): the next token is a
    new plan's, the bits of a plan built afresh on a copy of the changed model."""
    q, ids, cache, calls = _int8_decoded_once(monkeypatch)
    slot = q._linattn_model_plan
    blocks, mp = slot.keep[0], slot.plan
    mods = quantized_modules(q)
    gdn = mods["model.layers.0.linear_attn.out_proj"]
    assert blocks[0].Wo == gdn.qweight.data_ptr() and blocks[0].sc_Wo == gdn.scales.data_ptr()
    assert blocks[1].Wd == mods["model.layers.1.mlp.down_proj"].qweight.data_ptr()
    assert mp.head == mods["lm_head"].qweight.data_ptr() and mp.sc_head == mods["lm_head"].scales.data_ptr()
    qkv = mods["model.layers.0.linear_attn.in_proj_qkv"]
    assert blocks[0].W not in {m.qweight.data_ptr() for m in mods.values()}
    assert cpu_decode.WEIGHT_FORMATS["int8"] == blocks[0].fmt_W == blocks[0].fmt_Wgu
    guard, tok = slot.guard, ids[:, -1:]
    with torch.no_grad():
        before = q(tok, cache=copy.deepcopy(cache)).logits
        qkv.qweight.neg_()
        assert not guard.valid()
        twin, twin_cache = copy.deepcopy(q), copy.deepcopy(cache)
        built = decode_plan.rebuilds[0]
        got = q(tok, cache=cache).logits
        assert decode_plan.rebuilds[0] > built
        want = twin(tok, cache=twin_cache).logits
    assert calls.model == 4
    assert torch.equal(got, want) and not torch.equal(got, before)


def test_guard_checks_empty_tensors_by_identity_only(monkeypatch):
    """The plan's guard reads no pointer or version of an empty tensor (a QuantizedLinear's `_float_like`: nothing
    there to read or copy; `decode_plan.PlanGuard`), while every non-empty one stays checked; replacing the empty
    tensor (another dtype) still invalidates the plan, as does an in-place write of a weight."""
    q, ids, cache, calls = _int8_decoded_once(monkeypatch)
    guard, mods = q._linattn_model_plan.guard, quantized_modules(q)
    checked = {id(t) for t in guard.tensors}
    head = mods["lm_head"]
    assert id(head._float_like) not in checked and id(head.qweight) in checked and id(head.scales) in checked
    assert all(t.numel() for t in guard.tensors) and guard.valid()
    head._float_like = torch.empty(0, dtype=torch.float64)
    assert not guard.valid()
