"""linattn.hf.kernelize against transformers' own code: tiny random models built from each architecture's config
class (no downloads). Per architecture: logits and the loss's gradients patched vs unpatched (fp32), 32-token
greedy generation identical, cached decode equal to the full forward, packed documents equal to separate ones.
transformers' fallbacks compute the cores in fp32 even for fp64 models (they cast with .float() /
.to(torch.float32)), so an fp64 comparison is only meaningful for MiniMax, whose lightning attention computes
in the model's dtype: that one is checked in fp64 too."""
import copy
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

from linattn.errors import LinattnError  # noqa: E402
from linattn.hf import kernelize  # noqa: E402
from tests.hf.kernelize_models import (  # noqa: E402, F401
    ARCHS,
    T,
    V,
    build,
    ids as _ids,
    maxdiff as _maxdiff,
    pair,
    transformers_torch_code,  # noqa: E402, F401  (autouse)
)


def _mixer_out(mod, hidden, seed=11):
    """One served module on a random [2, T, hidden] input, without a cache."""
    x = torch.randn(2, T, hidden, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        y = mod(x, None, None) if type(mod).__name__ == "MiniMaxLightningAttention" else mod(x)
    return y[0] if isinstance(y, tuple) else y


def _decode(model, ids, n_prefill=13):
    out = model(ids[:, :n_prefill], use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    steps = [out.logits]
    for t in range(n_prefill, ids.shape[1]):
        out = model(ids[:, t:t + 1], cache=cache, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        steps.append(out.logits)
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_kernelize_matches_transformers(arch):
    ref, fast, report = pair(arch)
    # every served module really runs linattn: the dispatchers are installed where transformers looks
    for name in report.patched:
        assert getattr(fast.get_submodule(name), "_linattn_kernelized", False)
    ids = _ids(1)

    # 0. each served module alone (a mixer's output can be too small at init to move the logits: Falcon-H1's)
    hidden = ref.config.get_text_config().hidden_size
    for name in report.patched:
        y_r, y_f = _mixer_out(ref.get_submodule(name), hidden), _mixer_out(fast.get_submodule(name), hidden)
        assert _maxdiff(y_r, y_f) <= 1e-5 * y_r.abs().max().item(), (arch, name)

    # 1. logits and the loss's gradients, fp32
    ref.train()
    fast.train()
    out_r = ref(ids, labels=ids, use_cache=False)
    out_f = fast(ids, labels=ids, use_cache=False)
    scale = out_r.logits.abs().max().item()
    assert _maxdiff(out_r.logits, out_f.logits) <= 2e-5 * max(1.0, scale), arch
    out_r.loss.backward()
    out_f.loss.backward()
    pr = dict(ref.named_parameters())
    n_checked = 0
    for name, p in fast.named_parameters():
        gr = pr[name].grad
        if gr is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        n_checked += 1
        tol = 1e-4 * max(1.0, gr.abs().max().item())
        assert _maxdiff(gr, p.grad) <= tol, (arch, name, _maxdiff(gr, p.grad))
    assert n_checked > 5
    ref.eval()
    fast.eval()

    with torch.no_grad():
        # 2. cached decode equals the full forward: prefill 13 tokens, then decode 8 one at a time. Bamba's own
        # code (unpatched) is off by ~2e-4 here already: the bound is then transformers' own gap, and the patched
        # decode must equal the unpatched one
        full = fast(ids, use_cache=False).logits
        dec_f = _decode(fast, ids)
        tol = 2e-5 * max(1.0, full.abs().max().item())
        if arch == "bamba":
            dec_r = _decode(ref, ids)
            own_gap = _maxdiff(dec_r, ref(ids, use_cache=False).logits)
            assert _maxdiff(dec_f, dec_r) <= tol
            tol = max(tol, 1.01 * own_gap)
        assert _maxdiff(dec_f, full) <= tol, arch

        # 3. packed documents (restarting position_ids, batch 1) give each document its own logits
        a, b = _ids(2, 9, 1), _ids(3, 12, 1)
        packed = torch.cat([a, b], dim=1)
        pos = torch.cat([torch.arange(9), torch.arange(12)])[None]
        lp = fast(packed, position_ids=pos, use_cache=False).logits
        la = fast(a, use_cache=False).logits
        lb = fast(b, use_cache=False).logits
        assert _maxdiff(lp, torch.cat([la, lb], dim=1)) <= 2e-5 * max(1.0, la.abs().max().item()), arch

    # 4. 32-token greedy generation identical
    prompt = _ids(4, 5, 1)
    gr = ref.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    gf = fast.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert gr.shape[1] == 37
    assert torch.equal(gr, gf), arch


def test_linattn_really_runs(monkeypatch):
    """The served modules call linattn's operators (and the unpatched twin never does)."""
    km = importlib.import_module("linattn.hf.kernelize")
    calls = []
    for name in ("delta_rule", "linear_attention"):
        orig = getattr(km, name)
        monkeypatch.setattr(km, name, lambda *a, _o=orig, _n=name, **k: calls.append(_n) or _o(*a, **k))
    for arch, op in (("qwen3_5", "delta_rule"), ("kimi_linear", "delta_rule"), ("mamba2", "linear_attention"),
                     ("minimax", "linear_attention")):
        ref, fast, _ = pair(arch)
        ids = _ids(10, 6)
        with torch.no_grad():
            ref(ids, use_cache=False)
            assert calls == [], arch
            fast(ids, use_cache=False)
        assert calls and set(calls) == {op}, (arch, calls)
        calls.clear()


def test_minimax_fp64():
    """MiniMax's lightning attention computes in the model's dtype (the RMSNorms do not: they go through fp32;
    and its decay tables are built in fp32 at __init__), so the fp64 check is on the mixer itself, its norm set
    aside and the tables rebuilt in fp64: patched vs unpatched to ~1e-15."""
    ref, fast, report = pair("minimax", torch.float64)
    name = report.patched[0]
    mr, mf = ref.get_submodule(name), fast.get_submodule(name)
    mr.norm = mf.norm = torch.nn.Identity()
    # transformers builds its decay tables in fp32 at __init__ (then .to(float64) casts them): rebuild them in fp64
    mr.query_decay, mr.key_decay, mr.diagonal_decay = mr.decay_factors(mr.slope_rate)
    x = torch.randn(2, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    yr, sr = mr(x, None, None)
    yf, sf = mf(x, None, None)
    assert _maxdiff(yr, yf) < 1e-12 and _maxdiff(sr, sf) < 1e-12
    (gr,) = torch.autograd.grad(yr.square().sum(), x)
    (gf,) = torch.autograd.grad(yf.square().sum(), x)
    assert _maxdiff(gr, gf) < 1e-11


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_lightning_decode_step_is_the_recurrent_form(dtype):
    """The one-token lightning step (kernelize's decode of MiniMax's lightning attention) gives the bits of
    `linear_attention`'s recurrent form with the same options (compute dtype fp32 for bf16 inputs)."""
    from linattn.hf.kernelize import _kv_state, lightning_step
    from linattn.ops import linear_attention

    g = torch.Generator().manual_seed(3)
    B, H, D = 2, 3, 8
    cd = torch.float64 if dtype == torch.float64 else torch.float32
    q, k, v = (torch.randn(B, 1, H, D, generator=g).to(dtype) for _ in range(3))
    gamma = torch.exp(-torch.rand(H, generator=g, dtype=cd))
    kv0 = torch.randn(B, H, D, D, generator=g, dtype=cd)
    kv, o = lightning_step(q, k, v, gamma, kv0)
    o_ref, st = linear_attention(q, k, v, feature_map=None, normalize=False, gamma=gamma, scale=1.0,
                                 mode="recurrent", initial_state=_kv_state(kv0), output_final_state=True)
    assert o.dtype == dtype and o.shape == o_ref.shape
    assert torch.equal(kv, st.kv) and torch.equal(o, o_ref)


def test_cu_seq_lens_kwargs():
    """transformers' own cu_seq_lens_* kwargs (flash-attention style) pack as well as restarting position_ids."""
    _, fast, _ = pair("qwen3_5")
    a, b = _ids(6, 7, 1), _ids(7, 10, 1)
    cu = torch.tensor([0, 7, 17], dtype=torch.int32)
    pos = torch.cat([torch.arange(7), torch.arange(10)])[None]
    with torch.no_grad():
        lp = fast(torch.cat([a, b], 1), position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10,
                  max_length_k=10, use_cache=False).logits
        sep = torch.cat([fast(a, use_cache=False).logits, fast(b, use_cache=False).logits], 1)
    assert _maxdiff(lp, sep) < 1e-5


def test_unpatched_model_of_same_class_keeps_transformers_code():
    """The dispatchers call linattn only inside a kernelized module: a second, unpatched model still refuses
    packed sequences exactly as transformers does without fla."""
    ref, fast, _ = pair("qwen3_5")
    cu = torch.tensor([0, 7, 17], dtype=torch.int32)
    with pytest.raises(ValueError, match="packed sequences"):
        ref(_ids(8, 17, 1), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10, max_length_k=10, use_cache=False)


def test_kernelize_twice_and_report():
    _, fast, r1 = pair("mamba2")
    r2 = kernelize(fast)
    assert r1.patched == r2.patched == list(r2) and len(r2) == 2
    assert set(r1.kinds.values()) == {"mamba2"}
    assert r1.packing_wrapped == r2.packing_wrapped == ["", "backbone"]


def test_bf16_model():
    """A bf16 model runs patched (cores in fp32) and stays within bf16 resolution of transformers' own."""
    for arch in ("qwen3_5", "mamba2"):
        ref, fast, _ = pair(arch, torch.bfloat16)
        ids = _ids(13)
        with torch.no_grad():
            a, b = ref(ids, use_cache=False).logits.float(), fast(ids, use_cache=False).logits.float()
        assert _maxdiff(a, b) <= 1e-2 * max(1.0, a.abs().max().item()), arch


def test_deepcopy_of_a_kernelized_model_runs_on_its_own_weights():
    """copy.deepcopy (EMA / reference models) gives a copy whose served forwards use the copy's weights."""
    for arch in ("qwen3_5", "minimax"):
        _, fast, report = pair(arch)
        twin = copy.deepcopy(fast)
        ids = _ids(13, 9)
        with torch.no_grad():
            before = fast(ids, use_cache=False).logits
            for name in report.patched:
                mod = twin.get_submodule(name)
                assert mod.forward.__self__ is mod
                next(p for n, p in mod.named_parameters() if "out_proj" in n).mul_(3.0)
            assert _maxdiff(fast(ids, use_cache=False).logits, before) == 0      # the original is untouched
            assert _maxdiff(twin(ids, use_cache=False).logits, before) > 1e-3, arch

def test_unserved_module_raises_or_is_listed():
    """Never a silent partial patch: a Mamba1 mixer is named with the reason."""
    if getattr(transformers, "MambaConfig", None) is None:
        pytest.skip("no MambaConfig")
    m = transformers.MambaForCausalLM(transformers.MambaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=1,
                                                               state_size=4))
    with pytest.raises(LinattnError, match="backbone.layers.0.mixer.*selective scan"):
        kernelize(m)
    r = kernelize(m, skip_unserved=True)
    assert r.patched == [] and list(r.unserved) == ["backbone.layers.0.mixer"]


def test_packed_batch_over_one_refused():
    _, fast, _ = pair("qwen3_5")
    pos = torch.cat([torch.arange(4), torch.arange(4)])[None].expand(2, -1)
    with pytest.raises(LinattnError, match="batch size 1"):
        fast(_ids(9, 8), position_ids=pos, use_cache=False)


def test_not_a_module():
    with pytest.raises(LinattnError, match="model must be"):
        kernelize("qwen")


def test_padded_batch_generation_is_not_taken_for_packing():
    """generate() on a left-padded batch passes position_ids that jump at the padding: with an attention mask
    they are never read as packed documents, and patched greedy tokens equal transformers' own."""
    ref, fast, _ = pair("qwen3_5")
    ids = _ids(12, 7)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    gr = ref.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    gf = fast.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.equal(gr, gf)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_sdpa_keeps_documents_apart(causal):
    """linattn_sdpa with cu_seq_lens_q: each document attends to itself only, causally for causal layers and
    both ways for a non-causal one (a VLM's vision tower passes its own cu_seq_lens_q)."""
    km = importlib.import_module("linattn.hf.kernelize")
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 10, 8, generator=g) for _ in range(3))
    mod = torch.nn.Module()
    mod.is_causal = causal
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    out, _ = km._varlen_sdpa(mod, q, k, v, None, cu_seq_lens_q=cu)
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(q[:, :, s:e], k[:, :, s:e], v[:, :, s:e],
                                                                      is_causal=causal)
                     for s, e in ((0, 4), (4, 10))], dim=2).transpose(1, 2)
    assert _maxdiff(out, ref) < 1e-6

