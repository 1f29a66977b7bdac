"""ttt (TTT-Linear, TTT-MLP) and titans: both forms against the fp64 token-by-token reference whose
inner gradients come from autograd (outputs, weights, gradients), mini-batches that do not divide T,
states that end inside a mini-batch, varlen, extreme inputs, bf16 and bad input."""
import pytest
import torch

import linattn
from linattn import TTTState, titans, ttt
from linattn.errors import LinattnError, LinattnTypeError
from linattn.ops.reference import rel_err, ttt_ref

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DH = 10   # the inner MLP's hidden width in these tests


pytestmark = pytest.mark.usefixtures("one_thread_module")


def make_inputs(B, T, H, K, dtype, inner, seed=0, titan=False):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, std=1.0):
        return std * torch.randn(*s, generator=gen, dtype=torch.float64)

    def u(*s, hi=1.0):
        return hi * torch.rand(*s, generator=gen, dtype=torch.float64)

    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, K), lr=u(B, T, H, hi=0.3),
             ln_weight=1 + r(H, K, std=0.3), ln_bias=r(H, K, std=0.3))
    if titan:
        x.update(alpha=u(B, T, H, hi=0.2), momentum=u(B, T, H))
    if inner == "linear":
        x["weights"] = (r(B, H, K, K, std=0.3), r(B, H, K, std=0.1))
    else:
        x["weights"] = (r(B, H, K, DH, std=0.3), r(B, H, DH, std=0.1), r(B, H, DH, K, std=0.3), r(B, H, K, std=0.1))
    return {n: (tuple(w.to(dtype) for w in t) if isinstance(t, tuple) else t.to(dtype)) for n, t in x.items()}


def call_op(x, **kw):
    common = dict(ln_weight=x["ln_weight"], ln_bias=x["ln_bias"], initial_state=x["weights"])
    common.update(kw)
    if "alpha" in x:
        return titans(x["q"], x["k"], x["v"], x["lr"], x["alpha"], x["momentum"], **common)
    return ttt(x["q"], x["k"], x["v"], x["lr"], **common)


def call_ref(x, inner, mini_batch):
    o, W, _ = ttt_ref(x["q"], x["k"], x["v"], x["lr"], x["weights"], inner=inner, mini_batch=mini_batch,
                      ln_weight=x["ln_weight"], ln_bias=x["ln_bias"], alpha=x.get("alpha"),
                      momentum=x.get("momentum"))
    return o, W


def with_grads(fn, x, wo, wW):
    """(o, W, grads of every input) for the loss sum(o * wo) + sum_i sum(W_i * wW_i)."""
    leaves = {n: (tuple(w.detach().clone().requires_grad_() for w in t) if isinstance(t, tuple)
                  else t.detach().clone().requires_grad_()) for n, t in x.items()}
    o, W = fn(leaves)
    loss = (o.double() * wo).sum() + sum((w.double() * c).sum() for w, c in zip(W, wW))
    flat = [t for n in sorted(leaves) for t in (leaves[n] if isinstance(leaves[n], tuple) else (leaves[n],))]
    names = [f"{n}{i}" for n in sorted(leaves) for i in range(len(leaves[n]) if isinstance(leaves[n], tuple) else 1)]
    return o, W, dict(zip(names, torch.autograd.grad(loss, flat)))


# ---------------------------------------------------------------- both forms vs the reference

