"""The single-token decoding fast path of the attention layers (`layers/fast_decode.py`, reached from
`AttentionBase.forward` through `fast_decode.step`):
the values of the general path (outputs and every cache entry, within 1e-6; in most configurations
the same bits: only the fused matrix-vector product may round a few projections differently),
taken only where it applies, and its fused projection weights rebuilt whenever a weight changes."""
import copy

import pytest
import torch
import torch.nn as nn

from linattn.layers import LayerCache, RMSNorm, fast_decode
from linattn.layers.base import AttentionBase
from linattn.layers.common import FusedParams
from linattn.models import LanguageModel, LMConfig
from tests.helpers import perturbed_mixer

FAST_MIXERS = ["linear-elu+1", "linear-relu", "linear-identity", "linear-taylor2", "retnet", "mamba2-gla", "gla",
               "deltanet", "gated-deltanet", "efla", "efla-adaptive", "efla-loose"]


class FastCount:
    """Counts the calls in which a fast step (`fast_decode.STEPS`) produced the output."""

    def __init__(self, monkeypatch, layer_cls=None):
        self.n = 0
        for kind, inner in list(fast_decode.STEPS.items()):
            monkeypatch.setitem(fast_decode.STEPS, kind, self._counted(inner))

    def _counted(self, inner):
        def counted(layer, x, cache, lins):
            out = inner(layer, x, cache, lins)
            self.n += out is not None
            return out
        return counted


