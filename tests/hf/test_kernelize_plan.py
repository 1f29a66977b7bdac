"""A kernelized Qwen3.5 or Qwen3-Next (dense feed-forwards) decodes through the compiled whole-model plan
(hf/kernelize_plan.py): through transformers' `generate`, against the UNPATCHED model (transformers' PyTorch
code): greedy tokens identical and logits within 1e-5 (fp32), sampled tokens with a seed, batch > 1, beam search
(the cache reordered between tokens), a cache reused, copied or advanced by transformers' own code between
compiled tokens, left padding (the plan steps aside), one compiled call per decoded token, and the plan rebuilt
when a weight it copied is updated in place."""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import kernelize  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf.kernelize_models import (  # noqa: E402
    ATTN,
    GDN,
    V,
    maxdiff,
    transformers_torch_code,  # noqa: F401  (autouse)
)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


ARCHS = ("qwen3_5", "qwen3_next")
#: a GDN layer's projections that the plan copies into its fused matrix, per architecture
FUSED = {"qwen3_5": "in_proj_z", "qwen3_next": "in_proj_qkvz"}


def _config(arch, layers, tied):
    if arch == "qwen3_next":   # dense feed-forwards (no experts), a partial rotary as Qwen3-Next's
        if not hasattr(transformers, "Qwen3NextForCausalLM"):
            pytest.skip(f"the installed transformers ({transformers.__version__}) has no Qwen3-Next")
        cfg = transformers.Qwen3NextConfig(**ATTN, **GDN, num_hidden_layers=len(layers), layer_types=list(layers),
                                           tie_word_embeddings=tied, num_experts=0, partial_rotary_factor=0.5)
        return cfg, transformers.Qwen3NextForCausalLM
    cfg = transformers.Qwen3_5TextConfig(**ATTN, **GDN, num_hidden_layers=len(layers), layer_types=list(layers),
                                         tie_word_embeddings=tied)
    return cfg, transformers.Qwen3_5ForCausalLM


