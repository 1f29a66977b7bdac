"""The softmax side of the family: forgetting attention (FoX), DeltaFormer and PaTH attention.

Every form (parallel, chunk, recurrent) against the fp64 references of linattn.ops.reference, written
from the definitions (outputs and gradients, fp64 and fp32), T = 1 and T not a multiple of the block,
windows, packed sequences (with gradients against separate calls), strong gates, decoding steps ==
forward, special cases (g = 0, beta = 0, w = 0, orthogonal PaTH == absolute transforms), bad input.
"""
import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.errors import LinattnError, LinattnTypeError
from linattn.layers import LayerCache
from linattn.ops import (
    DeltaFormerState,
    ForgettingAttentionState,
    PaTHState,
    deltaformer,
    deltaformer_step,
    forgetting_attention,
    forgetting_attention_step,
    path_attention,
    path_attention_step,
    softmax_attention,
)
from linattn.ops.reference import deltaformer_ref, forgetting_attention_ref, path_attention_ref

MODES = ("parallel", "chunk", "recurrent")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


pytestmark = pytest.mark.usefixtures("one_thread_module")


def make(B=2, T=13, H=2, K=8, V=6, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=-F.softplus(r(B, T, H)),
             beta=torch.sigmoid(r(B, T, H)), w=F.normalize(r(B, T, H, K), dim=-1), do=r(B, T, H, V))
    return {n: t.to(dtype) for n, t in x.items()}