def _flat(v):
    """Every tensor of a cache entry (tensors, LinearAttentionState tuples, ints)."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, tuple):
        return [t for x in v for t in _flat(x)]
    return [torch.tensor(v)] if v is not None else []


def same(a: torch.Tensor, b: torch.Tensor):
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def assert_same_cache(a: LayerCache, b: LayerCache):
    assert set(a) == set(b)
    for key in a:
        ta, tb = _flat(a[key]), _flat(b[key])
        assert len(ta) == len(tb), key
        for x, y in zip(ta, tb):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            same(x, y)




def _run(layer, x, prefill, fast):
    """Prefill `prefill` tokens (chunk form), then one token at a time; outputs [B, T, d] and the cache."""
    layer.fast_decode = fast
    cache = LayerCache()
    outs = []
    with torch.no_grad():
        if prefill:
            outs.append(layer(x[:, :prefill], cache=cache))
        for t in range(prefill, x.shape[1]):
            outs.append(layer(x[:, t:t + 1], cache=cache))
    return torch.cat(outs, 1), cache


@pytest.mark.parametrize("name", FAST_MIXERS)
@pytest.mark.parametrize("prefill", [0, 5])
def test_fast_step_equals_the_general_step(name, prefill, monkeypatch):
    layer = perturbed_mixer(name)
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))
    count = FastCount(monkeypatch, type(layer))
    ref, ref_cache = _run(layer, x, prefill, fast=False)
    assert count.n == 0
    got, cache = _run(layer, x, prefill, fast=True)
    assert count.n == x.shape[1] - prefill          # every decoded token took the fast path
    same(got, ref)
    assert_same_cache(cache, ref_cache)


@pytest.mark.parametrize("name", ["linear-elu+1", "gla", "gated-deltanet", "efla"])
def test_fast_step_fp64_and_options(name, monkeypatch):
    """fp64, RoPE, an output gate, biases on q/k/v, short conv on a linear mixer."""
    extra = dict(rope=True, qkv_bias=True, short_conv=True)
    if name == "linear-elu+1":
        extra["output_gate"] = True
    layer = perturbed_mixer(name, d=24, H=3, dtype=torch.float64, **extra)
    x = torch.randn(2, 7, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    count = FastCount(monkeypatch, type(layer))
    ref, ref_cache = _run(layer, x, 3, fast=False)
    got, cache = _run(layer, x, 3, fast=True)
    assert count.n == 4
    same(got, ref)
    assert_same_cache(cache, ref_cache)


@pytest.mark.parametrize("name", ["linear-elu+1", "gated-deltanet"])
def test_fast_and_general_steps_alternate(name):
    """Each path continues from the cache the other one left (views of one state tensor, or not)."""
    layer = perturbed_mixer(name)
    x = torch.randn(1, 10, 32, generator=torch.Generator().manual_seed(3))
    ref, ref_cache = _run(layer, x, 2, fast=False)
    cache, outs = LayerCache(), []
    with torch.no_grad():
        outs.append(layer(x[:, :2], cache=cache))
        for t in range(2, 10):
            layer.fast_decode = t % 3 != 0
            outs.append(layer(x[:, t:t + 1], cache=cache))
    same(torch.cat(outs, 1), ref)
    assert_same_cache(cache, ref_cache)


def test_fast_step_leaves_an_earlier_state_alone():
    """The step writes new tensors: a state taken from the cache before it does not change."""
    layer = perturbed_mixer("gated-deltanet")
    x = torch.randn(1, 4, 32)
    cache = LayerCache()
    with torch.no_grad():
        layer(x[:, :3], cache=cache)
        before = {k: [t.clone() for t in _flat(v)] for k, v in cache.items()}
        held = {k: _flat(v) for k, v in cache.items()}
        layer(x[:, 3:], cache=cache)
    for k in held:
        for t, t0 in zip(held[k], before[k]):
            assert torch.equal(t, t0)


@pytest.mark.parametrize("mixer", ["linear-elu+1", "retnet", "gla", "deltanet", "gated-deltanet", "efla"])
def test_model_decoding_fast_equals_general(mixer):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, mixer=mixer)).eval()
    ids = torch.randint(0, 50, (2, 10))
    full = model(ids).logits.detach()
    results = []
    for fast in (False, True):
        for m in model.modules():
            if isinstance(m, AttentionBase):
                m.fast_decode = fast
        with torch.no_grad():
            out = model(ids[:, :4], use_cache=True)
            logits = [out.logits]
            for t in range(4, 10):
                out = model(ids[:, t:t + 1], cache=out.cache)
                logits.append(out.logits)
        results.append(torch.cat(logits, 1))
    same(results[0], results[1])
    assert (results[1] - full).abs().max() <= 1e-4


@pytest.mark.parametrize("kw", [dict(mixer="gated-deltanet"), dict(mixer="linear-elu+1", ffn="none"),
                                dict(mixer=["efla", "softmax"], ffn="moe", n_experts=3, top_k=2),
                                dict(mixer="retnet", residual="hyperlink", final_norm=False),
                                dict(mixer="deltanet", memory_lobe="causal")])
def test_model_decoding_without_autograd_equals_the_training_path(kw):
    """Blocks decode one token inline without autograd (prenorm + SwiGLU or no FFN), or take their
    forward (MoE, Hyper-Link, memory lobe): the values of the path taken with autograd on."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=2, **kw)).eval()
    ids = torch.randint(0, 50, (2, 8))
    results = []
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            out = model(ids[:, :3], use_cache=True)
            logits = [out.logits.detach()]
            for t in range(3, 8):
                out = model(ids[:, t:t + 1], cache=out.cache)
                logits.append(out.logits.detach())
        results.append(torch.cat(logits, 1))
    same(results[1], results[0])


def test_mixers_without_a_fast_step_are_untouched(monkeypatch):
    """Subclasses of the fast layers (comba, kda, ...) and other mixers decode through their forward."""
    for name in ("kda", "comba", "delta-product", "mesanet", "fox", "linear-cosformer"):
        layer = perturbed_mixer(name)
        assert layer.fast_step_kind() is None
        x = torch.randn(1, 3, 32)
        with torch.no_grad():
            c = LayerCache()
            layer(x[:, :2], cache=c)
            layer(x[:, 2:], cache=c)
        assert c.fast is None


def test_no_fast_path_with_autograd_or_for_other_calls(monkeypatch):
    layer = perturbed_mixer("gated-deltanet")
    count = FastCount(monkeypatch, type(layer))
    x = torch.randn(1, 3, 32, requires_grad=True)
    cache = LayerCache()
    layer(x[:, :2], cache=cache)
    y = layer(x[:, 2:], cache=cache)            # grad enabled: the general path, differentiable
    y.sum().backward()
    assert count.n == 0 and x.grad is not None and layer.q_proj.weight.grad is not None
    with torch.no_grad():
        layer(x[:, :2])                         # no cache
        layer(x[:, :2], cache=LayerCache())     # prefill
        layer(x[:, :1], cache=LayerCache())     # one token: the fast path
    assert count.n == 1


