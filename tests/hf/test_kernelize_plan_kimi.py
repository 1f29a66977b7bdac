"""A kernelized Kimi Linear decodes through the compiled whole-model plan (hf/kernelize_plan_kimi.py), against the
UNPATCHED model (transformers' PyTorch code): greedy tokens identical and logits within 1e-5 (fp32), sampled tokens
with a seed, batch > 1, transformers' cache objects holding transformers' values, a cache copied or advanced by
transformers' own code between compiled tokens, one compiled call per decoded token, the plan rebuilt when a weight
it copied is updated in place; MLA layers and MoE feed-forwards step aside (the whole model), through `generate`.

A Kimi Linear model without an attention layer cannot be decoded by transformers' `generate` (its cache reports no
sequence length): the KDA-only models here decode token by token through the model's forward with explicit
`position_ids` and the per-layer-type masks as a dict, which transformers' forward takes as they are."""
import copy
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

#: the per-layer-type masks of an unpadded batch (transformers' forward takes a dict as it is)
NO_MASK = {"full_attention": None, "linear_attention": None}
KDA3 = ("linear_attention",) * 3


def _config(layers=KDA3, mlp=None, tied=False):
    return transformers.KimiLinearConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layers), num_attention_heads=2,
        num_key_value_heads=2, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, moe_intermediate_size=16,
        num_local_experts=4, num_experts_per_tok=2, layer_types=list(layers),
        mlp_layer_types=list(mlp or ["dense"] * len(layers)), tie_word_embeddings=tied, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)


def _pair(dtype=torch.float32, tied=False, layers=KDA3, mlp=None, hooked=True):
    """(unpatched, kernelized) Kimi Linear; the norms, A_log / dt_bias and the gated norm moved off their init
    values, q / k scaled up so that the L2 norms and the decays show."""
    return pd.perturbed_pair(transformers.KimiLinearForCausalLM, _config(layers, mlp, tied), dtype, hooked,
                             moved=("norm", "A_log", "dt_bias"), scaled=("q_proj", "k_proj"))


def _prefill(models, prompt):
    pos = torch.arange(prompt.shape[1]).unsqueeze(0)
    outs = [m(prompt, position_ids=pos, use_cache=True, attention_mask=NO_MASK) for m in models]
    return [o.logits[:, -1:] for o in outs], [o.past_key_values for o in outs]


def _step(model, tok, cache, pos, **kw):
    kw.setdefault("attention_mask", NO_MASK)
    return model(tok, cache=cache, position_ids=torch.full((1, 1), pos), **kw).logits


def _prefilled(models, prompt):
    """(the unpatched model's greedy next token, the caches) after the prompt."""
    logits, caches = _prefill(models, prompt)
    return logits[-1].argmax(-1), caches


def _decode(models, tok, caches, pos, n, check=None):
    """n tokens decoded greedily (the unpatched model's picks) from position pos, `check(logits)` at each; the last
    token."""
    for i in range(n):
        lg = [_step(m, tok, c, pos + i) for m, c in zip(models, caches)]
        if check is not None:
            check(lg)
        tok = lg[-1].argmax(-1)
    return tok


@pytest.mark.parametrize("B,T,n,tied", [(1, 1, 12, False), (3, 9, 40, False), (2, 5, 8, True)])
def test_greedy_decode_matches_the_unpatched_model(B, T, n, tied, monkeypatch):
    """Greedy tokens identical, every step's logits within 1e-5 (relative to their scale), one compiled call per
    decoded token (the prompt is transformers' prefill)."""
    ref, fast = _pair(tied=tied)
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    prompt = pd.prompt(B, T)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        (lg, lw), caches = _prefill((fast, ref), prompt)
        toks = [lg.argmax(-1), lw.argmax(-1)]
        for i in range(n):
            assert torch.equal(toks[0], toks[1]), i
            lg, lw = (_step(m, t, c, T + i) for m, t, c in zip((fast, ref), toks, caches))
            assert pd.close(lg, lw), i
            toks = [lg.argmax(-1), lw.argmax(-1)]
    assert calls.model == n


