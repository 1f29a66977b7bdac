"""RWKV-7 (ops/rwkv7.py, layers/rwkv7.py): every form against the fp64 token loop (rwkv7_ref), outputs, final
states and gradients, fp32 and fp64, awkward lengths, cu_seqlens, initial states; agreement with fla's own naive
DPLR recurrence (which fla's chunk_rwkv7 calls) when fla's wheel is at hand; bad input."""
import importlib.util
import os
import sys
import types
import zipfile

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.errors import LinattnError
from linattn.ops.reference import rwkv7_ref

MODES = ["recurrent", "chunk", "parallel"]
# "torch": the core's interleaved forms (the fallback); "auto": on CPU tensors the compiled scan (csrc/rwkv7.c)
# when a C compiler is at hand, else the same fallback (tests/ops/test_rwkv7_cpu.py checks which ran)
BACKENDS = ["torch", "auto"]
W_BOUND = 0.6065306597126334   # exp(-1/2): fla's bound on -w in the RWKV-7 layer
WHEEL = os.path.join(os.path.dirname(__file__), "..", "..", "wheels", "fla_core-0.6.0-py3-none-any.whl")


def _inputs(B=2, T=11, H=2, K=5, V=4, dtype=torch.float64, seed=0, grad=False):
    """RWKV-7-like inputs: w in (-e^-0.5, 0) as the layer makes it, a = -kk, b = kk * sigmoid (fla's layer)."""
    g = torch.Generator().manual_seed(seed)
    r, k = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, H, K, generator=g)
    w = -W_BOUND * torch.rand(B, T, H, K, generator=g)
    kk = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    a, b = -kk, kk * torch.rand(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    S0 = torch.randn(B, H, K, V, generator=g)
    xs = [x.to(dtype).requires_grad_(grad) for x in (r, w, k, v, a, b, S0)]
    return xs[:6], xs[6]


def _tol(dtype):
    return 1e-10 if dtype == torch.float64 else 2e-4


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", [1, 11, 20])
@pytest.mark.parametrize("backend", BACKENDS)
def test_forms_match_reference(mode, dtype, T, backend):
    # chunk_size 3 tokens: T = 11 and 20 are not multiples; T = 1 a single token
    (r, w, k, v, a, b), S0 = _inputs(T=T, dtype=dtype)
    o, S = linattn.rwkv7(r, w, k, v, a, b, initial_state=S0, output_final_state=True, mode=mode, chunk_size=3,
                         backend=backend)
    o_ref, S_ref = rwkv7_ref(r, w, k, v, a, b, S0=S0)
    assert o.dtype == dtype and S.shape == S0.shape
    tol = _tol(dtype)
    assert (o.double() - o_ref).abs().max() < tol * (1 + o_ref.abs().max())
    assert (S.double() - S_ref).abs().max() < tol * (1 + S_ref.abs().max())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_reference(mode, dtype, backend):
    xs, S0 = _inputs(T=7, dtype=dtype, grad=True, seed=1)
    o, S = linattn.rwkv7(*xs, scale=0.7, initial_state=S0, output_final_state=True, mode=mode, chunk_size=3,
                         backend=backend)
    go = torch.randn(o.shape, generator=torch.Generator().manual_seed(5))
    gS = torch.randn(S.shape, generator=torch.Generator().manual_seed(6))
    grads = torch.autograd.grad((o * go.to(dtype)).sum() + (S * gS.to(S.dtype)).sum(), xs + [S0])
    ref_in = [x.detach().double().requires_grad_() for x in xs + [S0]]
    o_r, S_r = rwkv7_ref(*ref_in[:6], scale=0.7, S0=ref_in[6])
    refs = torch.autograd.grad((o_r * go.double()).sum() + (S_r * gS.double()).sum(), ref_in)
    for name, g_, g_ref in zip("r w k v a b S0".split(), grads, refs):
        assert (g_.double() - g_ref).abs().max() < _tol(dtype) * (1 + g_ref.abs().max()), name


def test_default_scale_is_one_and_states_carry_across_calls():
    (r, w, k, v, a, b), _ = _inputs(T=12)
    o_ref, S_ref = rwkv7_ref(r, w, k, v, a, b, scale=1.0)
    o1, S1 = linattn.rwkv7(*(x[:, :5] for x in (r, w, k, v, a, b)), output_final_state=True)
    o2, S2 = linattn.rwkv7(*(x[:, 5:] for x in (r, w, k, v, a, b)), initial_state=S1, output_final_state=True,
                           mode="recurrent")
    assert torch.allclose(torch.cat([o1, o2], 1), o_ref, atol=1e-12, rtol=0)
    assert torch.allclose(S2, S_ref, atol=1e-12, rtol=0)
    o, S = linattn.rwkv7(r, w, k, v, a, b)
    assert S is None and torch.allclose(o, o_ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cu_seqlens(mode, backend):
    lens = [4, 1, 9]
    (r, w, k, v, a, b), S0 = _inputs(B=1, T=sum(lens), seed=2)
    S0 = torch.randn(len(lens), *S0.shape[1:], dtype=S0.dtype)
    cu = torch.tensor([0, 4, 5, 14])
    o, S = linattn.rwkv7(r, w, k, v, a, b, initial_state=S0, output_final_state=True, cu_seqlens=cu, mode=mode,
                         chunk_size=3, backend=backend)
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o_ref, S_ref = rwkv7_ref(*(x[:, lo:hi] for x in (r, w, k, v, a, b)), S0=S0[i:i + 1])
        assert torch.allclose(o[:, lo:hi], o_ref, atol=1e-12, rtol=0)
        assert torch.allclose(S[i:i + 1], S_ref, atol=1e-12, rtol=0)


def _fla_naive(monkeypatch, tmp_path):
    """fla's naive DPLR recurrence (`dplr_recurrence`, fla/ops/generalized_delta_rule/dplr/naive.py: the
    recurrence fla's chunk_rwkv7 runs, q=r, alpha=a, beta=b, gk=w), imported from the file alone: fla's package
    __init__ needs triton and more. It imports einops.rearrange for another function: a stub stands in."""
    try:
        spec = importlib.util.find_spec("fla")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        root = os.path.dirname(list(spec.submodule_search_locations)[0])
    elif os.path.exists(WHEEL):
        with zipfile.ZipFile(WHEEL) as z:
            z.extractall(tmp_path)
        root = str(tmp_path)
    else:
        pytest.skip("fla is not installed and wheels/fla_core-0.6.0-py3-none-any.whl is absent "
                    "(pip download --no-deps fla-core==0.6.0)")
    path = os.path.join(root, "fla", "ops", "generalized_delta_rule", "dplr", "naive.py")
    if not os.path.exists(path):
        pytest.skip(f"this fla has no {path}")
    if importlib.util.find_spec("einops") is None:
        stub = types.ModuleType("einops")
        stub.rearrange = None
        monkeypatch.setitem(sys.modules, "einops", stub)
    mod_spec = importlib.util.spec_from_file_location("_fla_dplr_naive", path)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    return mod.dplr_recurrence


class _NoDowncast(torch.Tensor):
    """fla's naive loop casts its inputs with .float() (fp32); this subclass keeps fp64 through that call, so the
    same arithmetic runs in fp64 and the comparison can be at 1e-12."""

    def float(self):
        return self


@pytest.mark.parametrize("T", [1, 13])
def test_matches_fla_naive_fp64(monkeypatch, tmp_path, T):
    dplr_recurrence = _fla_naive(monkeypatch, tmp_path)
    (r, w, k, v, a, b), S0 = _inputs(T=T, seed=3)
    K = r.shape[-1]

    def bht(x):
        return x.transpose(1, 2).contiguous().as_subclass(_NoDowncast)

    fo, fS = dplr_recurrence(bht(r), bht(k), bht(v), bht(a), bht(b), bht(w), initial_state=S0.as_subclass(_NoDowncast))
    fo, fS = fo.as_subclass(torch.Tensor).transpose(1, 2), fS.as_subclass(torch.Tensor)
    assert fo.dtype == torch.float64
    for mode in MODES:  # fla's naive scales q by K**-0.5 (its chunk_rwkv7 defaults to 1.0)
        for backend in BACKENDS:
            o, S = linattn.rwkv7(r, w, k, v, a, b, scale=K ** -0.5, initial_state=S0, output_final_state=True,
                                 mode=mode, chunk_size=4, backend=backend)
            assert (o - fo).abs().max() <= 1e-12 and (S - fS).abs().max() <= 1e-12, (mode, backend)


def test_bad_input():
    (r, w, k, v, a, b), _ = _inputs(T=4)
    with pytest.raises(LinattnError, match=r"^w "):
        linattn.rwkv7(r, -w, k, v, a, b)                       # a positive log decay
    with pytest.raises(LinattnError, match=r"^a must"):
        linattn.rwkv7(r, w, k, v, a[..., :3], b)
    with pytest.raises(LinattnError, match=r"^b must"):
        linattn.rwkv7(r, w, k, v, a, b.float())
    with pytest.raises(LinattnError, match="initial_state"):
        linattn.rwkv7(r, w, k, v, a, b, initial_state=torch.zeros(2, 2, 3, 3, dtype=r.dtype))
    with pytest.raises(LinattnError, match="chunk_size"):
        linattn.rwkv7(r, w, k, v, a, b, chunk_size=0)
    with pytest.raises(LinattnError, match=r"^v must"):
        linattn.rwkv7(r, w, k, torch.zeros(2, 4, 4, 4, dtype=r.dtype), a, b)


# ---------------------------------------------------------------------------------------------
# the layer (the per-mixer suites cover causality, decoding, packing and state conformance)
# ---------------------------------------------------------------------------------------------

def _layer(seed=0, **kw):
    from linattn.layers import RWKV7
    torch.manual_seed(seed)
    layer = RWKV7(16, 2, decay_rank=4, a_rank=4, gate_rank=6, **kw).double()
    with torch.no_grad():   # every parameter away from its init (r_k = 0 would hide the bonus term)
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def _layer_ref(layer, x, v_first=None):
    """The layer from its formula (module docstring of layers/rwkv7.py), token by token in fp64, on rwkv7_ref;
    v_first: the first layer's values for the value residual (None: none). -> (output, this layer's v before it)."""
    B, T, C = x.shape
    H, Dh = layer.n_heads, layer.head_dim
    prev = torch.cat([torch.zeros(B, 1, C, dtype=x.dtype), x[:, :-1]], 1)
    mix = [x + (prev - x) * getattr(layer, name) for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")]

    def lora(m, h, act):
        z = m.down(h)
        z = torch.tanh(z) if act == "tanh" else torch.sigmoid(z) if act == "sigmoid" else z
        return m.up(z) + (m.bias if m.bias is not None else 0)

    r, k, v = layer.r_proj(mix[0]), layer.k_proj(mix[2]), layer.v_proj(mix[3])
    v_own = v
    if v_first is not None:
        mv = torch.sigmoid(lora(layer.v_lora, mix[3], None))
        v = v + (v_first - v) * mv
    w = -W_BOUND * torch.sigmoid(lora(layer.w_lora, mix[1], "tanh"))
    a = torch.sigmoid(lora(layer.a_lora, mix[4], None))
    g = lora(layer.g_lora, mix[5], "sigmoid")
    kk = k * layer.k_k
    kk = kk.view(B, T, H, Dh) / kk.view(B, T, H, Dh).norm(dim=-1, keepdim=True)
    k = k + k * (a - 1) * layer.k_a
    hd = [t.view(B, T, H, Dh) for t in (r, w, k, v, a)]
    o, _ = rwkv7_ref(hd[0], hd[1], hd[2], hd[3], -kk, kk * hd[4], scale=1.0)
    mean = o.mean(-1, keepdim=True)
    var = o.var(-1, unbiased=False, keepdim=True)
    o = (o - mean) / torch.sqrt(var + layer.g_norm.eps)
    o = o * layer.g_norm.weight.view(H, Dh) + layer.g_norm.bias.view(H, Dh)
    o = o + (hd[0] * hd[2] * layer.r_k).sum(-1, keepdim=True) * hd[3]
    return layer.o_proj(o.reshape(B, T, H * Dh) * g), v_own


def test_layer_matches_its_formula_fp64():
    layer = _layer()
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    with torch.no_grad():
        y, (y_ref, _) = layer(x), _layer_ref(layer, x)
    assert (y - y_ref).abs().max() < 1e-10 * (1 + y_ref.abs().max())
    # the bonus term is really there: with u = r_k = 0 the output changes
    with torch.no_grad():
        layer.r_k.zero_()
        assert (layer(x) - y).abs().max() > 1e-3


@pytest.mark.parametrize("opts", [dict(), dict(short_conv=True), dict(rope=True)], ids=["plain", "conv", "rope"])
def test_layer_decode_equals_forward_and_packs(opts):
    from linattn.layers import LayerCache
    layer = _layer(seed=1, **opts)
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache = LayerCache()
        steps = [layer(x[:, :4], cache=cache)] + [layer(x[:, t:t + 1], cache=cache) for t in range(4, 11)]
        assert torch.allclose(torch.cat(steps, 1), full, atol=1e-12, rtol=0)
        assert set(cache) >= {"shift", "state"} and cache.offset == 11
        cu = torch.tensor([0, 3, 11])
        packed = layer(x[:1], cu_seqlens=cu)
        alone = torch.cat([layer(x[:1, :3]), layer(x[:1, 3:])], 1)
        assert torch.allclose(packed, alone, atol=1e-12, rtol=0)


def test_value_residual_in_the_model_matches_the_formula():
    """Layer 0 publishes its v (and has no lora_v, as fla), layers 1 and 2 mix their v towards it, per token."""
    from linattn.models import LanguageModel, LMConfig
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, mixer="rwkv7")).double().eval()
    mixers = [b.mixer for b in model.blocks]
    assert mixers[0].v_lora is None and all(m.v_lora is not None for m in mixers[1:])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    seen = []
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append((args[0], out))) for m in mixers]
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids)
        y0, v_first = _layer_ref(mixers[0], seen[0][0])
        errs = [(y0 - seen[0][1]).abs().max()]
        for i in (1, 2):
            y_ref, _ = _layer_ref(mixers[i], seen[i][0], v_first=v_first)
            errs.append((y_ref - seen[i][1]).abs().max())
            # without the residual the layer's output differs: the test can tell
            assert (_layer_ref(mixers[i], seen[i][0])[0] - seen[i][1]).abs().max() > 1e-4
    for h in hooks:
        h.remove()
    assert max(errs) < 1e-10