@pytest.mark.parametrize("inner,titan", [("linear", False), ("mlp", False), ("linear", True), ("mlp", True)])
def test_forms_match_reference(inner, titan):
    """Inputs representable in fp32, so that one fp64 reference serves the fp32 and the fp64 runs."""
    B, T, H, K = 2, 11, 2, 4
    x64 = make_inputs(B, T, H, K, torch.float32, inner, titan=titan)
    x64 = {n: (tuple(w.double() for w in t) if isinstance(t, tuple) else t.double()) for n, t in x64.items()}
    wo = torch.randn(B, T, H, K, dtype=torch.float64)
    wW = [torch.randn(w.shape, dtype=torch.float64) for w in x64["weights"]]
    for mb in (4, 16):     # 11 = 4 + 4 + 3 (the last mini-batch is cut), and all in one mini-batch
        ro, rW, rg = with_grads(lambda y: call_ref(y, inner, mb), x64, wo, wW)
        for dtype, mode in [(d, m) for d in (torch.float32, torch.float64) for m in ("chunk", "recurrent")]:
            x = {n: (tuple(w.to(dtype) for w in t) if isinstance(t, tuple) else t.to(dtype)) for n, t in x64.items()}
            o, st_W, grads = with_grads(
                lambda y: (lambda o, s: (o, s.current))(*call_op(y, inner=inner, mini_batch=mb, mode=mode,
                                                                 output_final_state=True)), x, wo, wW)
            tag = (mb, mode, dtype)
            assert o.dtype == dtype and o.shape == (B, T, H, K), tag
            assert rel_err(o, ro) < TOL[dtype], (tag, rel_err(o, ro))
            for a, b in zip(st_W, rW):
                assert a.dtype == dtype and rel_err(a, b) < TOL[dtype], (tag, rel_err(a, b))
            for name in rg:
                assert torch.isfinite(grads[name]).all(), (tag, name)
                assert rel_err(grads[name], rg[name]) < TOL[dtype], (tag, name, rel_err(grads[name], rg[name]))


@pytest.mark.parametrize("inner,titan", [("linear", False), ("mlp", True)])
def test_single_token_and_online_gd(inner, titan):
    """T = 1, and mini_batch = 1 (plain online gradient descent, the seed's eq. 11), in fp64."""
    for T, mb in ((1, 16), (9, 1)):
        x = make_inputs(1, T, 2, 4, torch.float64, inner, seed=T, titan=titan)
        ro, rW = call_ref(x, inner, mb)
        for mode in ("chunk", "recurrent"):
            o, st = call_op(x, inner=inner, mini_batch=mb, mode=mode, output_final_state=True)
            assert rel_err(o, ro) < 1e-12 and all(rel_err(a, b) < 1e-12 for a, b in zip(st.current, rW))
            assert st.position == (T % mb,)


def test_titans_without_decay_or_momentum_is_ttt():
    x = make_inputs(2, 13, 2, 4, torch.float64, "mlp", seed=4)
    o1, s1 = call_op(x, inner="mlp", mini_batch=4, output_final_state=True)
    zero = torch.zeros_like(x["lr"])
    o2, s2 = titans(x["q"], x["k"], x["v"], x["lr"], zero, zero, inner="mlp", mini_batch=4, ln_weight=x["ln_weight"],
                    ln_bias=x["ln_bias"], initial_state=x["weights"], output_final_state=True)
    assert rel_err(o2, o1) < 1e-14
    assert s1.momentum is None and len(s2.momentum) == 4
    assert all(rel_err(a, b) < 1e-14 for a, b in zip(s1.current, s2.current))


def test_defaults():
    """initial_state None = zero weights (linear only), ln None = (1, 0), scale None = K**-0.5, [H, ...]
    weights are shared by every sequence, residual=False drops the residual."""
    x = make_inputs(2, 7, 2, 4, torch.float64, "linear", seed=5)
    zeros = (torch.zeros(2, 2, 4, 4, dtype=torch.float64), torch.zeros(2, 2, 4, dtype=torch.float64))
    o, S = ttt(x["q"], x["k"], x["v"], x["lr"])
    assert S is None
    ro, _, _ = ttt_ref(x["q"], x["k"], x["v"], x["lr"], zeros, scale=0.5)
    assert rel_err(o, ro) < 1e-12
    shared = tuple(w[0] for w in x["weights"])                     # [H, ...]
    o1, _ = ttt(x["q"], x["k"], x["v"], x["lr"], initial_state=shared, mini_batch=4, residual=False, scale=0.7)
    ro1, _, _ = ttt_ref(x["q"], x["k"], x["v"], x["lr"], tuple(w[:1].expand_as(w) for w in x["weights"]),
                        mini_batch=4, residual=False, scale=0.7)
    assert rel_err(o1, ro1) < 1e-12


# ---------------------------------------------------------------- states, varlen

