"""A kernelized Bailing hybrid made of KDA layers and dense MLPs decodes through the compiled whole-model plan
(hf/kernelize_plan_bailing.py: the KDA block kind with full-rank forget and output gates), against the UNPATCHED
model (transformers' PyTorch code), fp64 and fp32: greedy tokens identical and logits within 1e-5, batch > 1, the
lower-bounded ("safe") gate and the softplus one, transformers' cache objects holding transformers' values, a cache
copied or advanced by transformers' own code between compiled tokens, one compiled call per decoded token, the plan
rebuilt when a weight it copied is updated in place, bf16; MLA layers and MoE feed-forwards step aside (the whole
model), through `generate`.

Such a model has no attention layer, so transformers' `generate` cannot run it (its cache reports no length): it
decodes token by token through the forward (tests/hf/plan_decode.py's `prefill` / `step`)."""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "BailingHybridForCausalLM"):
    pytest.skip(f"the installed transformers ({transformers.__version__}) has no Bailing hybrid",
                allow_module_level=True)

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf.kernelize_plan_bailing import describe_model, undescribed_reason  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf import plan_decode as pd  # noqa: E402
from tests.hf.kernelize_models import V, transformers_torch_code  # noqa: E402, F401  (autouse)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")

KDA3 = ("linear_attention",) * 3