def _pair(dtype=torch.float32, tied=False, layers=("linear_attention", "full_attention", "linear_attention",
                                                   "full_attention"), arch="qwen3_5"):
    """(unpatched, kernelized) model of 4 layers, 2 of them softmax attention; the norms, A_log / dt_bias and the
    gated norm moved off their init values, q / k scaled up so that the attention's softmax and RoPE show."""
    cfg, cls = _config(arch, layers, tied)
    torch.manual_seed(0)
    ref = cls(cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n or "A_log" in n or "dt_bias" in n:
                p.add_(0.2 * torch.randn_like(p))
            if "q_proj" in n or "k_proj" in n or "in_proj_qkvz" in n:
                p.mul_(3.0)
    ref = ref.to(dtype).eval()
    fast = copy.deepcopy(ref)
    report = kernelize(fast)
    assert report.compiled_decode
    return ref, fast


def _prompt(B, T, seed=1):
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


def _generate(model, prompt, n, **kw):
    return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **{**GREEDY, **kw})


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("B,T,n,tied", [(1, 1, 12, False), (3, 9, 70, False), (2, 5, 8, True)])
def test_greedy_generate_matches_the_unpatched_model(B, T, n, tied, arch, monkeypatch):
    """Greedy tokens identical, every step's logits within 1e-5 (relative to their scale), one compiled call per
    decoded token (the prompt is transformers' prefill); 70 tokens grow the KV buffers past their chunk."""
    ref, fast = _pair(tied=tied, arch=arch)
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    prompt = _prompt(B, T)
    calls = CompiledDecodeCalls(monkeypatch)
    got = _generate(fast, prompt, n)
    assert calls.model == n - 1
    want = _generate(ref, prompt, n)
    assert torch.equal(got.sequences, want.sequences)
    lg, lw = torch.stack(got.logits), torch.stack(want.logits)
    assert maxdiff(lg, lw) <= 1e-5 * max(1.0, lw.abs().max().item())


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_objects_hold_transformers_values(arch, monkeypatch):
    """After compiled tokens the cache holds what transformers' own decode leaves: recurrent and conv states, keys
    and values, the sequence length."""
    ref, fast = _pair(arch=arch)
    prompt = _prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    caches = [_generate(m, prompt, 5).past_key_values for m in (fast, ref)]
    assert calls.model == 4
    got, want = caches
    assert got.get_seq_length() == want.get_seq_length() == 10
    for lg, lw in zip(got.layers, want.layers):
        if hasattr(lg, "recurrent_states"):
            torch.testing.assert_close(lg.recurrent_states[0], lw.recurrent_states[0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lg.conv_states[0], lw.conv_states[0], rtol=1e-5, atol=1e-6)
        else:
            torch.testing.assert_close(lg.keys, lw.keys, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(lg.values, lw.values, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_sampling_with_a_seed(arch, monkeypatch):
    ref, fast = _pair(arch=arch)
    calls = CompiledDecodeCalls(monkeypatch)
    prompt = _prompt(2, 4)
    outs = []
    for m in (fast, ref):
        torch.manual_seed(7)
        outs.append(m.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=True, top_k=20,
                               temperature=0.9))
    assert calls.model == 9
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("arch", ARCHS)
def test_beam_search_reorders_the_cache(arch, monkeypatch):
    """Beam search reorders transformers' cache between tokens (new tensors): the plan rebuilds its KV buffers
    from them and gives the unpatched model's beams."""
    ref, fast = _pair(arch=arch)
    prompt = _prompt(1, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    got = fast.generate(prompt, max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False)
    assert calls.model > 0
    want = ref.generate(prompt, max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("arch", ARCHS)
def test_left_padding_steps_aside(arch, monkeypatch):
    """A padded attention mask: the plan cannot honour it (its GDN layers take every token), so every token runs
    transformers' forward; the tokens and logits are the unpatched model's."""
    ref, fast = _pair(arch=arch)
    prompt = _prompt(2, 7)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    calls = CompiledDecodeCalls(monkeypatch)
    got = _generate(fast, prompt, 6, attention_mask=mask)
    assert calls.model == 0
    want = _generate(ref, prompt, 6, attention_mask=mask)
    assert torch.equal(got.sequences, want.sequences)
    assert maxdiff(torch.stack(got.logits), torch.stack(want.logits)) <= 1e-5


def test_cache_reused_copied_and_advanced_by_transformers_between_calls(monkeypatch):
    """A generate continued on the returned cache; a deep copy of the cache decoded on its own (the original
    unchanged); tokens decoded by transformers' own code (LINATTN_CPU_KERNELS=0) between compiled ones: the
    unpatched model's logits throughout."""
    ref, fast = _pair()
    prompt = _prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        outs = [m(prompt, use_cache=True) for m in (fast, ref)]
        caches = [o.past_key_values for o in outs]
        tok = outs[1].logits[:, -1:].argmax(-1)
        for step in range(8):
            if step == 3:
                copies = [copy.deepcopy(c) for c in caches]
                snap = caches[0].layers[1].keys.clone()
                lc = [m(tok, cache=c).logits for m, c in zip((fast, ref), copies)]
                assert maxdiff(lc[0], lc[1]) <= 1e-5
                assert torch.equal(caches[0].layers[1].keys, snap)
            if step in (4, 5):
                monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
            else:
                monkeypatch.delenv("LINATTN_CPU_KERNELS", raising=False)
            lg = [m(tok, cache=c).logits for m, c in zip((fast, ref), caches)]
            assert maxdiff(lg[0], lg[1]) <= 1e-5 * max(1.0, lg[1].abs().max().item()), step
            tok = lg[1].argmax(-1)
    assert calls.model == 8 - 2 + 1
    # generate continued on a returned cache
    got = _generate(fast, prompt, 4)
    want = _generate(ref, prompt, 4)
    seq = [g.sequences for g in (got, want)]
    more = [_generate(m, s, 5, cache=g.past_key_values) for m, s, g in zip((fast, ref), seq, (got, want))]
    assert torch.equal(more[0].sequences, more[1].sequences)
    assert maxdiff(torch.stack(more[0].logits), torch.stack(more[1].logits)) <= 1e-5


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", ["model.layers.0.input_layernorm.weight", "model.layers.1.mlp.up_proj.weight",
                                  "model.layers.0.linear_attn.FUSED.weight", "model.layers.2.linear_attn.A_log",
                                  "model.norm.weight", "model.layers.1.self_attn.q_norm.weight"])
def test_in_place_update_of_a_copied_weight_rebuilds(name, arch, monkeypatch):
    """The plan copies (1 + w), gate | up, the fused GDN projection and -exp(A_log): a weight updated in place
    between tokens invalidates it, and the next token reads the new value."""
    ref, fast = _pair(arch=arch)
    name = name.replace("FUSED", FUSED[arch])
    prompt = _prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(prompt, use_cache=True).past_key_values for m in (fast, ref)]
        tok = prompt[:, -1:]
        for m, c in zip((fast, ref), caches):
            m(tok, cache=c)
        guard = fast._linattn_model_plan.guard
        for m in (fast, ref):
            m.get_parameter(name).add_(0.5)
        assert not guard.valid()
        lg = [m(tok, cache=c).logits for m, c in zip((fast, ref), caches)]
    assert calls.model == 2
    assert maxdiff(lg[0], lg[1]) <= 1e-5 * max(1.0, lg[1].abs().max().item())


def test_a_hook_on_a_described_module_steps_aside(monkeypatch):
    ref, fast = _pair()
    seen = []
    fast.model.layers[1].mlp.down_proj.register_forward_hook(lambda *a: seen.append(1))
    calls = CompiledDecodeCalls(monkeypatch)
    prompt = _prompt(1, 4)
    got, want = _generate(fast, prompt, 4), _generate(ref, prompt, 4)
    assert calls.model == 0 and len(seen) == 4
    assert torch.equal(got.sequences, want.sequences)


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_decodes_through_the_plan(arch, monkeypatch):
    """bf16 weights: the plan reads them as stored and computes in fp32; the logits stay within bf16's rounding
    of the unpatched model's (which rounds every activation to bf16)."""
    ref, fast = _pair(torch.bfloat16, arch=arch)
    prompt = _prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(prompt, use_cache=True).past_key_values for m in (fast, ref)]
        tok = prompt[:, -1:]
        for _ in range(4):
            lg = [m(tok, cache=c).logits for m, c in zip((fast, ref), caches)]
            assert lg[0].dtype == torch.bfloat16
            assert maxdiff(lg[0].float(), lg[1].float()) <= 0.05 * max(1.0, lg[1].float().abs().max().item())
            tok = lg[1].argmax(-1)
    assert calls.model == 4