@pytest.mark.parametrize("first,rest", [("chunk", "recurrent"), ("chunk", "chunk"), ("recurrent", "chunk")])
@pytest.mark.parametrize("inner,titan", [("linear", False), ("mlp", True)])
def test_state_round_trip(inner, titan, first, rest):
    """A call that ends inside a mini-batch hands it on: 6 + 1 + 1 + 11 tokens with mini_batch 4 equal
    one call of 19 tokens."""
    x = make_inputs(2, 19, 2, 4, torch.float64, inner, seed=6, titan=titan)
    full, S = call_op(x, inner=inner, mini_batch=4, output_final_state=True)
    outs, state = [], x["weights"]
    for i, (a, b) in enumerate([(0, 6), (6, 7), (7, 8), (8, 19)]):
        part = {n: (t[:, a:b] if n in ("q", "k", "v", "lr", "alpha", "momentum") else t) for n, t in x.items()}
        part["weights"] = state
        o, state = call_op(part, inner=inner, mini_batch=4, mode=first if i == 0 else rest, output_final_state=True)
        outs.append(o)
        assert state.position == ((b % 4),) * 2
    assert rel_err(torch.cat(outs, 1), full) < 1e-12
    for field in ("start", "current") + (("momentum",) if titan else ()):
        assert all(rel_err(a, b) < 1e-12 for a, b in zip(getattr(state, field), getattr(S, field))), field


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_cu_seqlens_equals_separate_calls(mode):
    lens = [5, 17, 9]
    x = make_inputs(1, sum(lens), 2, 4, torch.float64, "linear", seed=8, titan=True)
    init = tuple(torch.randn(3, *w.shape[1:], dtype=torch.float64) for w in x["weights"])
    cu = torch.tensor([0, 5, 22, 31])
    o, S = call_op(dict(x, weights=init), inner="linear", mini_batch=4, mode=mode, output_final_state=True,
                   cu_seqlens=cu)
    assert S.position == (1, 1, 1)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        part = {n: (t[:, a:b] if n in ("q", "k", "v", "lr", "alpha", "momentum") else t) for n, t in x.items()}
        part["weights"] = tuple(w[i:i + 1] for w in init)
        oi, Si = call_op(part, inner="linear", mini_batch=4, mode=mode, output_final_state=True)
        assert rel_err(o[:, a:b], oi) < 1e-12
        assert all(rel_err(s[i:i + 1], si) < 1e-12 for s, si in zip(S.current, Si.current))


def test_rows_at_different_positions():
    """A state whose sequences stand at different places in their mini-batches (from a packed call)
    continues each one correctly in a batched call."""
    x = make_inputs(1, 9, 2, 4, torch.float64, "linear", seed=10)
    cu = torch.tensor([0, 3, 9])
    _, S = call_op(dict(x, weights=tuple(w.expand(2, *w.shape[1:]) for w in x["weights"])), mini_batch=4,
                   output_final_state=True, cu_seqlens=cu)
    assert S.position == (3, 2)
    y = make_inputs(2, 6, 2, 4, torch.float64, "linear", seed=11)
    o, S2 = ttt(y["q"], y["k"], y["v"], y["lr"], mini_batch=4, initial_state=S, ln_weight=x["ln_weight"],
                ln_bias=x["ln_bias"], output_final_state=True)
    assert S2.position == (1, 0)
    for i in range(2):
        one = TTTState(tuple(w[i:i + 1] for w in S.start), tuple(w[i:i + 1] for w in S.current), None,
                       (S.position[i],))
        oi, _ = ttt(y["q"][i:i + 1], y["k"][i:i + 1], y["v"][i:i + 1], y["lr"][i:i + 1], mini_batch=4,
                    initial_state=one, ln_weight=x["ln_weight"], ln_bias=x["ln_bias"], mode="recurrent")
        assert rel_err(o[i:i + 1], oi) < 1e-12


# ---------------------------------------------------------------- extreme inputs, low precision