def err(a, ref):
    """max |a - ref| relative to max(1, max |ref|)."""
    a, ref = a.double(), ref.double()
    return ((a - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def run(fn, x, names):
    """(output, gradients of (o * do).sum() w.r.t. `names`)."""
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in names}
    o = fn(**leaves)
    (o.double() * x["do"].double()).sum().backward()
    # an input a form never reads (beta of a single token) has no gradient: zero
    return o.detach(), [t.grad if t.grad is not None else torch.zeros_like(t) for t in leaves.values()]


def check_forms(op, ref, x, names, dtype, **kw):
    """Every form of `op` (fp64 or fp32 inputs) against the fp64 reference, outputs and gradients."""
    x64 = {n: t.double() for n, t in x.items()}
    o_ref, g_ref = run(ref, x64, names)
    for mode in MODES:
        o, grads = run(lambda **a: op(mode=mode, **a, **kw), x, names)
        assert o.dtype == dtype and o.shape == o_ref.shape
        assert err(o, o_ref) <= TOL[dtype], (mode, "output", err(o, o_ref))
        for n, ga, gr in zip(names, grads, g_ref):
            assert err(ga, gr) <= TOL[dtype], (mode, f"d{n}", err(ga, gr))


# ---------------------------------------------------------------------------------------------
# every form against the references
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,window", [(1, None), (13, None), (13, 1), (13, 3), (13, 6), (13, 40)])
def test_forgetting_attention_forms(dtype, T, window):
    x = make(T=T, dtype=dtype, seed=T + (window or 0))
    check_forms(lambda mode, q, k, v, g: forgetting_attention(q, k, v, g, window=window, mode=mode, block_size=4),
                lambda q, k, v, g: forgetting_attention_ref(q, k, v, g, window=window), x, ["q", "k", "v", "g"], dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,stage1_query", [(1, "k"), (13, "k"), (13, "q")])
def test_deltaformer_forms(dtype, T, stage1_query):
    x = make(T=T, dtype=dtype, seed=3)
    x["beta"] = x["beta"] * 1.5      # beta in (0, 1.5)
    check_forms(lambda mode, q, k, v, beta: deltaformer(q, k, v, beta, stage1_query=stage1_query, mode=mode,
                                                        block_size=4),
                lambda q, k, v, beta: deltaformer_ref(q, k, v, beta, stage1_query=stage1_query)[0], x,
                ["q", "k", "v", "beta"], dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("T,gated,block", [(1, False, 4), (13, False, 4), (13, True, 2)])
def test_path_attention_forms(dtype, T, gated, block):
    """block 2 at T = 13: 7 blocks, 3 checkpoint segments in the sweep's backward."""
    x = make(B=1, T=T, dtype=dtype, seed=5)
    x["beta"] = 2 * x["beta"]        # the layer's range (0, 2)
    names = ["q", "k", "v", "w", "beta"] + (["g"] if gated else [])

    def op(mode, q, k, v, w, beta, g=None):
        return path_attention(q, k, v, w, beta, g=g, mode=mode, block_size=block)

    check_forms(op, lambda q, k, v, w, beta, g=None: path_attention_ref(q, k, v, w, beta, g=g), x, names, dtype)


def test_path_attention_unnormalised_w_and_many_blocks():
    """Any w and beta >= 0 (not only the layer's Householder range), 9 blocks of 3, scale given."""
    x = make(B=1, T=26, H=1, K=5, V=3, seed=11)
    x["w"] = x["w"] * 1.3
    names = ["q", "k", "v", "w", "beta", "g"]
    o_ref, g_ref = run(lambda q, k, v, w, beta, g: path_attention_ref(q, k, v, w, beta, g=g, scale=0.7), x, names)
    o, grads = run(lambda q, k, v, w, beta, g: path_attention(q, k, v, w, beta, g=g, scale=0.7, block_size=3),
                   x, names)
    assert err(o, o_ref) <= 1e-10 and max(err(a, b) for a, b in zip(grads, g_ref)) <= 1e-10


# ---------------------------------------------------------------------------------------------
# packed sequences
# ---------------------------------------------------------------------------------------------

LENS = (3, 9, 6)

PACKED = {
    "fox": (lambda x, **kw: forgetting_attention(x["q"], x["k"], x["v"], x["g"], window=4, block_size=4, **kw),
            ["q", "k", "v", "g"]),
    "deltaformer": (lambda x, **kw: deltaformer(x["q"], x["k"], x["v"], x["beta"], block_size=4, **kw),
                    ["q", "k", "v", "beta"]),
    "path": (lambda x, **kw: path_attention(x["q"], x["k"], x["v"], x["w"], 2 * x["beta"], g=x["g"], block_size=2,
                                            **kw), ["q", "k", "v", "w", "beta", "g"]),
}


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_sequences_match_separate_calls(name):
    fn, names = PACKED[name]
    x = make(B=1, T=sum(LENS), seed=7)
    cu = torch.tensor([0, 3, 12, 18])
    for mode in MODES:
        o, grads = run(lambda **a: fn(a, mode=mode, cu_seqlens=cu), x, names)
        parts = [run(lambda **a: fn(a, mode=mode), {n: t[:, lo:hi] for n, t in x.items()}, names)
                 for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist())]
        assert err(o, torch.cat([p[0] for p in parts], dim=1)) <= 1e-12, mode
        for i, n in enumerate(names):   # gradients: each document's own, nothing crosses a boundary
            sep = torch.cat([p[1][i] for p in parts], dim=1)
            assert torch.isfinite(grads[i]).all() and err(grads[i], sep) <= 1e-12, (mode, n)


def test_packed_path_gradients_vs_reference():
    """The known failure elsewhere (gradients exploding with packed sequences): PaTH's packed gradients
    equal the per-document fp64 references'."""
    x = make(B=1, T=sum(LENS), seed=8, dtype=torch.float32)
    x["beta"] = 2 * x["beta"]
    names = ["q", "k", "v", "w", "beta", "g"]
    cu = torch.tensor([0, 3, 12, 18])
    o, grads = run(lambda q, k, v, w, beta, g: path_attention(q, k, v, w, beta, g=g, cu_seqlens=cu, block_size=4),
                   x, names)
    x64 = {n: t.double() for n, t in x.items()}
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist()):
        xs = {n: t[:, lo:hi] for n, t in x64.items()}
        o_r, g_r = run(lambda q, k, v, w, beta, g: path_attention_ref(q, k, v, w, beta, g=g), xs, names)
        assert err(o[:, lo:hi], o_r) <= 1e-5
        for ga, gr in zip(grads, g_r):
            assert err(ga[:, lo:hi], gr) <= 1e-5


# ---------------------------------------------------------------------------------------------
# strong gates, long gate sums, special cases
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["fox", "path"])
def test_strong_gates(op):
    """g = -20 per token: every row is (almost) its own value; no NaN, no row underflows to zero."""
    x = make(B=1, T=40 if op == "fox" else 24, dtype=torch.float32, seed=9)
    x["g"] = torch.full_like(x["g"], -20.0)
    if op == "fox":
        def fn(mode, q, k, v, g):
            return forgetting_attention(q, k, v, g, mode=mode, block_size=8)
        names, ref = ["q", "k", "v", "g"], lambda q, k, v, g: forgetting_attention_ref(q, k, v, g)
    else:
        def fn(mode, q, k, v, w, beta, g):
            return path_attention(q, k, v, w, 2 * beta, g=g, mode=mode, block_size=8)
        names = ["q", "k", "v", "w", "beta", "g"]
        ref = lambda q, k, v, w, beta, g: path_attention_ref(q, k, v, w, 2 * beta, g=g)  # noqa: E731
    o_ref, g_ref = run(ref, {n: t.double() for n, t in x.items()}, names)
    for mode in ("chunk", "parallel"):
        o, grads = run(lambda **a: fn(mode, **a), x, names)
        assert torch.isfinite(o).all() and all(torch.isfinite(g).all() for g in grads)
        assert (o.abs().amax(-1) > 0).all()
        assert err(o, o_ref) <= 1e-5 and max(err(a, b) for a, b in zip(grads, g_ref)) <= 1e-5
        assert err(o, x["v"]) <= 1e-6   # e^-20 of the previous value