def test_value_residual_under_activation_checkpointing():
    # a block recomputed in the backward pass reads the same first-layer values: gradients as without recomputation
    from linattn.models import LanguageModel, LMConfig
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, mixer="rwkv7")).double().train()
    ids = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(2))

    def grads(recompute):
        model.zero_grad()
        model.activation_checkpointing = recompute
        model(ids).logits.pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    plain, recomputed = grads(False), grads(True)
    assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(plain, recomputed))
    assert model.blocks[1].mixer.v_lora.up.weight.grad.abs().max() > 0   # the residual's mix is trained


def test_layer_rejects_bad_config():
    from linattn.layers import RWKV7
    with pytest.raises(LinattnError, match="n_heads"):
        RWKV7(15, 2)
    with pytest.raises(LinattnError, match="decay_rank"):
        RWKV7(16, 2, decay_rank=0)
    with pytest.raises(LinattnError, match="x of shape"):
        RWKV7(16, 2)(torch.zeros(1, 3, 8))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_strong_decays_stay_finite_and_exact(mode, backend):
    # log decays down to -20 per token (exp(-20) ~ 2e-9) in fp32: the core's per-channel path keeps every exponent
    # <= 0 and the compiled scan multiplies by exp(w) <= 1 alone, so nothing overflows and the forms agree with the
    # fp64 loop
    (r, w, k, v, a, b), _ = _inputs(B=1, T=40, K=8, V=8, dtype=torch.float32, seed=4)
    w = w / W_BOUND * 20
    o, S = linattn.rwkv7(r, w, k, v, a, b, mode=mode, output_final_state=True, backend=backend)
    o_ref, S_ref = rwkv7_ref(r, w, k, v, a, b)
    assert torch.isfinite(o).all() and torch.isfinite(S).all()
    assert (o.double() - o_ref).abs().max() < 1e-4 * (1 + o_ref.abs().max())


def test_hf_export_round_trip_and_generate(tmp_path):
    """The HF wrapper carries the mixer (and the value residual's links): saved and reloaded logits are bitwise
    linattn's, greedy generation equals linattn's."""
    transformers = pytest.importorskip("transformers")
    import linattn.hf as lh
    from linattn.models import LanguageModel, LMConfig
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mixer="rwkv7")).eval()
    hf = lh.LinattnForCausalLM.from_linattn(model).eval()
    hf.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    greedy = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(hf.generate(ids, max_new_tokens=6, **greedy), model.generate(ids, 6, temperature=0))