def equivalence_row(arch):
    """One row of docs/kernelize.md's equivalence table (`python tests/hf/test_kernelize.py` prints them all)."""
    ref, fast, rep = pair(arch)
    ids = _ids(1)
    hidden = ref.config.get_text_config().hidden_size
    mod_err = max(_maxdiff(_mixer_out(ref.get_submodule(n), hidden), _mixer_out(fast.get_submodule(n), hidden))
                  / _mixer_out(ref.get_submodule(n), hidden).abs().max().item() for n in rep.patched)
    ref.train()
    fast.train()
    o_r, o_f = ref(ids, labels=ids, use_cache=False), fast(ids, labels=ids, use_cache=False)
    d_logits, scale = _maxdiff(o_r.logits, o_f.logits), o_r.logits.abs().max().item()
    o_r.loss.backward()
    o_f.loss.backward()
    pr = dict(ref.named_parameters())
    pairs = [(pr[n].grad, p.grad) for n, p in fast.named_parameters() if pr[n].grad is not None]
    d_grad = max(_maxdiff(a, b) for a, b in pairs) / max(a.abs().max().item() for a, _ in pairs)
    ref.eval()
    fast.eval()
    with torch.no_grad():
        d_dec = _maxdiff(_decode(fast, ids), fast(ids, use_cache=False).logits)
        own = _maxdiff(_decode(ref, ids), ref(ids, use_cache=False).logits)
        a, b = _ids(2, 9, 1), _ids(3, 12, 1)
        pos = torch.cat([torch.arange(9), torch.arange(12)])[None]
        lp = fast(torch.cat([a, b], 1), position_ids=pos, use_cache=False).logits
        d_pack = _maxdiff(lp, torch.cat([fast(a, use_cache=False).logits, fast(b, use_cache=False).logits], 1))
    p = _ids(4, 5, 1)
    same = torch.equal(ref.generate(p, max_new_tokens=32, do_sample=False, min_new_tokens=32),
                       fast.generate(p, max_new_tokens=32, do_sample=False, min_new_tokens=32))
    return (f"| {arch} | {','.join(sorted(set(rep.kinds.values())))} | {len(rep.patched)} | {mod_err:.1e} | "
            f"{d_logits:.1e} (of {scale:.1f}) | {d_grad:.1e} | {d_dec:.1e} ({own:.1e}) | {d_pack:.1e} | "
            f"{'identical' if same else 'DIFFERENT'} |")


