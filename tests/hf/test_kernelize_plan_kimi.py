"""A kernelized Kimi Linear decodes through the compiled whole-model plan (hf/kernelize_plan_kimi.py), against the
UNPATCHED model (transformers' PyTorch code): greedy tokens identical and logits within 1e-5 (fp32), sampled tokens
with a seed, batch > 1, transformers' cache objects holding transformers' values, a cache copied or advanced by
transformers' own code between compiled tokens, one compiled call per decoded token, the plan rebuilt when a weight
it copied is updated in place; MLA layers and MoE feed-forwards the plan does not compute (attention biases, router
logits asked for) step aside (the whole model), through `generate`. Models with MLA layers and MoE feed-forwards
the plan computes: tests/hf/test_kernelize_plan_mla.py.

A Kimi Linear model without an attention layer cannot be decoded by transformers' `generate` (its cache reports no
sequence length): the KDA-only models here decode token by token through the model's forward with explicit
`position_ids` and the per-layer-type masks as a dict, which transformers' forward takes as they are."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "KimiLinearForCausalLM"):
    pytest.skip(f"the installed transformers ({transformers.__version__}) has no Kimi Linear",
                allow_module_level=True)

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf.kernelize_plan_kimi import describe_model, undescribed_reason  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import V, transformers_torch_code  # noqa: E402, F401  (autouse)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

KDA3 = ("linear_attention",) * 3


def _config(layers=KDA3, mlp=None, tied=False, **kw):
    return transformers.KimiLinearConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layers), num_attention_heads=2,
        num_key_value_heads=2, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, moe_intermediate_size=16,
        num_local_experts=4, num_experts_per_tok=2, layer_types=list(layers),
        mlp_layer_types=list(mlp or ["dense"] * len(layers)), tie_word_embeddings=tied, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, **kw)


def _pair(dtype=torch.float32, tied=False, layers=KDA3, mlp=None, hooked=True, **kw):
    """(unpatched, kernelized) Kimi Linear; the norms, A_log / dt_bias and the gated norm moved off their init
    values, q / k scaled up so that the L2 norms and the decays show."""
    return pd.perturbed_pair(transformers.KimiLinearForCausalLM, _config(layers, mlp, tied, **kw), dtype, hooked,
                             moved=("norm", "A_log", "dt_bias"), scaled=("q_proj", "k_proj"))


@pytest.mark.parametrize("B,T,n,tied", [(1, 1, 12, False), (3, 9, 40, False), (2, 5, 8, True)])
def test_greedy_decode_matches_the_unpatched_model(B, T, n, tied, monkeypatch):
    ref, fast = _pair(tied=tied)
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    pd.check_forward_greedy(ref, fast, B, T, n, monkeypatch)


def test_cache_objects_hold_transformers_values(monkeypatch):
    """After compiled tokens the cache holds what transformers' own decode leaves (fp32 states, as transformers')."""
    ref, fast = _pair()
    pd.check_forward_cache_values(ref, fast, 3, monkeypatch)


def test_sampling_with_a_seed(monkeypatch):
    """Tokens sampled from the softmax of the logits (temperature, top-k) with one seeded generator per model: the
    same tokens."""
    ref, fast = _pair()
    prompt = pd.prompt(2, 4)
    calls = CompiledDecodeCalls(monkeypatch)
    seqs = []
    with torch.no_grad():
        logits, caches = pd.prefill((fast, ref), prompt)
        for m, lg, c in zip((fast, ref), logits, caches):
            gen, out = torch.Generator().manual_seed(7), []
            for i in range(10):
                top = torch.topk(lg[:, -1] / 0.9, 20)
                pick = torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)
                tok = top.indices.gather(-1, pick)
                out.append(tok)
                lg = pd.step(m, tok, c, 4 + i)
            seqs.append(torch.cat(out, 1))
    assert calls.model == 10
    assert torch.equal(seqs[0], seqs[1])


def test_cache_copied_and_advanced_by_transformers_between_calls(monkeypatch):
    pd.check_forward_cache_copied_and_advanced(*_pair(), monkeypatch)


@pytest.mark.parametrize("name", ["model.layers.0.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight",
                                  "model.layers.0.self_attn.b_proj.weight",
                                  "model.layers.2.self_attn.forget_gate.A_log",
                                  "model.layers.1.self_attn.forget_gate.f_a_proj.weight",
                                  "model.layers.1.self_attn.g_a_proj.weight", "model.norm.weight"])
def test_in_place_update_of_a_weight(name, monkeypatch):
    """The plan copies -exp(A_log): updated in place between tokens, it invalidates the plan; the weights read in
    place (the norms, and the parts of the fused products: gate | up, the first product's projections) do not;
    either way the next token reads the new value."""
    pd.check_forward_in_place_update(*_pair(), name, name.endswith("A_log"), monkeypatch)


def test_bf16_decodes_through_the_plan(monkeypatch):
    """bf16 weights: the plan reads them as stored and computes in fp32; the logits stay within bf16's rounding
    of the unpatched model's (which rounds every activation to bf16)."""
    pd.check_forward_bf16(*_pair(torch.bfloat16), monkeypatch)


def test_what_the_plan_does_not_compute_steps_aside(monkeypatch):
    """A hook on a described module, grad enabled, a padded token in the linear layers' mask, no position ids:
    transformers' forward runs (the same error when it raises one), with the unpatched model's logits."""
    ref, fast = _pair()
    prompt = pd.prompt(2, 4)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = pd.prefilled((fast, ref), prompt)
        pad = {"full_attention": None, "linear_attention": torch.tensor([[1], [0]])}
        lg = [pd.step(m, tok, c, 4, attention_mask=pad) for m, c in zip((fast, ref), caches)]
        assert calls.model == 0 and pd.close(lg[0], lg[1])
        for m, c in zip((fast, ref), caches):
            with pytest.raises(ValueError, match="get_seq_length"):
                m(tok, cache=c, attention_mask=pd.NO_MASK)
        seen = []
        handle = fast.model.layers[1].self_attn.o_norm.register_forward_hook(lambda *a: seen.append(1))
        lg = [pd.step(m, tok, c, 5) for m, c in zip((fast, ref), caches)]
        assert calls.model == 0 and len(seen) == 1 and pd.close(lg[0], lg[1])
        handle.remove()
    with torch.enable_grad():
        lg = [pd.step(m, tok, c, 6) for m, c in zip((fast, ref), caches)]
    assert calls.model == 0 and pd.close(lg[0].detach(), lg[1].detach())
    with torch.no_grad():
        lg = [pd.step(m, tok, c, 7) for m, c in zip((fast, ref), caches)]
    assert calls.model == 1 and pd.close(lg[0], lg[1])


@pytest.mark.parametrize("layers,mlp,kw,why", [
    (("linear_attention", "full_attention", "linear_attention"), None, {"attention_bias": True}, "bias-free"),
    (KDA3, ("dense", "sparse", "dense"), {"output_router_logits": True}, "output_router_logits"),
])
def test_what_mla_and_moe_blocks_do_not_compute_steps_aside(layers, mlp, kw, why, monkeypatch):
    """An MLA layer with projection biases, or router logits asked for: the model is not hooked, the reason is
    given, the forward stays the class's, and `generate` (which these models can run: with an MLA layer the cache
    reports its length) gives the unpatched model's tokens and logits with no compiled call."""
    ref, fast = _pair(layers=layers, mlp=mlp, hooked=False, **kw)
    pd.check_not_described(ref, fast, undescribed_reason, why, describe_model, "full_attention" in layers,
                           monkeypatch)


def test_a_kda_only_model_is_described():
    _, fast = _pair()
    assert undescribed_reason(fast) is None
    desc, kdas = describe_model(fast)
    assert [b.kind for b in desc.blocks] == ["kda"] * 3 and len(kdas) == 3
    assert (kdas[0].W.out_features, kdas[0].W.in_features) == (3 * 4 * 16 + 4 + 16 + 16, 32)


@pytest.mark.parametrize("B", [1, 3])
def test_conv_states_in_place_same_bits_as_buffers(B, monkeypatch):
    """KDA blocks (kind 4; an MLA layer between, whose length gives the tokens' positions) read and advance
    transformers' conv states in place: bit for bit the buffers' path, and the unpatched model's logits
    (`plan_decode.check_conv_states_in_place`)."""
    ref, model = _pair(layers=("linear_attention", "full_attention", "linear_attention"))
    pd.check_conv_states_in_place(ref, model, B, monkeypatch)