def _pair(dtype=torch.float32, tied=False, layers=KDA3, mlp=None, hooked=True, safe=True):
    """(unpatched, kernelized) Bailing hybrid (4 KDA heads of 16); the norms, A_log / dt_bias and the gated norm
    moved off their init values, q / k scaled up so that the L2 norms and the decays show."""
    cfg = transformers.BailingHybridConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layers), num_attention_heads=4,
        num_key_value_heads=4, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, kv_lora_rank=16,
        q_lora_rank=None, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, moe_intermediate_size=16,
        num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        kda_safe_gate=safe, layer_types=list(layers), mlp_layer_types=list(mlp or ["dense"] * len(layers)),
        tie_word_embeddings=tied, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return pd.perturbed_pair(transformers.BailingHybridForCausalLM, cfg, dtype, hooked,
                             moved=("norm", "A_log", "dt_bias"), scaled=("q_proj", "k_proj"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("B,T,n,tied,safe", [(1, 1, 12, False, True), (3, 9, 30, False, False),
                                             (2, 5, 8, True, True)])
def test_greedy_decode_matches_the_unpatched_model(B, T, n, tied, safe, dtype, monkeypatch):
    """Greedy tokens identical, every step's logits within 1e-5 (relative to their scale), one compiled call per
    decoded token (the prompt is transformers' prefill); the lower-bounded gate and the softplus one."""
    ref, fast = _pair(dtype, tied=tied, safe=safe)
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    prompt = pd.prompt(B, T)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        (lg, lw), caches = pd.prefill((fast, ref), prompt)
        toks = [lg.argmax(-1), lw.argmax(-1)]
        for i in range(n):
            assert torch.equal(toks[0], toks[1]), i
            lg, lw = (pd.step(m, t, c, T + i) for m, t, c in zip((fast, ref), toks, caches))
            assert pd.close(lg, lw), i
            toks = [lg.argmax(-1), lw.argmax(-1)]
    assert calls.model == n


def test_cache_objects_hold_transformers_values(monkeypatch):
    """After compiled tokens the cache holds what transformers' own decode leaves: recurrent and conv states."""
    ref, fast = _pair()
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = pd.prefilled((fast, ref), pd.prompt(2, 6))
        pd.decode((fast, ref), tok, caches, 6, 5)
    assert calls.model == 5
    got, want = caches
    assert len(got.layers) == len(want.layers) == 3
    for lg, lw in zip(got.layers, want.layers):
        torch.testing.assert_close(lg.recurrent_states[0], lw.recurrent_states[0], rtol=1e-5, atol=1e-6)
        assert lg.conv_states[0].shape == lw.conv_states[0].shape
        torch.testing.assert_close(lg.conv_states[0], lw.conv_states[0], rtol=1e-5, atol=1e-6)


def test_cache_copied_and_advanced_by_transformers_between_calls(monkeypatch):
    """A deep copy of the cache decoded on its own (the original unchanged); tokens decoded by transformers' own code
    (LINATTN_CPU_KERNELS=0) between compiled ones, and compiled ones after them: the unpatched model's logits."""
    ref, fast = _pair()
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = pd.prefilled((fast, ref), pd.prompt(2, 6))
        for step in range(8):
            pos = 6 + step
            if step == 3:
                copies = [copy.deepcopy(c) for c in caches]
                snap = caches[0].layers[1].recurrent_states[0].clone()
                lc = [pd.step(m, tok, c, pos) for m, c in zip((fast, ref), copies)]
                assert pd.close(lc[0], lc[1])
                assert torch.equal(caches[0].layers[1].recurrent_states[0], snap)
            if step in (4, 5):
                monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
            else:
                monkeypatch.delenv("LINATTN_CPU_KERNELS", raising=False)
            lg = [pd.step(m, tok, c, pos) for m, c in zip((fast, ref), caches)]
            assert pd.close(lg[0], lg[1]), step
            tok = lg[1].argmax(-1)
    assert calls.model == 8 - 2 + 1


@pytest.mark.parametrize("name,copied", [
    ("model.layers.0.input_layernorm.weight", False), ("model.layers.1.self_attn.o_norm.weight", False),
    ("model.layers.2.self_attn.conv1d.weight", False), ("model.layers.1.self_attn.forget_gate.f_proj.weight", True),
    ("model.layers.0.self_attn.g_proj.weight", True), ("model.layers.2.self_attn.forget_gate.A_log", True),
    ("model.layers.1.mlp.up_proj.weight", True)])
def test_in_place_update_of_a_weight_is_read(name, copied, monkeypatch):
    """A weight updated in place between tokens: the plan's guard fails exactly when the plan copied it (the fused
    first product with both full-rank gates, -exp(A_log), gate | up), and the next token reads the new value."""
    ref, fast = _pair()
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        tok, caches = pd.prefilled((fast, ref), pd.prompt(2, 5))
        for m, c in zip((fast, ref), caches):
            pd.step(m, tok, c, 5)
        guard = fast._linattn_model_plan.guard
        for m in (fast, ref):
            m.get_parameter(name).add_(0.5)
        assert guard.valid() is not copied
        lg = [pd.step(m, tok, c, 6) for m, c in zip((fast, ref), caches)]
    assert calls.model == 2
    assert pd.close(lg[0], lg[1])


def test_bf16_decodes_through_the_plan(monkeypatch):
    """bf16 weights: the plan reads them as stored and computes in fp32; the logits stay within bf16's rounding
    of the unpatched model's (which rounds every activation to bf16)."""
    ref, fast = _pair(torch.bfloat16)
    calls = CompiledDecodeCalls(monkeypatch)

    def check(lg):
        assert lg[0].dtype == torch.bfloat16
        assert pd.close(lg[0].float(), lg[1].float(), 0.05)

    with torch.no_grad():
        pd.decode((fast, ref), *pd.prefilled((fast, ref), pd.prompt(2, 5)), 5, 4, check)
    assert calls.model == 4


@pytest.mark.parametrize("layers,mlp,why", [
    (("linear_attention", "full_attention", "linear_attention"), None, "MLA"),
    (KDA3, ("dense", "sparse", "dense"), "MoE"),
])
def test_mla_layers_and_moe_feed_forwards_step_aside(layers, mlp, why, monkeypatch):
    """A model with an MLA layer (every released checkpoint) or an MoE feed-forward is not hooked: the reason is
    given, the forward stays the class's, and `generate` (with an MLA layer the cache reports its length) gives the
    unpatched model's tokens and logits with no compiled call."""
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


def test_a_kda_only_model_is_described_with_full_rank_gates():
    _, fast = _pair()
    assert undescribed_reason(fast) is None
    desc, kdas = describe_model(fast)
    assert [b.kind for b in desc.blocks] == ["kda"] * 3 and len(kdas) == 3
    assert kdas[0].W.shape == (3 * 64 + 4 + 64 + 64, 32)   # q | k | v | b | f (full rank) | gate (full rank)