if __name__ == "__main__":
    print("| architecture | kind | modules | module alone | logits | gradients | decode vs full (transformers' own) "
          "| packed vs separate | 32-token greedy |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch in ARCHS:
        print(equivalence_row(arch), flush=True)


@pytest.mark.parametrize("name, replaces, module", [
    ("gdn_chunk", "torch_chunk_gated_delta_rule", "qwen3_next"),
    ("gdn_recurrent", "torch_recurrent_gated_delta_rule", "qwen3_next"),
    ("kda_chunk", "chunk_kimi_delta_attention", "kimi_linear"),
    ("kda_recurrent", "recurrent_kimi_delta_attention", "kimi_linear")])
def test_delta_adapters_keep_transformers_signature_and_compute_delta_rule(name, replaces, module):
    """The four adapters come from one factory: each takes its transformers function's parameters (positionally
    too) and returns delta_rule's answer in that form."""
    import inspect

    from linattn import delta_rule

    mod = importlib.import_module("linattn.hf.kernelize")
    adapter = getattr(mod, name)
    theirs = inspect.unwrap(getattr(importlib.import_module(f"transformers.models.{module}.modeling_{module}"),
                                    replaces))
    assert list(inspect.signature(adapter).parameters) == list(inspect.signature(theirs).parameters)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 7, 2, 4, generator=gen, dtype=torch.float64), torch.randn(1, 7, 2, 4, generator=gen,
                                                                                   dtype=torch.float64)
    v, beta = torch.randn(1, 7, 4, 3, generator=gen, dtype=torch.float64), torch.rand(1, 7, 4, generator=gen,
                                                                                     dtype=torch.float64)
    g = -torch.rand(1, 7, 4, *((4,) if name.startswith("kda") else ()), generator=gen, dtype=torch.float64)
    s0 = torch.randn(1, 4, 4, 3, generator=gen, dtype=torch.float64)
    mode = "chunk" if name.endswith("chunk") else "recurrent"
    want = delta_rule(q, k, v, beta, g=g, qk_l2norm="rsqrt", mode=mode, initial_state=s0, output_final_state=True)
    positional = (q, k, v, g, beta) + ((64,) if mode == "chunk" else ()) + (s0, True, True)
    for got in (adapter(*positional), adapter(q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True)):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["qwen3_5", "mamba2"])