def test_cache_objects_hold_transformers_values(monkeypatch):
    """After compiled tokens the cache holds what transformers' own decode leaves: recurrent and conv states."""
    ref, fast = _pair()
    prompt = pd.prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = _prefilled((fast, ref), prompt)
        _decode((fast, ref), tok, caches, 6, 5)
    assert calls.model == 5
    got, want = caches
    assert len(got.layers) == len(want.layers) == 3
    for lg, lw in zip(got.layers, want.layers):
        assert lg.recurrent_states[0].dtype == lw.recurrent_states[0].dtype == torch.float32
        torch.testing.assert_close(lg.recurrent_states[0], lw.recurrent_states[0], rtol=1e-5, atol=1e-6)
        assert lg.conv_states[0].shape == lw.conv_states[0].shape
        torch.testing.assert_close(lg.conv_states[0], lw.conv_states[0], rtol=1e-5, atol=1e-6)


def test_sampling_with_a_seed(monkeypatch):
    """Tokens sampled from the softmax of the logits (temperature, top-k) with one seeded generator per model: the
    same tokens."""
    ref, fast = _pair()
    prompt = pd.prompt(2, 4)
    calls = CompiledDecodeCalls(monkeypatch)
    seqs = []
    with torch.no_grad():
        logits, caches = _prefill((fast, ref), prompt)
        for m, lg, c in zip((fast, ref), logits, caches):
            gen, out = torch.Generator().manual_seed(7), []
            for i in range(10):
                top = torch.topk(lg[:, -1] / 0.9, 20)
                pick = torch.multinomial(torch.softmax(top.values, -1), 1, generator=gen)
                tok = top.indices.gather(-1, pick)
                out.append(tok)
                lg = _step(m, tok, c, 4 + i)
            seqs.append(torch.cat(out, 1))
    assert calls.model == 10
    assert torch.equal(seqs[0], seqs[1])


def test_cache_copied_and_advanced_by_transformers_between_calls(monkeypatch):
    """A deep copy of the cache decoded on its own (the original unchanged); tokens decoded by transformers' own code
    (LINATTN_CPU_KERNELS=0) between compiled ones, and compiled ones continuing after them: the unpatched model's
    logits throughout."""
    ref, fast = _pair()
    prompt = pd.prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = _prefilled((fast, ref), prompt)
        for step in range(8):
            pos = 6 + step
            if step == 3:
                copies = [copy.deepcopy(c) for c in caches]
                snap = caches[0].layers[1].recurrent_states[0].clone()
                lc = [_step(m, tok, c, pos) for m, c in zip((fast, ref), copies)]
                assert pd.close(lc[0], lc[1])
                assert torch.equal(caches[0].layers[1].recurrent_states[0], snap)
            if step in (4, 5):
                monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
            else:
                monkeypatch.delenv("LINATTN_CPU_KERNELS", raising=False)
            lg = [_step(m, tok, c, pos) for m, c in zip((fast, ref), caches)]
            assert pd.close(lg[0], lg[1]), step
            tok = lg[1].argmax(-1)
    assert calls.model == 8 - 2 + 1


@pytest.mark.parametrize("name", ["model.layers.0.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight",
                                  "model.layers.0.self_attn.b_proj.weight",
                                  "model.layers.2.self_attn.forget_gate.A_log",
                                  "model.layers.1.self_attn.forget_gate.f_a_proj.weight",
                                  "model.layers.1.self_attn.g_a_proj.weight", "model.norm.weight"])
def test_in_place_update_of_a_weight(name, monkeypatch):
    """The plan copies -exp(A_log): updated in place between tokens, it invalidates the plan; the weights read in
    place (the norms, and the parts of the fused products: gate | up, the first product's projections) do not;
    either way the next token reads the new value."""
    ref, fast = _pair()
    prompt = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = _prefilled((fast, ref), prompt)
        for m, c in zip((fast, ref), caches):
            _step(m, tok, c, 5)
        guard = fast._linattn_model_plan.guard
        for m in (fast, ref):
            m.get_parameter(name).add_(0.5)
        assert guard.valid() is not name.endswith("A_log")
        lg = [_step(m, tok, c, 6) for m, c in zip((fast, ref), caches)]
    assert calls.model == 2
    assert pd.close(lg[0], lg[1])