def test_long_gate_sums_keep_fp32_precision():
    """G reaches -4000 after 2000 tokens of g = -2; biases are rounded relative to themselves."""
    x = make(B=1, T=2000, H=1, K=8, V=4, dtype=torch.float32, seed=10)
    g = torch.full_like(x["g"], -2.0) + 0.1 * x["g"]
    o32 = forgetting_attention(x["q"], x["k"], x["v"], g, block_size=64)
    o64 = forgetting_attention(x["q"].double(), x["k"].double(), x["v"].double(), g.double(), block_size=64)
    assert err(o32, o64) <= 1e-5


def test_special_cases_reduce_to_softmax_attention():
    x = make(seed=12)
    q, k, v = x["q"], x["k"], x["v"]
    sm = softmax_attention(q, k, v)
    zero = torch.zeros_like(x["g"])
    assert err(forgetting_attention(q, k, v, zero, block_size=4), sm) <= 1e-12       # g = 0
    assert err(forgetting_attention(q, k, v, None, block_size=4), sm) <= 1e-12
    assert err(deltaformer(q, k, v, zero, block_size=4), sm) <= 1e-12                 # beta = 0
    assert err(path_attention(q, k, v, torch.zeros_like(q), x["beta"], block_size=4), sm) <= 1e-12   # w = 0
    # ALiBi: a constant g per head is the bias -|i - j| * slope
    slope = torch.tensor([0.5, 0.125], dtype=torch.float64)
    T = q.shape[1]
    i = torch.arange(T)
    bias = -(i[:, None] - i[None, :]).double() * slope[:, None, None]
    alibi = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=bias.masked_fill(i[:, None] < i[None, :], float("-inf"))).transpose(1, 2)
    assert err(forgetting_attention(q, k, v, -slope.expand(2, T, 2).contiguous(), block_size=4), alibi) <= 1e-12