def test_a_hooked_model_runs_the_packing_hooks_in_its_forward(arch):
    """A model given the compiled decode hook (`report.compiled_decode`) gets kernelize's packing hooks as calls in
    its forward, not as hooks on it (its `__call__` then takes torch's path without hooks; its base model keeps
    its own): packed documents stay apart (Mamba2ForCausalLM, whose forward passes no kwargs to its backbone, hands
    them over through the backbone's stash, emptied after the call, also when the forward raised), and a packed
    batch that asks for a cache is refused."""
    _, fast, report = pair(arch)
    assert report.compiled_decode and report.packing_wrapped[0] == ""
    assert not fast._forward_pre_hooks and not fast._forward_hooks
    assert fast.base_model._forward_pre_hooks and fast.base_model._forward_hooks
    a, b = _ids(2, 9, 1), _ids(3, 12, 1)
    pos = torch.cat([torch.arange(9), torch.arange(12)])[None]
    with torch.no_grad():
        lp = fast(torch.cat([a, b], dim=1), position_ids=pos, use_cache=False).logits
        la, lb = fast(a, use_cache=False).logits, fast(b, use_cache=False).logits
        assert _maxdiff(lp, torch.cat([la, lb], dim=1)) <= 2e-5 * max(1.0, la.abs().max().item())
        assert fast.base_model._linattn_stash == {}
        with pytest.raises(LinattnError, match="cannot fill a cache"):
            fast(torch.cat([a, b], dim=1), position_ids=pos, use_cache=True)
        with pytest.raises((ValueError, RuntimeError)):   # (the loss on labels of another shape, after the base)
            fast(torch.cat([a, b], dim=1), position_ids=pos, use_cache=False, labels=torch.zeros(3, 3))
        assert fast.base_model._linattn_stash == {}