@pytest.mark.parametrize("inner,titan", [("linear", False), ("mlp", True)])
def test_extreme_inputs(inner, titan):
    """Keys of norm ~1e3 and ~1e-3, large learning rates, alpha = 1 (forget everything) and momentum 1,
    a zero query: finite, and both forms match the reference."""
    x = make_inputs(1, 12, 2, 4, torch.float64, inner, seed=12, titan=titan)
    x["k"][:, ::3] *= 1e3
    x["k"][:, 1::3] *= 1e-3
    x["lr"][:, 4] = 5.0
    x["q"][:, 2] = 0.0
    if titan:
        x["alpha"][:, 6] = 1.0
        x["momentum"][:, 7] = 1.0
    ro, rW = call_ref(x, inner, 4)
    for mode in ("chunk", "recurrent"):
        o, st = call_op(x, inner=inner, mini_batch=4, mode=mode, output_final_state=True)
        assert torch.isfinite(o).all() and all(torch.isfinite(w).all() for w in st.current)
        assert rel_err(o, ro) < 1e-9, (mode, rel_err(o, ro))


def test_titans_gradients_through_zero_factors():
    """alpha = 1 and momentum = 0 make factors of the dual form's products exactly 0: the gradients
    (through torch.cumprod) still match the reference."""
    x = make_inputs(1, 12, 2, 4, torch.float64, "linear", seed=3, titan=True)
    x["alpha"][:, 2] = 1.0
    x["alpha"][:, 5] = 0.0
    x["momentum"][:, 3] = 0.0
    x["momentum"][:, 6] = 0.0
    x["momentum"][:, 7] = 1.0
    wo = torch.randn(1, 12, 2, 4, dtype=torch.float64)
    wW = [torch.randn(w.shape, dtype=torch.float64) for w in x["weights"]]
    ro, _, rg = with_grads(lambda y: call_ref(y, "linear", 4), x, wo, wW)
    for mode in ("chunk", "recurrent"):
        o, _, grads = with_grads(lambda y: (lambda o, s: (o, s.current))(*call_op(
            y, inner="linear", mini_batch=4, mode=mode, output_final_state=True)), x, wo, wW)
        assert rel_err(o, ro) < 1e-12
        for name in rg:
            assert rel_err(grads[name], rg[name]) < 1e-12, (mode, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs(dtype):
    """Half inputs: weights and arithmetic in fp32, outputs in the input dtype, close to fp64."""
    x = make_inputs(1, 200, 2, 8, torch.float64, "mlp", seed=13, titan=True)
    xh = {n: (tuple(w.to(dtype) for w in t) if isinstance(t, tuple) else t.to(dtype)) for n, t in x.items()}
    o, st = call_op(xh, inner="mlp", mini_batch=16, output_final_state=True)
    assert o.dtype == dtype and all(w.dtype == torch.float32 for w in st.current)
    ref, _ = call_op({n: (tuple(w.double() for w in t) if isinstance(t, tuple) else t.double())
                      for n, t in xh.items()}, inner="mlp", mini_batch=16, output_final_state=True)
    assert rel_err(o, ref) < (2e-3 if dtype == torch.float16 else 1e-2)


# ---------------------------------------------------------------- bad input

def test_bad_inputs():
    x = make_inputs(2, 6, 2, 4, torch.float32, "linear")
    q, k, v, lr = x["q"], x["k"], x["v"], x["lr"]
    W = x["weights"]
    cases = [
        (lambda: ttt(q, k, v[..., :3], lr), LinattnError, "needs K == V"),
        (lambda: ttt(q, k, v, lr, mode="parallel"), LinattnError, "no 'parallel' form"),
        (lambda: ttt(q, k, v, lr, inner="rnn"), LinattnError, "inner must be one of"),
        (lambda: ttt(q, k, v, lr, mini_batch=0), LinattnError, "mini_batch"),
        (lambda: ttt(q, k, v, -lr), LinattnError, "eta must be >= 0"),
        (lambda: ttt(q, k, v, lr[..., :1]), LinattnError, r"eta must have shape \[B, T, H\]"),
        (lambda: ttt(q, k, v, lr, inner="mlp"), LinattnError, "needs initial_state"),
        (lambda: ttt(q, k, v, lr, initial_state=W[:1]), LinattnTypeError, r"tuple of 2 tensors \(W, b\)"),
        (lambda: ttt(q, k, v, lr, initial_state=(W[0][..., :3], W[1])), LinattnError, "W must have shape"),
        (lambda: ttt(q, k, v, lr, ln_weight=torch.ones(3)), LinattnError, r"ln_weight must have shape \[H, V\]"),
        (lambda: ttt(q, k, v, lr, eps=0.0), LinattnError, "eps"),
        (lambda: ttt(q, k, v, lr, residual=1), LinattnTypeError, "residual must be a bool"),
        (lambda: ttt(q, k, v, lr, initial_state=TTTState(W, W, None, (5, 5)), mini_batch=4), LinattnError,
         "position"),
        (lambda: ttt(q, k, v, lr, initial_state=TTTState(W, W, W, (0, 0))), LinattnError, "momentum"),
        (lambda: titans(q, k, v, lr, lr + 1.0, lr), LinattnError, r"alpha must be in \[0, 1\]"),
        (lambda: titans(q, k, v, lr, lr, -lr), LinattnError, r"eta must be in \[0, 1\]"),
        (lambda: titans(q, k, v, lr * float("nan"), lr, lr), LinattnError, "theta contains NaN"),
        (lambda: ttt(q, k, v, lr, cu_seqlens=torch.tensor([0, 2, 6])), LinattnError, "needs batch size 1"),
    ]
    for fn, err, match in cases:
        with pytest.raises(err, match=match):
            fn()


def test_exported():
    assert linattn.ttt is linattn.ops.ttt is ttt and linattn.titans is linattn.ops.titans is titans
    assert linattn.TTTState is linattn.ops.TTTState


# ---------------------------------------------------------------- layers: decoding across mini-batches

@pytest.mark.parametrize("name", ["ttt-linear", "ttt-mlp", "titans"])
def test_layer_decode_crosses_mini_batches(name):
    """Prefill that ends inside a mini-batch, then token-by-token decoding across two more mini-batch
    boundaries: equals the full forward, with a cache of constant size."""
    from linattn.layers import LayerCache
    from linattn.models.registry import build_mixer

    torch.manual_seed(0)
    layer = build_mixer(name, 32, 2, mini_batch=4)
    x = torch.randn(2, 15, 32)
    with torch.no_grad():
        full = layer(x)
        cache = LayerCache()
        outs, sizes = [layer(x[:, :6], cache=cache)], []
        for t in range(6, 15):
            outs.append(layer(x[:, t:t + 1], cache=cache))
            sizes.append(cache.nbytes())
    assert (torch.cat(outs, 1) - full).abs().max().item() < 1e-5
    assert len(set(sizes)) == 1 and cache["state"].position == (15 % 4,) * 2


def test_no_host_reads_and_compile():
    """A decoded token of a Titans layer reads no value on the host with value checks off, and
    torch.compile(fullgraph=True) traces the chunk form with its gradients."""
    from torch.overrides import TorchFunctionMode

    from linattn.layers import LayerCache, Titans

    class CountHostReads(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("item", "__bool__", "tolist", "__int__", "__float__", "__index__",
                                                 "nonzero"):
                self.calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = Titans(32, 2, mini_batch=4).eval()
    x = torch.randn(1, 7, 32)
    previous = linattn.set_checks("shapes")
    try:
        with torch.no_grad():
            cache = LayerCache()
            layer(x[:, :6], cache=cache)
            with CountHostReads() as c:
                layer(x[:, 6:], cache=cache)
        assert c.calls == []
    finally:
        linattn.set_checks(previous)

    y = make_inputs(1, 6, 2, 4, torch.float32, "linear", seed=14, titan=True)

    def fn(q, k, v, lr, alpha, mom, *w):   # small: the compiler unrolls the loop over mini-batches
        o, s = titans(q, k, v, lr, alpha, mom, mini_batch=4, initial_state=w, output_final_state=True)
        return (o,) + s.current

    args = (y["q"], y["k"], y["v"], y["lr"], y["alpha"], y["momentum"], *y["weights"])
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    xc = [a.clone().requires_grad_() for a in args]
    xe = [a.clone().requires_grad_() for a in args]
    outc, oute = compiled(*xc), fn(*xe)
    for a, b in zip(outc, oute):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    outc[0].sum().backward()
    oute[0].sum().backward()
    for a, b in zip(xc, xe):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)