def test_orthogonal_path_is_softmax_on_transformed_qk():
    """Seed eq. 31-33: with ||w|| = 1 and beta = 2 every factor is a reflection, R_ij = R_i R_j^T, and
    PaTH is softmax attention on q_i R_i, k_j R_j (absolute transforms, R_i = H_i ... H_1)."""
    x = make(B=1, T=9, H=1, K=4, V=3, seed=13)
    q, k, v, w = x["q"], x["k"], x["v"], x["w"]
    beta = torch.full_like(x["beta"], 2.0)
    R = torch.eye(4, dtype=torch.float64)
    qt, kt = torch.empty_like(q), torch.empty_like(k)
    for t in range(9):
        R = (torch.eye(4, dtype=torch.float64) - 2 * torch.outer(w[0, t, 0], w[0, t, 0])) @ R
        qt[0, t, 0], kt[0, t, 0] = R.T @ q[0, t, 0], R.T @ k[0, t, 0]
    assert err(path_attention(q, k, v, w, beta, block_size=4), softmax_attention(qt, kt, v)) <= 1e-12


def test_half_precision_inputs():
    x = make(dtype=torch.bfloat16, seed=14)
    for o in (forgetting_attention(x["q"], x["k"], x["v"], x["g"]),
              deltaformer(x["q"], x["k"], x["v"], x["beta"]),
              path_attention(x["q"], x["k"], x["v"], x["w"], x["beta"])):
        assert o.dtype == torch.bfloat16 and torch.isfinite(o.float()).all()


# ---------------------------------------------------------------------------------------------
# decoding: prefill (chunk, output_final_state) + steps == the full forward
# ---------------------------------------------------------------------------------------------

def _decode_matches(full, prefill, step, T, T0):
    """full() -> o; prefill(lo, hi) -> (o, state); step(lo, hi, state) -> (o, state)."""
    o_full = full()
    parts, state = [], None
    if T0:
        o0, state = prefill(0, T0)
        parts.append(o0)
    for t in range(T0, T):
        o_t, state = step(t, t + 1, state)
        parts.append(o_t)
    assert err(torch.cat(parts, dim=1), o_full) <= 1e-12
    return state


@pytest.mark.parametrize("T0", [0, 6])
@pytest.mark.parametrize("window", [None, 3])
def test_fox_decoding(T0, window):
    x = make(seed=15)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    state = _decode_matches(
        lambda: forgetting_attention(q, k, v, g, window=window, block_size=4),
        lambda lo, hi: forgetting_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], window=window,
                                            block_size=4, output_final_state=True),
        lambda lo, hi, st: forgetting_attention_step(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], st,
                                                     window=window), 13, T0)
    assert isinstance(state, ForgettingAttentionState)
    assert state.k.shape[1] == (13 if window is None else window - 1)
    assert torch.allclose(state.G_now, g.sum(1))
    # several tokens in one step call
    o, _ = forgetting_attention_step(q, k, v, g, window=window)
    assert err(o, forgetting_attention(q, k, v, g, window=window)) <= 1e-12


@pytest.mark.parametrize("T0", [0, 6])
@pytest.mark.parametrize("stage1_query", ["k", "q"])
def test_deltaformer_decoding(T0, stage1_query):
    x = make(seed=16)
    q, k, v, b = x["q"], x["k"], x["v"], x["beta"]
    state = _decode_matches(
        lambda: deltaformer(q, k, v, b, stage1_query=stage1_query, block_size=4),
        lambda lo, hi: deltaformer(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], b[:, lo:hi], stage1_query=stage1_query,
                                   block_size=4, output_final_state=True),
        lambda lo, hi, st: deltaformer_step(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], b[:, lo:hi], st,
                                            stage1_query=stage1_query), 13, T0)
    assert isinstance(state, DeltaFormerState) and state.u.shape == v.shape
    assert err(state.u, deltaformer_ref(q, k, v, b, stage1_query=stage1_query)[1]) <= 1e-12