def test_fast_path_steps_aside_for_hooks_and_replaced_modules(monkeypatch):
    layer = perturbed_mixer("linear-elu+1")
    count = FastCount(monkeypatch, type(layer))
    x = torch.randn(1, 1, 32)
    with torch.no_grad():
        plain = layer(x, cache=LayerCache())
        h = layer.k_proj.register_forward_hook(lambda m, i, o: o * 2)
        hooked = layer(x, cache=LayerCache())
        h.remove()
        h = nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
        layer(x, cache=LayerCache())
        h.remove()
    assert count.n == 1
    assert not torch.equal(plain, hooked)

    class Adapter(nn.Linear):   # what a LoRA-style wrapper looks like: not exactly nn.Linear
        pass

    a = Adapter(32, 32, bias=False)
    a.weight.data.copy_(layer.v_proj.weight)
    layer.v_proj = a
    with torch.no_grad():
        layer(x, cache=LayerCache())
    assert count.n == 1


def test_fused_weights_follow_optimizer_steps_and_loads():
    """The fused q/k/v(/beta/gate) weight is rebuilt after every change of a weight."""
    layer = perturbed_mixer("gated-deltanet")
    ref = copy.deepcopy(layer)
    ref.fast_decode = False
    x = torch.randn(1, 2, 32)

    def check():
        for m in (layer, ref):
            m.eval()
        with torch.no_grad():
            c1, c2 = LayerCache(), LayerCache()
            layer(x[:, :1], cache=c1), ref(x[:, :1], cache=c2)
            same(layer(x[:, 1:], cache=c1), ref(x[:, 1:], cache=c2))

    check()
    built = layer._fused._value[0]
    assert built is not None
    for m in (layer, ref):    # one identical optimizer step on both
        m.train()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(x).pow(2).mean().backward()
        opt.step()
    check()
    assert layer._fused._value[0] is not built
    assert torch.equal(layer._fused._value[0][:32], layer.q_proj.weight)
    state = {k: v + 0.5 for k, v in ref.state_dict().items()}
    layer.load_state_dict(state), ref.load_state_dict(state)
    check()
    assert torch.equal(layer._fused._value[0][-32:], layer.g_proj.weight)
    with torch.no_grad():
        layer.b_proj.bias.fill_(0.3), ref.b_proj.bias.fill_(0.3)
    check()
    # the state dict and the parameters are unchanged by the cache; copies rebuild their own
    assert set(layer.state_dict()) == set(ref.state_dict())
    clone = copy.deepcopy(layer)
    assert clone._fused._value is None


def test_fused_params_key():
    w1, w2 = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(2, 4))
    bias = nn.Parameter(torch.randn(2))
    f = FusedParams()
    a, b, none = f.get([w1, w2], [3, bias], [])
    assert torch.equal(a, torch.cat([w1, w2])) and not a.requires_grad and none is None
    assert torch.equal(b, torch.cat([torch.zeros(3), bias.detach()]))
    assert f.get([w1, w2], [3, bias], [])[0] is a
    with torch.no_grad():
        w2.mul_(2)
    a2 = f.get([w1, w2], [3, bias], [])[0]
    assert a2 is not a and torch.equal(a2, torch.cat([w1, w2]))
    w1.data = w1.data.double()            # new storage and dtype
    assert f.get([w1, w2], [3, bias], [])[0].dtype == torch.float64
    f.clear()
    assert f._value is None


