"""A kernelized Mamba2 decodes through the compiled whole-model plan (hf/kernelize_plan_mamba2.py): through
transformers' `generate`, against the UNPATCHED model (transformers' PyTorch code): greedy tokens identical and
logits within 1e-5 (fp32), sampled tokens with a seed, batch > 1, beam search, transformers' cache objects holding
transformers' values, a cache copied, continued or advanced by transformers' own code between compiled tokens, left
padding, one compiled call per decoded token, the plan rebuilt when a weight it copied is updated in
place, bf16, and what the plan does not compute stepping aside."""
import copy
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Mamba2ForCausalLM"):
    pytest.skip(f"the installed transformers ({transformers.__version__}) has no Mamba2", allow_module_level=True)

from linattn.cpu import decode as cpu_decode  # noqa: E402
from linattn.hf import kernelize  # noqa: E402
from linattn.hf.kernelize_plan_mamba2 import undescribed_reason  # noqa: E402
from tests.helpers import CompiledDecodeCalls  # noqa: E402
from tests.hf.kernelize_models import V, maxdiff, transformers_torch_code  # noqa: E402, F401  (autouse)

pytestmark = pytest.mark.skipif(not cpu_decode.available(), reason="no C compiler: the compiled kernels are off")


def _pair(dtype=torch.float32, tied=False, hooked=True, **cfg):
    """(unpatched, kernelized) Mamba2 of 3 layers, 2 groups of B / C; the norms, A_log / dt_bias / D and the conv
    bias moved off their init values."""
    cfg = transformers.Mamba2Config(**{**dict(
        vocab_size=V, hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, expand=2, conv_kernel=4,
        num_hidden_layers=3, chunk_size=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=tied), **cfg})
    torch.manual_seed(0)
    ref = transformers.Mamba2ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n or "A_log" in n or "dt_bias" in n or n.endswith(".D") or "conv1d.bias" in n:
                p.add_(0.2 * torch.randn_like(p))
    ref = ref.to(dtype).eval()
    fast = copy.deepcopy(ref)
    assert kernelize(fast).compiled_decode is hooked
    return ref, fast


def _prompt(B, T, seed=1):
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


def _generate(model, prompt, n, **kw):
    return model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **{**GREEDY, **kw})


def _close(a, b, tol=1e-5):
    return maxdiff(a, b) <= tol * max(1.0, b.abs().max().item())


@pytest.mark.parametrize("B,T,n,tied", [(1, 1, 12, False), (3, 9, 40, False), (2, 5, 8, True)])
def test_greedy_generate_matches_the_unpatched_model(B, T, n, tied, monkeypatch):
    ref, fast = _pair(tied=tied)
    assert inspect.signature(fast.forward) == inspect.signature(ref.forward)
    prompt = _prompt(B, T)
    calls = CompiledDecodeCalls(monkeypatch)
    got = _generate(fast, prompt, n)
    assert calls.model == n - 1
    want = _generate(ref, prompt, n)
    assert torch.equal(got.sequences, want.sequences)
    assert _close(torch.stack(got.logits), torch.stack(want.logits))