@pytest.mark.parametrize("T0", [0, 6])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("prefill_mode", ["chunk", "parallel"])
def test_path_decoding(T0, gated, prefill_mode):
    x = make(seed=17)
    q, k, v, w, b = x["q"], x["k"], x["v"], x["w"], 2 * x["beta"]
    g = x["g"] if gated else None

    def gs(lo, hi):
        return g[:, lo:hi] if g is not None else None

    state = _decode_matches(
        lambda: path_attention(q, k, v, w, b, g=g, block_size=4),
        lambda lo, hi: path_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], w[:, lo:hi], b[:, lo:hi], g=gs(lo, hi),
                                      mode=prefill_mode, block_size=4, output_final_state=True),
        lambda lo, hi, st: path_attention_step(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], w[:, lo:hi], b[:, lo:hi], st,
                                               g=gs(lo, hi)), 13, T0)
    assert isinstance(state, PaTHState) and state.k.shape == k.shape
    # the cached keys are R_{T-1, j} k_j: the last key is unchanged
    assert torch.equal(state.k[:, -1], k[:, -1])


# ---------------------------------------------------------------------------------------------
# layers: options the model tests do not reach
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(output_gate=True, qk_norm=True, short_conv=True, output_norm=True),
                                dict(window=3, rope=True), dict(chunk_size=4)])
def test_fox_layer_options(kw):
    layer = linattn.layers.FoX(32, 4, **kw)
    _layer_decodes(layer)


@pytest.mark.parametrize("kw", [dict(stage1_query="q"), dict(rope=False, short_conv=True, chunk_size=4)])
def test_deltaformer_layer_options(kw):
    _layer_decodes(linattn.layers.DeltaFormer(32, 4, **kw))


@pytest.mark.parametrize("kw", [dict(use_forget_gate=True), dict(w_rank=4, qk_norm=True, chunk_size=4)])
def test_path_layer_options(kw):
    layer = linattn.layers.PaTH(32, 4, **kw)
    _layer_decodes(layer)
    w, beta = layer.householder(torch.randn(2, 5, 32), None, None)
    assert torch.allclose(w.norm(dim=-1), torch.ones(2, 5, 4), atol=1e-5)
    assert ((beta > 0) & (beta < 2)).all()


def _layer_decodes(layer):
    x = torch.randn(2, 11, 32)
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    assert not [n for n, p in layer.named_parameters() if p.grad is None]
    with torch.no_grad():
        full = layer(x)
        for prefill in (0, 4):
            cache = LayerCache()
            outs = [layer(x[:, :prefill], cache=cache)] if prefill else []
            outs += [layer(x[:, t:t + 1], cache=cache) for t in range(prefill, 7)]
            outs.append(layer(x[:, 7:], cache=cache))            # several tokens on a non-empty cache
            assert (torch.cat(outs, dim=1) - full).abs().max() <= 1e-5
            assert cache.offset == 11


# ---------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------