def test_fused_params_after_clear_reuse_only_what_still_matches():
    """After `clear` (a new generation), unchanged parameters give back the same tensors (no new copy: the plans
    pointing into them stay valid); a write through `p.data` (no version bump, a NaN included) or another zero row count
    gives a new concatenation with the values as they are now (compared bit for bit)."""
    w1, w2, bias = (nn.Parameter(torch.randn(*s)) for s in ((3, 4), (2, 4), (2,)))
    f = FusedParams()
    a, b = f.get([w1, w2], [3, bias])
    f.clear()
    assert all(x is y for x, y in zip(f.get([w1, w2], [3, bias]), (a, b)))
    f.clear()
    w2.data[1, 2] += 1.0                  # invisible to the version key
    a2, b2 = f.get([w1, w2], [3, bias])
    assert a2 is not a and torch.equal(a2, torch.cat([w1, w2]).detach()) and b2 is not b
    f.clear()
    bias.data[0] = float("nan")
    b3 = f.get([w1, w2], [3, bias])[1]
    assert b3 is not b2 and torch.isnan(b3[3])
    f.clear()
    a3 = f.get([w1, w2], [3, bias])[0]
    f.clear()
    assert f.get([w1, w2], [2, bias])[0] is not a3   # another key: a new concatenation


@pytest.mark.parametrize("shape", [(2, 3, 32), (1, 1, 256), (1, 4, 64), (3, 5, 7)])
def test_rmsnorm_inference_path_is_bitwise(shape):
    norm = RMSNorm(shape[-1])
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(*shape) * 3
    with torch.no_grad():
        fast = norm(x)
    assert torch.equal(fast, norm(x).detach())


def test_a_new_generation_sees_weights_written_through_data():
    """`p.data` writes bypass the version keys; every new cache (a new generation) rebuilds the fused weights."""
    torch.manual_seed(0)
    m = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mixer="gated-deltanet")).eval()
    ids = torch.randint(0, 64, (1, 6))

    def decode_logits():
        with torch.no_grad():
            out = m(ids[:, :5], use_cache=True)
            return m(ids[:, 5:], cache=out.cache).logits[:, -1]

    decode_logits()                                   # builds the fused weights
    m.blocks[0].mixer.q_proj.weight.data.mul_(2.0)    # an EMA-style write: no version bump
    with torch.no_grad():
        full = m(ids).logits[:, -1]
    torch.testing.assert_close(decode_logits(), full, rtol=1e-5, atol=1e-5)


def test_model_decoding_runs_global_hooks_of_blocks():
    """A global forward hook sees every module a decoding step runs, the blocks' norms and FFN included."""
    torch.manual_seed(0)
    m = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mixer="linear-elu+1")).eval()
    ids = torch.randint(0, 64, (1, 6))
    seen = []
    with torch.no_grad():
        cache = m(ids[:, :5], use_cache=True).cache
        handle = nn.modules.module.register_module_forward_hook(lambda mod, i, o: seen.append(type(mod).__name__))
        try:
            m(ids[:, 5:], cache=cache)
        finally:
            handle.remove()
    assert seen.count("SwiGLU") == 2 and seen.count("RMSNorm") == 5   # 2 blocks x 2 norms + the final norm


def test_diagonal_gate_replaced_by_an_adapter_takes_the_general_step():
    torch.manual_seed(0)
    m = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mixer="gla")).eval()
    mixer = m.blocks[0].mixer
    mixer.gk_proj = nn.Linear(32, mixer.gk_proj[1].out_features)   # e.g. a wrapper that merged the low rank
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        cache = m(ids[:, :5], use_cache=True).cache
        step = m(ids[:, 5:], cache=cache).logits[:, -1]
        full = m(ids).logits[:, -1]
    torch.testing.assert_close(step, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gated-deltanet", "linear-elu+1"])
@pytest.mark.parametrize("compiled", [False, True])
def test_fast_step_state_lives_in_the_typed_cache_field(name, compiled):
    """What the fast step keeps beside the cache's entries is the typed `LayerCache.fast` (a FastDecodeState whose
    views are the cache's own entries), nothing else on the cache object."""
    from linattn.layers.cache import FastDecodeState
    layer = perturbed_mixer(name, short_conv=True)
    layer.compiled_decode = compiled
    cache = LayerCache()
    with torch.no_grad():
        for _ in range(3):
            layer(torch.randn(1, 1, 32), cache=cache)
    assert set(vars(cache)) == set(vars(LayerCache())) and isinstance(cache.fast, FastDecodeState)   # no more
    assert all(a is cache[k] for a, k in zip(cache.fast.conv_views, ("conv_q", "conv_k", "conv_v")))
    assert (cache.fast.linear_of is cache["state"]) == name.startswith("linear")