def test_cache_objects_hold_transformers_values(monkeypatch):
    ref, fast = _pair()
    prompt = _prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    got, want = (_generate(m, prompt, 5).past_key_values for m in (fast, ref))
    assert calls.model == 4
    for lg, lw in zip(got.layers, want.layers):
        assert lg.recurrent_states[0].shape == lw.recurrent_states[0].shape
        torch.testing.assert_close(lg.recurrent_states[0], lw.recurrent_states[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lg.conv_states[0], lw.conv_states[0], rtol=1e-5, atol=1e-6)


def test_sampling_with_a_seed(monkeypatch):
    ref, fast = _pair()
    prompt = _prompt(2, 4)
    calls = CompiledDecodeCalls(monkeypatch)
    outs = []
    for m in (fast, ref):
        torch.manual_seed(7)
        outs.append(m.generate(prompt, max_new_tokens=10, min_new_tokens=10, do_sample=True, top_k=20,
                               temperature=0.9))
    assert calls.model == 9
    assert torch.equal(outs[0], outs[1])


def test_beam_search_reorders_the_cache(monkeypatch):
    ref, fast = _pair()
    prompt = _prompt(1, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    got = fast.generate(prompt, max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False)
    assert calls.model > 0
    want = ref.generate(prompt, max_new_tokens=8, min_new_tokens=8, num_beams=3, do_sample=False)
    assert torch.equal(got, want)


def test_left_padding(monkeypatch):
    """A left-padded prompt: the mask enters transformers' prefill only (Mamba2's generate passes no mask to its
    one-token steps, which decode every row from its state), so the decoded tokens take the plan and give the
    unpatched model's tokens and logits; a call given a mask with a zero steps aside."""
    ref, fast = _pair()
    prompt = _prompt(2, 7)
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    calls = CompiledDecodeCalls(monkeypatch)
    got = _generate(fast, prompt, 6, attention_mask=mask)
    assert calls.model == 5
    want = _generate(ref, prompt, 6, attention_mask=mask)
    assert torch.equal(got.sequences, want.sequences)
    assert _close(torch.stack(got.logits), torch.stack(want.logits))
    with torch.no_grad():
        caches = [m(prompt, use_cache=True).cache for m in (fast, ref)]
        step = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        lg = [m(prompt[:, -1:], cache=c, attention_mask=step).logits for m, c in zip((fast, ref), caches)]
    assert calls.model == 5 and _close(lg[0], lg[1])


def test_cache_copied_continued_and_advanced_by_transformers_between_calls(monkeypatch):
    """A deep copy of the cache decoded on its own (the original unchanged); tokens decoded by transformers' own code
    (LINATTN_CPU_KERNELS=0) between compiled ones; a generate continued on a returned cache."""
    ref, fast = _pair()
    prompt = _prompt(2, 6)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        outs = [m(prompt, use_cache=True) for m in (fast, ref)]
        caches = [o.cache for o in outs]
        tok = outs[1].logits[:, -1:].argmax(-1)
        for step in range(8):
            if step == 3:
                copies = [copy.deepcopy(c) for c in caches]
                snap = caches[0].layers[1].recurrent_states[0].clone()
                lc = [m(tok, cache=c).logits for m, c in zip((fast, ref), copies)]
                assert _close(lc[0], lc[1])
                assert torch.equal(caches[0].layers[1].recurrent_states[0], snap)
            if step in (4, 5):
                monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
            else:
                monkeypatch.delenv("LINATTN_CPU_KERNELS", raising=False)
            lg = [m(tok, cache=c).logits for m, c in zip((fast, ref), caches)]
            assert _close(lg[0], lg[1]), step
            tok = lg[1].argmax(-1)
    assert calls.model == 8 - 2 + 1
    got, want = _generate(fast, prompt, 4), _generate(ref, prompt, 4)
    more = [_generate(m, g.sequences, 5, cache=g.past_key_values) for m, g in zip((fast, ref), (got, want))]
    assert torch.equal(more[0].sequences, more[1].sequences)
    assert _close(torch.stack(more[0].logits), torch.stack(more[1].logits))


@pytest.mark.parametrize("name", ["backbone.layers.0.norm.weight", "backbone.layers.1.mixer.A_log",
                                  "backbone.layers.2.mixer.in_proj.weight", "backbone.layers.1.mixer.D",
                                  "backbone.layers.0.mixer.norm.weight", "backbone.norm_f.weight"])
def test_in_place_update_of_a_weight_is_read(name, monkeypatch):
    """A weight updated in place between tokens: the next token reads the new value (-exp(A_log), a copy, rebuilds
    the plan; the others are read in place)."""
    ref, fast = _pair()
    prompt = _prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(prompt, use_cache=True).cache for m in (fast, ref)]
        tok = prompt[:, -1:]
        for m, c in zip((fast, ref), caches):
            m(tok, cache=c)
        guard = fast._linattn_model_plan.guard
        for m in (fast, ref):
            m.get_parameter(name).add_(0.5)
        assert guard.valid() is not name.endswith("A_log")
        lg = [m(tok, cache=c).logits for m, c in zip((fast, ref), caches)]
    assert calls.model == 2
    assert _close(lg[0], lg[1])


def test_a_hook_on_a_described_module_steps_aside(monkeypatch):
    ref, fast = _pair()
    seen = []
    fast.backbone.layers[1].mixer.out_proj.register_forward_hook(lambda *a: seen.append(1))
    calls = CompiledDecodeCalls(monkeypatch)
    prompt = _prompt(1, 4)
    got, want = _generate(fast, prompt, 4), _generate(ref, prompt, 4)
    assert calls.model == 0 and len(seen) == 4
    assert torch.equal(got.sequences, want.sequences)


def test_bf16_decodes_through_the_plan(monkeypatch):
    """bf16 weights: read as stored, computed in fp32; fp32 logits (as transformers returns them) within bf16's
    rounding of the unpatched model's."""
    ref, fast = _pair(torch.bfloat16)
    prompt = _prompt(2, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        caches = [m(prompt, use_cache=True).cache for m in (fast, ref)]
        tok = prompt[:, -1:]
        for _ in range(4):
            lg = [m(tok, cache=c).logits for m, c in zip((fast, ref), caches)]
            assert lg[0].dtype == lg[1].dtype == torch.float32
            assert _close(lg[0], lg[1], 0.05)
            tok = lg[1].argmax(-1)
    assert calls.model == 4


def test_a_clamped_time_step_steps_aside():
    """transformers clamps dt in its chunked prefill but not in its one-token step: a model with a finite
    time_step_limit is not hooked (the reason is given) and decodes as the unpatched model."""
    ref, fast = _pair(hooked=False, time_step_limit=(0.0, 0.5))
    assert "time_step_limit" in undescribed_reason(fast)
    prompt = _prompt(2, 4)
    got, want = _generate(fast, prompt, 4), _generate(ref, prompt, 4)
    assert torch.equal(got.sequences, want.sequences)


def test_under_torch_compile_the_plan_steps_aside(monkeypatch):
    """A cached one-token call inside torch.compile runs transformers' code (traced), not the compiled plan: the
    same logits as the eager call on a copy of the cache, no compiled call."""
    _, fast = _pair()
    prompt = _prompt(1, 5)
    calls = CompiledDecodeCalls(monkeypatch)
    with torch.no_grad():
        cache = fast(prompt, use_cache=True).cache
        twin = copy.deepcopy(cache)
        tok = prompt[:, -1:]
        torch._dynamo.reset()
        got = torch.compile(fast)(tok, cache=cache).logits
        assert calls.model == 0
        want = fast(tok, cache=twin).logits
    assert calls.model == 1
    assert _close(got, want)
    torch._dynamo.reset()