def test_bad_input():
    x = make(B=1, T=5, seed=18)
    q, k, v, g, b, w = x["q"], x["k"], x["v"], x["g"], x["beta"], x["w"]
    cu = torch.tensor([0, 2, 5])
    cases = [
        (LinattnError, "log-gate", lambda: forgetting_attention(q, k, v, -g)),
        (LinattnError, "g must have shape", lambda: forgetting_attention(q, k, v, g[:, :4])),
        (LinattnError, "finite", lambda: forgetting_attention(q, k, v, torch.full_like(g, -float("inf")))),
        (LinattnError, "window", lambda: forgetting_attention(q, k, v, g, window=0)),
        (LinattnError, "mode", lambda: forgetting_attention(q, k, v, g, mode="fast")),
        (LinattnError, "block_size", lambda: forgetting_attention(q, k, v, g, block_size=0)),
        (LinattnTypeError, "scale", lambda: forgetting_attention(q, k, v, g, scale="1")),
        (LinattnError, "cu_seqlens", lambda: forgetting_attention(q, k, v, g, cu_seqlens=cu,
                                                                  output_final_state=True)),
        (LinattnError, "k must have the shape", lambda: forgetting_attention(q, k[:, :4], v, g)),
        (LinattnTypeError, "ForgettingAttentionState",
         lambda: forgetting_attention_step(q, k, v, g, state=(k, v, None, None))),
        (LinattnError, "gate", lambda: forgetting_attention_step(q, k, v, None,
                                                                 forgetting_attention_step(q, k, v, g)[1])),
        (LinattnError, "finite", lambda: deltaformer(q, k, v, b * float("nan"))),
        (LinattnError, "stage1_query", lambda: deltaformer(q, k, v, b, stage1_query="v")),
        (LinattnTypeError, "beta", lambda: deltaformer(q, k, v, b.tolist())),
        (LinattnError, r"state.k", lambda: deltaformer_step(q, k, v, b, DeltaFormerState(k[..., :3], v))),
        (LinattnError, "w must have the shape", lambda: path_attention(q, k, v, w[..., :3], b)),
        (LinattnTypeError, "w must have the dtype", lambda: path_attention(q, k, v, w.float(), b)),
        (LinattnError, "beta", lambda: path_attention(q, k, v, w, b[..., :1])),
        (LinattnError, "log-gate", lambda: path_attention(q, k, v, w, b, g=-g)),
        (LinattnTypeError, "output_final_state", lambda: path_attention(q, k, v, w, b, output_final_state=1)),
        (LinattnError, "gate", lambda: path_attention_step(q, k, v, w, b, path_attention_step(q, k, v, w, b)[1],
                                                           g=g)),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_hybrid_model_with_the_three_mixers():
    """fox, path and deltaformer side by side with a linear mixer: decode == forward, causal, packed."""
    from linattn.audit import check_causality
    from linattn.models import LanguageModel, LMConfig

    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=37, d_model=32, n_layers=4, n_heads=2, chunk_size=4,
                                   mixer=["fox", "gated-deltanet", "path", "deltaformer"],
                                   mixer_kwargs={"path": {"use_forget_gate": True}}))
    ids = torch.randint(0, 37, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        parts, cache = [out.logits], out.cache
        for t in range(5, 11):
            out = model(ids[:, t:t + 1], cache=cache)
            parts.append(out.logits)
        assert (torch.cat(parts, dim=1) - full).abs().max() <= 1e-4
        packed = model(ids[:1], cu_seqlens=torch.tensor([0, 4, 11])).logits
        alone = torch.cat([model(ids[:1, :4]).logits, model(ids[:1, 4:]).logits], dim=1)
        assert (packed - alone).abs().max() <= 1e-5
    assert check_causality(model, seq_len=8, batch_size=1).ok


def test_chunk_forms_never_hold_a_t_by_t_tensor():
    """Forward and backward of every chunk form: no tensor anywhere near T x T (largest seen < T^2 / 4;
    the blocks here are [C, C] per block pair, the score rows [C, T], the caches [T, K]). Every torch
    call in Python is seen, including the custom autograd Functions' backward passes."""
    from torch.overrides import TorchFunctionMode

    class Largest(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    T = 128
    x = make(B=1, T=T, H=1, K=8, V=8, dtype=torch.float32, seed=19)
    calls = {
        "fox": (lambda a: forgetting_attention(a["q"], a["k"], a["v"], a["g"], block_size=16), ["q", "k", "v", "g"]),
        "deltaformer": (lambda a: deltaformer(a["q"], a["k"], a["v"], a["beta"], block_size=16),
                        ["q", "k", "v", "beta"]),
        "path": (lambda a: path_attention(a["q"], a["k"], a["v"], a["w"], a["beta"], g=a["g"], block_size=16),
                 ["q", "k", "v", "w", "beta", "g"]),
    }
    for name, (fn, names) in calls.items():
        leaves = {n: x[n].clone().requires_grad_(True) for n in names}
        with Largest() as mode:
            fn(leaves).square().sum().backward()
        assert mode.numel < T * T // 4, (name, mode.numel)