@pytest.mark.parametrize("arch", ["qwen3_next", "olmo_hybrid"])
def test_other_architectures_keep_the_per_module_decode(arch):
    """Qwen3-Next with mixture-of-experts feed-forwards, and OLMo-hybrid (post-norm attention blocks), are served
    but not hooked: their forward stays the class's."""
    from tests.hf.kernelize_models import build
    model = build(arch).eval()
    assert not kernelize(model).compiled_decode and "forward" not in model.__dict__


def test_under_torch_compile_the_plan_steps_aside(monkeypatch):
    """A cached one-token call inside torch.compile runs transformers' code (traced), not the compiled plan: the
    same logits as the eager call on a copy of the cache, no compiled call."""
    _, fast = _pair()
    prompt = _prompt(1, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        cache = fast(prompt, use_cache=True).past_key_values
        twin = copy.deepcopy(cache)
        tok = prompt[:, -1:]
        torch._dynamo.reset()
        got = torch.compile(fast)(tok, cache=cache).logits
        assert calls.model == 0
        want = fast(tok, cache=twin).logits
    assert calls.model == 1
    assert maxdiff(got, want) <= 1e-5 * max(1.0, want.abs().max().item())
    torch._dynamo.reset()


def test_position_ids_other_than_the_cache_length_step_aside(monkeypatch):
    """A token at a position the cache does not end at (position ids given explicitly) runs transformers' forward,
    with the unpatched model's logits; at the cache length it takes the plan."""
    ref, fast = _pair()
    prompt = _prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(prompt, use_cache=True).past_key_values for m in (fast, ref)]
        tok = prompt[:, -1:]
        for pos, n in ((9, 0), (4, 0), (7, 1)):   # (the cache holds 5, 6, then 7 tokens)
            ids = torch.full((2, 1), pos)
            lg = [m(tok, cache=c, position_ids=ids).logits for m, c in zip((fast, ref), caches)]
            assert calls.model == n
            assert maxdiff(lg[0], lg[1]) <= 1e-5 * max(1.0, lg[1].abs().max().item())


def test_qwen3_next_fused_rows_regrouped_as_its_own_split():
    """The plan's `[q | k | v | b | a | z]` rows of Qwen3-Next's fused in_proj_qkvz / in_proj_ba: the same values
    as transformers' own `fix_query_key_value_ordering` (fp64, 2 value heads per key head)."""
    from linattn.hf.kernelize_plan import _GDN
    ref, _ = _pair(arch="qwen3_next")
    layer = ref.model.layers[0].linear_attn.double()
    x = torch.randn(3, 1, ATTN["hidden_size"], dtype=torch.float64)
    with torch.no_grad():
        q, k, v, z, b, a = layer.fix_query_key_value_ordering(layer.in_proj_qkvz(x), layer.in_proj_ba(x))
        y = x @ _GDN(layer, "Qwen3NextForCausalLM").W.T
    want = torch.cat([t.reshape(3, 1, -1) for t in (q, k, v, b, a, z)], -1)
    assert y.shape == want.shape
    torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