def test_bf16_decodes_through_the_plan(monkeypatch):
    """bf16 weights: the plan reads them as stored and computes in fp32; the logits stay within bf16's rounding
    of the unpatched model's (which rounds every activation to bf16)."""
    ref, fast = _pair(torch.bfloat16)
    prompt = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    def check(lg):
        assert lg[0].dtype == torch.bfloat16
        assert pd.close(lg[0].float(), lg[1].float(), 0.05)

    with torch.no_grad():
        _decode((fast, ref), *_prefilled((fast, ref), prompt), 5, 4, check)
    assert calls.model == 4


def test_what_the_plan_does_not_compute_steps_aside(monkeypatch):
    """A hook on a described module, grad enabled, a padded token in the linear layers' mask, no position ids:
    transformers' forward runs (the same error when it raises one), with the unpatched model's logits."""
    ref, fast = _pair()
    prompt = pd.prompt(2, 4)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = _prefilled((fast, ref), prompt)
        pad = {"full_attention": None, "linear_attention": torch.tensor([[1], [0]])}
        lg = [_step(m, tok, c, 4, attention_mask=pad) for m, c in zip((fast, ref), caches)]
        assert calls.model == 0 and pd.close(lg[0], lg[1])
        for m, c in zip((fast, ref), caches):
            with pytest.raises(ValueError, match="get_seq_length"):
                m(tok, cache=c, attention_mask=NO_MASK)
        seen = []
        handle = fast.model.layers[1].self_attn.o_norm.register_forward_hook(lambda *a: seen.append(1))
        lg = [_step(m, tok, c, 5) for m, c in zip((fast, ref), caches)]
        assert calls.model == 0 and len(seen) == 1 and pd.close(lg[0], lg[1])
        handle.remove()
    with torch.enable_grad():
        lg = [_step(m, tok, c, 6) for m, c in zip((fast, ref), caches)]
    assert calls.model == 0 and pd.close(lg[0].detach(), lg[1].detach())
    with torch.no_grad():
        lg = [_step(m, tok, c, 7) for m, c in zip((fast, ref), caches)]
    assert calls.model == 1 and pd.close(lg[0], lg[1])


@pytest.mark.parametrize("layers,mlp,why", [
    (("linear_attention", "full_attention", "linear_attention"), None, "MLA"),
    (KDA3, ("dense", "sparse", "dense"), "MoE"),
])
def test_mla_layers_and_moe_feed_forwards_step_aside(layers, mlp, why, monkeypatch):
    """A model with an MLA layer (every real Kimi Linear checkpoint) or an MoE feed-forward is not hooked: the reason
    is given, the forward stays the class's, and `generate` (which these models can run: with an MLA layer the cache
    reports its length) gives the unpatched model's tokens and logits with no compiled call."""
    ref, fast = _pair(layers=layers, mlp=mlp, hooked=False)
    assert why in undescribed_reason(fast)
    assert "forward" not in fast.__dict__ and describe_model(fast) is None
    if "full_attention" not in layers:
        return
    prompt = pd.prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    got, want = (pd.generate(m, prompt, 6) for m in (fast, ref))
    assert calls.model == 0
    assert torch.equal(got.sequences, want.sequences)
    assert pd.close(torch.stack(got.logits), torch.stack(want.logits))


def test_a_kda_only_model_is_described():
    _, fast = _pair()
    assert undescribed_reason(fast) is None
    desc, kdas = describe_model(fast)
    assert [b.kind for b in desc.blocks] == ["kda"] * 3 and len(kdas) == 3
    assert (kdas[0].W.out_features, kdas[0].W.in_features) == (3 * 4 * 16 + 4 + 16 + 16, 32)
