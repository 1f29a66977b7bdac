"""comba, delta_product and Kimi Delta Attention (delta_rule with per-channel gates): every form against
the fp64 references written from the equations (outputs, final states and the gradients of every input),
T not a multiple of the chunk size, T = 1, states handed from one form to another, packed sequences,
extreme inputs, bf16, the seed's eq. (19), bad input; and the Comba, DeltaProduct and KDA layers."""
import functools

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn import comba, delta_product, delta_rule
from linattn.layers import KDA, Comba, DeltaProduct, LayerCache, l2_normalize
from linattn.ops.reference import comba_ref, delta_product_ref, delta_rule_ref, rel_err

MODES = ["parallel", "chunk", "recurrent"]
FORMS = [("parallel", 64), ("recurrent", 64), ("chunk", 7), ("chunk", 16), ("chunk", 64)]
TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


pytestmark = pytest.mark.usefixtures("one_thread_module")


def unit(*shape, dtype, gen):
    return F.normalize(torch.randn(*shape, dtype=dtype, generator=gen), dim=-1)


def make_gate(kind, B, T, H, K, dtype, gen, strength=0.5):
    if kind == "head":
        return -strength * torch.rand(B, T, H, dtype=dtype, generator=gen)
    if kind == "channel":
        return -strength * torch.rand(B, T, H, K, dtype=dtype, generator=gen)
    return None


def comba_inputs(B, T, H, K, V, dtype, gate=None, read_key=False, norms=(0.2, 1.4), seed=0):
    """Keys with norms in `norms`, beta in [0, 1), p = (0.3 .. 1) k-like vectors of their own."""
    gen = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(B, T, H, K, dtype=dtype, generator=gen),
         "k": unit(B, T, H, K, dtype=dtype, gen=gen) * torch.empty(B, T, H, 1, dtype=dtype).uniform_(*norms,
                                                                                                       generator=gen),
         "v": torch.randn(B, T, H, V, dtype=dtype, generator=gen),
         "beta": torch.rand(B, T, H, dtype=dtype, generator=gen),
         "S0": torch.randn(B, H, K, V, dtype=dtype, generator=gen)}
    g = make_gate(gate, B, T, H, K, dtype, gen)
    if g is not None:
        x["g"] = g
    if read_key:
        x["p"] = unit(B, T, H, K, dtype=dtype, gen=gen) * (0.3 + 0.7 * torch.rand(B, T, H, 1, dtype=dtype,
                                                                                  generator=gen))
    return x


def dp_inputs(B, T, H, n, K, V, dtype, gate=None, beta_max=1.0, norms=(0.5, 1.0), seed=0):
    """n keys per token with norms in `norms`, beta in [0, beta_max)."""
    gen = torch.Generator().manual_seed(seed)
    x = {"q": torch.randn(B, T, H, K, dtype=dtype, generator=gen),
         "k": unit(B, T, H, n, K, dtype=dtype, gen=gen) * torch.empty(B, T, H, n, 1, dtype=dtype).uniform_(
             *norms, generator=gen),
         "v": torch.randn(B, T, H, n, V, dtype=dtype, generator=gen),
         "beta": beta_max * torch.rand(B, T, H, n, dtype=dtype, generator=gen),
         "S0": torch.randn(B, H, K, V, dtype=dtype, generator=gen)}
    g = make_gate(gate, B, T, H, K, dtype, gen)
    if g is not None:
        x["g"] = g
    return x


def with_grads(fn, x, seed=1):
    """(o, S, {name: gradient}) of the loss sum(o * wo) + sum(S * wS), for every input in x."""
    leaves = {n: t.detach().clone().requires_grad_() for n, t in x.items()}
    o, S = fn(**leaves)
    gen = torch.Generator().manual_seed(seed)
    wo = torch.randn(o.shape, dtype=torch.float64, generator=gen)
    wS = torch.randn(S.shape, dtype=torch.float64, generator=gen)
    loss = (o.double() * wo).sum() + (S.double() * wS).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return o, S, dict(zip(leaves, grads))


def assert_close(got, want, tol, what):
    o, S, grads = got
    ro, rS, rgrads = want
    assert rel_err(o, ro) < tol, (what, "o", rel_err(o, ro))
    assert rel_err(S, rS) < tol, (what, "S", rel_err(S, rS))
    for name in rgrads:
        assert torch.isfinite(grads[name]).all(), (what, name)
        assert rel_err(grads[name], rgrads[name]) < tol, (what, name, rel_err(grads[name], rgrads[name]))


def _comba(mode, C, **kw):
    def fn(q, k, v, beta, S0, g=None, p=None):
        return comba(q, k, v, beta, p=p, g=g, mode=mode, chunk_size=C, initial_state=S0, output_final_state=True,
                     **kw)
    return fn


def _comba_ref(**kw):
    def fn(q, k, v, beta, S0, g=None, p=None):
        return comba_ref(q, k, v, beta, p=p, g=g, S0=S0, **kw)
    return fn


def _dp(mode, C, **kw):
    def fn(q, k, v, beta, S0, g=None):
        return delta_product(q, k, v, beta, g=g, mode=mode, chunk_size=C, initial_state=S0, output_final_state=True,
                             **kw)
    return fn


def _dp_ref(**kw):
    def fn(q, k, v, beta, S0, g=None):
        return delta_product_ref(q, k, v, beta, g=g, S0=S0, **kw)
    return fn


# ---------------------------------------------------------------- Comba: every form vs the reference

@pytest.mark.parametrize("T", [1, 45])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [None, "head", "channel"])
@pytest.mark.parametrize("read_key", [False, True])
def test_comba_forms_match_reference(read_key, gate, dtype, T):
    x = comba_inputs(2, T, 2, 8, 6, dtype, gate, read_key)
    want = with_grads(_comba_ref(), x)
    for mode, C in FORMS:
        got = with_grads(_comba(mode, C), x)
        assert got[0].dtype == dtype and got[0].shape == (2, T, 2, 6)
        assert got[1].dtype == dtype and got[1].shape == (2, 2, 8, 6)
        assert_close(got, want, TOL[dtype], (mode, C))


@pytest.mark.parametrize("read_key", [False, True])
def test_comba_qk_l2norm_and_scale(read_key):
    """qk_l2norm normalises q and k, never p (p=None reads with the normalised k); keys of norm up to 30."""
    x = comba_inputs(1, 40, 2, 8, 8, torch.float64, "head", read_key, norms=(0.1, 30.0))
    want = with_grads(_comba_ref(scale=0.7, qk_l2norm=True), x)
    for mode in MODES:
        assert_close(with_grads(_comba(mode, 16, scale=0.7, qk_l2norm=True), x), want, 1e-10, mode)


def test_comba_p_none_is_k_and_p_is_not_normalised():
    x = comba_inputs(1, 30, 2, 8, 4, torch.float64, "head", read_key=True, norms=(0.3, 3.0))
    q, k, v, beta, g, p = x["q"], x["k"], x["v"], x["beta"], x["g"], x["p"]
    for mode in MODES:
        a, _ = comba(q, k, v, beta, g=g, mode=mode, chunk_size=8)
        b, _ = comba(q, k, v, beta, p=k, g=g, mode=mode, chunk_size=8)
        assert rel_err(a, b) < 1e-13, mode
        a, _ = comba(q, k, v, beta, g=g, qk_l2norm="clamp", mode=mode, chunk_size=8)  # F.normalize's form
        b, _ = comba(q, F.normalize(k, dim=-1), v, beta, p=F.normalize(k, dim=-1), g=g, qk_l2norm="clamp",
                     mode=mode, chunk_size=8)
        assert rel_err(a, b) < 1e-13, mode
        a, _ = comba(q, k, v, beta, p=3 * p, g=g, qk_l2norm=True, mode=mode, chunk_size=8)
        b, _ = comba(q, k, v, beta, p=p, g=g, qk_l2norm=True, mode=mode, chunk_size=8)
        assert rel_err(a, b) > 1e-3, mode  # the norm of p is the feedback gain


def test_comba_is_gated_deltanet_rewritten_seed_eq19():
    """Seed eq. (19): Gated DeltaNet S_t = (I - b k k^T) a S_{t-1} + b k v^T equals Comba with
    gamma = a, eta = a b and v / a; and Comba with the same beta and v is a different recurrence."""
    x = comba_inputs(2, 33, 2, 8, 5, torch.float64, "head")
    q, k, v, beta, g, S0 = x["q"], x["k"], x["v"], x["beta"], x["g"], x["S0"]
    a = torch.exp(g)
    for mode in MODES:
        gdn, S_gdn = delta_rule(q, k, v, beta, g=g, mode=mode, chunk_size=8, initial_state=S0, output_final_state=True)
        cb, S_cb = comba(q, k, v / a[..., None], beta * a, g=g, mode=mode, chunk_size=8, initial_state=S0,
                         output_final_state=True)
        assert rel_err(cb, gdn) < 1e-12 and rel_err(S_cb, S_gdn) < 1e-12, mode
        other, _ = comba(q, k, v, beta, g=g, mode=mode, chunk_size=8, initial_state=S0)
        assert rel_err(other, gdn) > 1e-3, mode
    # without a gate the two are the same (DeltaNet)
    o1, _ = comba(q, k, v, beta, initial_state=S0)
    o2, _ = delta_rule(q, k, v, beta, initial_state=S0)
    assert rel_err(o1, o2) < 1e-12


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_comba_extreme_key_norms_fp32(gate):
    """Key norms log-uniform in [1e-4, 1e2] (an exactly-zero key too), beta scaled so that beta ||k||^2 <= 1,
    p = s k with s in (0, 1]: every fp32 form within 1e-5 of the fp64 reference, gradients included."""
    B, T, H, K, V = 1, 80, 2, 16, 16
    gen = torch.Generator().manual_seed(5)
    x = comba_inputs(B, T, H, K, V, torch.float32, gate, seed=5)
    k = F.normalize(x["k"], dim=-1) * 10 ** torch.empty(B, T, H, 1).uniform_(-4, 2, generator=gen)
    k[:, 5, 0] = 0.0
    x["k"] = k
    x["beta"] = x["beta"] / (k * k).sum(-1).clamp_min(1.0)
    x["p"] = k * torch.rand(B, T, H, 1, generator=gen)
    want = with_grads(_comba_ref(), x)
    for mode, C in [("parallel", 64), ("recurrent", 64), ("chunk", 32)]:
        got = with_grads(_comba(mode, C), x)
        assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all(), mode
        assert_close(got, want, 1e-5, mode)


# ---------------------------------------------------------------- DeltaProduct: every form vs the reference

@pytest.mark.parametrize("T", [1, 23])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [None, "head", "channel"])
@pytest.mark.parametrize("n", [2, 3])
def test_delta_product_forms_match_reference(n, gate, dtype, T):
    x = dp_inputs(2, T, 2, n, 8, 6, dtype, gate, beta_max=2.0)
    want = with_grads(_dp_ref(), x)
    for mode, C in FORMS:
        got = with_grads(_dp(mode, C), x)
        assert got[0].dtype == dtype and got[0].shape == (2, T, 2, 6)
        assert got[1].dtype == dtype and got[1].shape == (2, 2, 8, 6)
        assert_close(got, want, TOL[dtype], (mode, C))


def test_delta_product_qk_l2norm_scale_and_many_chunks():
    x = dp_inputs(1, 150, 2, 2, 8, 8, torch.float64, "head", beta_max=2.0, norms=(0.1, 20.0))
    want = with_grads(_dp_ref(scale=0.7, qk_l2norm=True), x)
    for mode, C in [("parallel", 64), ("recurrent", 64), ("chunk", 4), ("chunk", 16)]:
        assert_close(with_grads(_dp(mode, C, scale=0.7, qk_l2norm=True), x), want, 1e-10, (mode, C))


def test_delta_product_n1_is_delta_rule_and_the_steps_are_ordered():
    x = dp_inputs(2, 30, 2, 1, 8, 5, torch.float64, "channel")
    q, k, v, beta, g, S0 = (x[n] for n in ("q", "k", "v", "beta", "g", "S0"))
    for mode in MODES:
        a, Sa = delta_product(q, k, v, beta, g=g, mode=mode, chunk_size=8, initial_state=S0, output_final_state=True)
        b, Sb = delta_rule(q, k[:, :, :, 0], v[:, :, :, 0], beta[..., 0], g=g, mode=mode, chunk_size=8,
                           initial_state=S0, output_final_state=True)
        assert rel_err(a, b) < 1e-12 and rel_err(Sa, Sb) < 1e-12, mode
    # n = 2 is the delta rule over the interleaved sequence, the gate on the first sub-step only
    x = dp_inputs(1, 12, 2, 2, 8, 5, torch.float64, "head")
    q, k, v, beta, g, S0 = (x[n] for n in ("q", "k", "v", "beta", "g", "S0"))
    o, S = delta_product(q, k, v, beta, g=g, initial_state=S0, output_final_state=True)
    g2 = torch.stack([g, torch.zeros_like(g)], dim=2).reshape(1, 24, 2)
    q2 = torch.stack([torch.zeros_like(q), q], dim=2).reshape(1, 24, 2, 8)
    o2, S2 = delta_rule(q2, k.transpose(2, 3).reshape(1, 24, 2, 8), v.transpose(2, 3).reshape(1, 24, 2, 5),
                        beta.transpose(2, 3).reshape(1, 24, 2), g=g2, initial_state=S0, output_final_state=True)
    assert rel_err(o, o2[:, 1::2]) < 1e-12 and rel_err(S, S2) < 1e-12
    # swapping the two steps changes the result (the factors do not commute)
    o3, _ = delta_product(q, k.flip(3), v.flip(3), beta.flip(3), g=g, initial_state=S0)
    assert rel_err(o3, o) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_delta_product_beta_near_two(dtype):
    """beta in [1.9, 2] with unit keys: every factor has an eigenvalue near -1 (state tracking). The forms
    agree with the reference on a long sequence; with beta = 2 and v = 0 each step is a reflection, which
    keeps the Frobenius norm of the state."""
    x = dp_inputs(1, 96, 2, 3, 8, 8, dtype, "head", norms=(1.0, 1.0))
    x["beta"] = 1.9 + 0.1 * torch.rand(x["beta"].shape, dtype=dtype, generator=torch.Generator().manual_seed(2))
    want = with_grads(_dp_ref(), x)
    for mode, C in [("parallel", 64), ("recurrent", 64), ("chunk", 16)]:
        assert_close(with_grads(_dp(mode, C), x), want, TOL[dtype], (mode, C))
    q, k, S0 = x["q"], x["k"], x["S0"]
    two = torch.full(x["beta"].shape, 2.0, dtype=dtype)
    for mode in MODES:
        _, S = delta_product(q, k, torch.zeros_like(x["v"]), two, mode=mode, chunk_size=16, initial_state=S0,
                             output_final_state=True)
        norms, norms0 = S.flatten(2).norm(dim=-1), S0.flatten(2).norm(dim=-1)
        assert rel_err(norms, norms0) < 10 * TOL[dtype], mode
        assert rel_err(S, S0) > 1e-2  # it did move


def test_delta_product_extreme_key_norms_fp32():
    """Sub-key norms log-uniform in [1e-4, 1e2] (and a zero key), beta = u * min(2, 1.9 / ||k||^2)."""
    B, T, H, n, K, V = 1, 60, 2, 2, 16, 8
    gen = torch.Generator().manual_seed(4)
    x = dp_inputs(B, T, H, n, K, V, torch.float32, "channel", seed=4)
    k = F.normalize(x["k"], dim=-1) * 10 ** torch.empty(B, T, H, n, 1).uniform_(-4, 2, generator=gen)
    k[:, 3, 1, 1] = 0.0
    lam = (k * k).sum(-1)
    x["k"] = k
    x["beta"] = torch.rand(B, T, H, n, generator=gen) * torch.clamp(1.9 / lam.clamp_min(1e-30), max=2.0)
    want = with_grads(_dp_ref(), x)
    for mode, C in [("parallel", 128), ("recurrent", 64), ("chunk", 32)]:
        got = with_grads(_dp(mode, C), x)
        assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all(), mode
        assert_close(got, want, 1e-5, mode)


def test_delta_product_chunk_size_counts_substeps():
    x = dp_inputs(1, 50, 2, 3, 8, 4, torch.float32)
    args = (x["q"], x["k"], x["v"], x["beta"])
    used = functools.partial(linattn.chunk_size_used, backend="torch")  # the PyTorch chunk form's sizes
    assert used("delta_product", *args, chunk_size=64) == 63    # 21 tokens of 3 sub-steps
    assert used("delta_product", *args, chunk_size=2) == 3      # at least one token
    assert used("delta_product", *args, mode="parallel") == 150
    assert used("delta_product", *args, g=-torch.ones(1, 50, 2, 8), chunk_size=64) == 16
    assert used("comba", x["q"], x["q"], x["q"], x["beta"][..., 0], chunk_size=48) == 48


# ---------------------------------------------------------------- Kimi Delta Attention (delta_rule, g per channel)

@pytest.mark.parametrize("T", [1, 45])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("exact", [False, True])
def test_kda_forms_match_reference(exact, dtype, T):
    x = comba_inputs(2, T, 2, 8, 6, dtype, "channel", norms=(0.2, 1.4))

    def op(mode, C):
        def fn(q, k, v, beta, S0, g):
            return delta_rule(q, k, v, beta, g=g, exact=exact, mode=mode, chunk_size=C, initial_state=S0,
                              output_final_state=True)
        return fn

    want = with_grads(lambda q, k, v, beta, S0, g: delta_rule_ref(q, k, v, beta, g=g, exact=exact, S0=S0), x)
    for mode, C in FORMS:
        assert_close(with_grads(op(mode, C), x), want, TOL[dtype], (mode, C))


def test_kda_strong_gates_and_qk_l2norm():
    """Per-channel log-gates down to -20 per token, keys of norm up to 10 (normalised by qk_l2norm), fp32.
    Everything within 1e-5 of fp64, except the gate's gradient in the parallel form (one 40-token block,
    decays down to e^-800 inside it): measured 1.1e-5 (chunk 16: 2.5e-6, recurrent: 2e-7)."""
    x = comba_inputs(1, 40, 2, 8, 4, torch.float32, "channel", norms=(0.1, 10.0))
    x["g"] = -20 * torch.rand(1, 40, 2, 8, generator=torch.Generator().manual_seed(3))  # decays down to e^-20
    want = with_grads(lambda q, k, v, beta, S0, g: delta_rule_ref(q, k, v, beta, g=g, qk_l2norm=True, S0=S0), x)
    for mode in MODES:
        got = with_grads(lambda q, k, v, beta, S0, g: delta_rule(q, k, v, beta, g=g, qk_l2norm=True, mode=mode,
                                                                 chunk_size=16, initial_state=S0,
                                                                 output_final_state=True), x)
        if mode == "parallel":
            assert rel_err(got[2].pop("g"), want[2]["g"]) < 3e-5
        assert_close(got, (want[0], want[1], {n: t for n, t in want[2].items() if n in got[2]}), 1e-5, mode)


# ---------------------------------------------------------------- states and packed sequences

def _split_calls(op, x, split, first, rest, C=16):
    """The full chunk call, and `first` on the tokens before `split` then `rest` from its state."""
    tok = {n: t for n, t in x.items() if n != "S0"}
    full = op(**tok, mode="chunk", chunk_size=C, initial_state=x["S0"], output_final_state=True)
    a = op(**{n: t[:, :split] for n, t in tok.items()}, mode=first, chunk_size=C, initial_state=x["S0"],
           output_final_state=True)
    b = op(**{n: t[:, split:] for n, t in tok.items()}, mode=rest, chunk_size=C, initial_state=a[1],
           output_final_state=True)
    return full, torch.cat([a[0], b[0]], dim=1), b[1]


def _comba_kw(q, k, v, beta, g=None, p=None, **kw):
    return comba(q, k, v, beta, g=g, p=p, **kw)


def _dp_kw(q, k, v, beta, g=None, **kw):
    return delta_product(q, k, v, beta, g=g, **kw)


def _kda_kw(q, k, v, beta, g=None, **kw):
    return delta_rule(q, k, v, beta, g=g, **kw)


OPS = {"comba": (_comba_kw, lambda dt: comba_inputs(2, 50, 2, 8, 6, dt, "head", read_key=True)),
       "delta_product": (_dp_kw, lambda dt: dp_inputs(2, 50, 2, 2, 8, 6, dt, "head", beta_max=2.0)),
       "kda": (_kda_kw, lambda dt: comba_inputs(2, 50, 2, 8, 6, dt, "channel"))}


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("first,rest", [("chunk", "recurrent"), ("parallel", "chunk"), ("recurrent", "parallel")])
def test_state_hand_off(name, first, rest):
    op, make = OPS[name]
    (o_full, S_full), o, S = _split_calls(op, make(torch.float64), 23, first, rest)
    assert rel_err(o, o_full) < 1e-12 and rel_err(S, S_full) < 1e-12
    # chunk prefill, then one token at a time (decoding)
    x = make(torch.float64)
    tok = {n: t for n, t in x.items() if n != "S0"}
    o_a, S = op(**{n: t[:, :40] for n, t in tok.items()}, chunk_size=16, initial_state=x["S0"],
                output_final_state=True)
    outs = [o_a]
    for t in range(40, 50):
        o_t, S = op(**{n: v[:, t:t + 1] for n, v in tok.items()}, mode="recurrent", initial_state=S,
                    output_final_state=True)
        outs.append(o_t)
    assert rel_err(torch.cat(outs, dim=1), o_full) < 1e-12 and rel_err(S, S_full) < 1e-12


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("mode", MODES)
def test_cu_seqlens_equals_separate_calls(name, mode):
    op, make = OPS[name]
    lens = [5, 20, 1, 12]
    x = make(torch.float32)
    tok = {n: t[:1, :sum(lens)].contiguous() for n, t in x.items() if n != "S0"}
    K, V = x["S0"].shape[-2:]
    S0 = torch.randn(len(lens), 2, K, V, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    leaves = {n: t.clone().requires_grad_() for n, t in tok.items()}
    S0l = S0.clone().requires_grad_()
    o, S = op(**leaves, mode=mode, chunk_size=8, initial_state=S0l, output_final_state=True, cu_seqlens=cu)
    assert S.shape == (len(lens), 2, K, V)
    (o.sum() + S.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in [*leaves.values(), S0l])
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        oi, Si = op(**{n: t[:, a:b] for n, t in tok.items()}, mode=mode, chunk_size=8, initial_state=S0[i:i + 1],
                    output_final_state=True)
        assert rel_err(o[:, a:b], oi) < 1e-6 and rel_err(S[i:i + 1], Si) < 1e-6, i
    _, S2 = op(**tok, mode=mode, cu_seqlens=cu)
    assert S2 is None


@pytest.mark.parametrize("name", list(OPS))
def test_bf16_close_to_fp64(name):
    op, make = OPS[name]
    x = make(torch.float32)
    x64 = {n: t.to(torch.bfloat16).double() for n, t in x.items() if n != "S0"}
    xb = {n: t.to(torch.bfloat16) for n, t in x.items() if n != "S0"}
    ref, S_ref = op(**x64, qk_l2norm=True, output_final_state=True)
    for mode in MODES:
        o, S = op(**xb, qk_l2norm=True, mode=mode, output_final_state=True)
        assert o.dtype == torch.bfloat16 and S.dtype == torch.float32
        assert rel_err(o, ref) < 1e-2 and rel_err(S, S_ref) < 1e-2, mode


# ---------------------------------------------------------------- bad input

def test_comba_bad_inputs():
    x = comba_inputs(2, 6, 2, 4, 3, torch.float32, "head", read_key=True)
    q, k, v, beta, g, p, S0 = (x[n] for n in ("q", "k", "v", "beta", "g", "p", "S0"))
    E, TE = linattn.LinattnError, linattn.errors.LinattnTypeError
    with pytest.raises(E, match="p must have the shape of q"):
        comba(q, k, v, beta, p=p[..., :3])
    with pytest.raises(TE, match="p must be a torch.Tensor"):
        comba(q, k, v, beta, p=p.numpy())
    with pytest.raises(TE, match="p must have the dtype of q"):
        comba(q, k, v, beta, p=p.double())
    with pytest.raises(E, match="q must have shape"):
        comba(q[0], k, v, beta, p=p)
    with pytest.raises(E, match="k must have the shape of q"):
        comba(q, k[..., :3], v, beta)
    with pytest.raises(E, match=r"beta must have shape \[B, T, H\]"):
        comba(q, k, v, beta[..., None])
    with pytest.raises(E, match="beta is a step size"):
        comba(q, k, v, beta - 2.0)
    with pytest.raises(E, match="g is a log-gate"):
        comba(q, k, v, beta, g=-g + 0.1)
    with pytest.raises(E, match=r"g must have shape \[B, T, H\] or \[B, T, H, 4\]"):
        comba(q, k, v, beta, g=g[..., None].expand(2, 6, 2, 5))
    with pytest.raises(E, match=r"initial_state must have shape \[N, H, K, V\]"):
        comba(q, k, v, beta, initial_state=S0[..., :2])
    with pytest.raises(E, match="mode must be one of"):
        comba(q, k, v, beta, mode="fast")
    with pytest.raises(TE, match="qk_l2norm must be a bool"):
        comba(q, k, v, beta, qk_l2norm=1)
    with pytest.raises(E, match="backend must be one of"):
        comba(q, k, v, beta, backend="cuda")
    with pytest.raises(E, match=r"needs batch size 1 \(\[1, T_total"):
        comba(q, k, v, beta, cu_seqlens=torch.tensor([0, 2, 6]))


def test_delta_product_bad_inputs():
    x = dp_inputs(2, 6, 2, 2, 4, 3, torch.float32, "head")
    q, k, v, beta, g, S0 = (x[n] for n in ("q", "k", "v", "beta", "g", "S0"))
    E, TE = linattn.LinattnError, linattn.errors.LinattnTypeError
    with pytest.raises(E, match=r"k must be a torch.Tensor of shape \[B, T, H, n, K\]"):
        delta_product(q, k[:, :, :, 0], v, beta)
    with pytest.raises(E, match=r"k must have shape \[B, T, H, n, K\] with n >= 1"):
        delta_product(q, k[:, :, :, :0], v[:, :, :, :0], beta[..., :0])
    with pytest.raises(E, match=r"k must have shape \[B, T, H, n, K\]"):
        delta_product(q, k[..., :3], v, beta)
    with pytest.raises(E, match=r"v must have shape \[B, T, H, n, V\] \(n as in k\)"):
        delta_product(q, k, torch.cat([v, v], dim=3), beta)
    with pytest.raises(E, match=r"v must be a torch.Tensor of shape \[B, T, H, n, V\]"):
        delta_product(q, k, v[:, :, :, 0], beta)
    with pytest.raises(E, match=r"beta must have shape \[B, T, H, n\] \(n as in k\)"):
        delta_product(q, k, v, beta[..., :1])
    with pytest.raises(E, match=r"beta must have shape \[B, T, H, n\]"):
        delta_product(q, k, v, beta[..., 0])
    with pytest.raises(TE, match="beta must be a torch.Tensor"):
        delta_product(q, k, v, 0.5)
    with pytest.raises(E, match="beta is a step size and must be >= 0"):
        delta_product(q, k, v, beta - 1.5)
    with pytest.raises(E, match="beta contains NaN"):
        delta_product(q, k, v, torch.full_like(beta, float("nan")))
    with pytest.raises(E, match=r"q must be a torch.Tensor of shape \[B, T, H, K\]"):
        delta_product(q[0], k, v, beta)
    with pytest.raises(TE, match="q must be float16"):
        delta_product(q.long(), k, v, beta)
    with pytest.raises(TE, match="q, k, v must share one dtype"):
        delta_product(q, k, v.double(), beta)
    with pytest.raises(E, match="g is a log-gate and must be <= 0"):
        delta_product(q, k, v, beta, g=-g + 0.1)
    with pytest.raises(E, match=r"g must have shape \[B, T, H\] or \[B, T, H, 4\] = \(2, 6, 2\)"):
        delta_product(q, k, v, beta, g=g[:, :3])
    with pytest.raises(E, match="g must be finite"):
        delta_product(q, k, v, beta, g=torch.full_like(g, float("-inf")))
    with pytest.raises(E, match=r"initial_state must have shape \[N, H, K, V\]"):
        delta_product(q, k, v, beta, initial_state=S0[:, :1])
    with pytest.raises(E, match="chunk_size must be a positive int"):
        delta_product(q, k, v, beta, chunk_size=0)
    with pytest.raises(E, match="mode must be one of"):
        delta_product(q, k, v, beta, mode="fused")
    with pytest.raises(E, match=r"needs batch size 1 \(\[1, T_total"):
        delta_product(q, k, v, beta, cu_seqlens=torch.tensor([0, 2, 6]))
    x1 = dp_inputs(1, 6, 2, 2, 4, 3, torch.float32)
    args = (x1["q"], x1["k"], x1["v"], x1["beta"])
    with pytest.raises(E, match="cu_seqlens must start at 0 and end at T = 6"):
        delta_product(*args, cu_seqlens=torch.tensor([0, 2, 7]))
    with pytest.raises(E, match=r"initial_state must have shape \[N, H, K, V\] = \(2,"):
        delta_product(*args, cu_seqlens=torch.tensor([0, 2, 6]), initial_state=torch.zeros(1, 2, 4, 3))


def test_exported():
    assert linattn.comba is comba and linattn.delta_product is delta_product
    assert {"comba", "delta_product"} <= set(linattn.__all__)
    assert {"comba", "delta_product"} <= set(linattn.ops.__all__)


# ---------------------------------------------------------------- layers

def decode_matches(layer, x, prefill=3, atol=1e-4):
    with torch.no_grad():
        full = layer(x)
        cache = LayerCache()
        outs = [layer(x[:, :prefill], cache=cache)]
        for t in range(prefill, x.shape[1]):
            outs.append(layer(x[:, t:t + 1], cache=cache))
    assert (torch.cat(outs, dim=1) - full).abs().max().item() <= atol
    return cache


@pytest.mark.parametrize("cls,kw", [(Comba, {}), (Comba, {"output_correction": False, "correction_factor": 0.02}),
                                    (DeltaProduct, {}), (DeltaProduct, {"n_householder": 3, "gate": True,
                                                                        "allow_negative_eigenvalues": True}),
                                    (DeltaProduct, {"rope": True, "short_conv": False}),
                                    (KDA, {}), (KDA, {"gate_rank": 4, "output_gate": False})])
def test_layers(cls, kw):
    torch.manual_seed(0)
    layer = cls(32, 4, **kw)
    x = torch.randn(2, 11, 32)
    y = layer(x)
    assert y.shape == x.shape and torch.isfinite(y).all()
    y.square().mean().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None or p.grad.abs().max() == 0]
    assert not missing, f"no gradient for {missing}"
    cache = decode_matches(layer, x)
    assert cache["state"].shape == (2, 4, 8, 8)


def test_layer_details():
    x = torch.randn(2, 7, 32)
    dp = DeltaProduct(32, 4, n_householder=3, allow_negative_eigenvalues=True)
    with torch.no_grad():
        dp.b_proj.bias.fill_(4.0)
        b = dp.beta(x)
    assert b.shape == (2, 7, 4, 3) and (b > 1.5).all() and (b < 2).all()
    assert DeltaProduct(32, 4).beta(x).lt(1).all() and DeltaProduct(32, 4).log_gate(x) is None
    assert dp.k_proj.out_features == 4 * 3 * 8 and dp.v_proj.out_features == 4 * 3 * 8
    kda = KDA(32, 4)
    g = kda.log_gate(x)
    assert g.shape == (2, 7, 4, 8) and g.le(0).all()
    assert not hasattr(Comba(32, 4, output_correction=False), "d")
    assert torch.equal(Comba(32, 4, correction_factor=0.5).d.data, torch.full((4,), 0.5))
    with pytest.raises(linattn.LinattnError, match="n_householder"):
        DeltaProduct(32, 4, n_householder=0)
    with pytest.raises(linattn.LinattnError, match="gate_rank"):
        KDA(32, 4, gate_rank=0)
    with pytest.raises(linattn.errors.LinattnTypeError, match="correction_factor"):
        Comba(32, 4, correction_factor="1")


def test_comba_layer_uses_the_read_key_and_correction():
    """The layer's output is comba with p = sigmoid(c) k_hat and q~ = q_hat - d p."""
    torch.manual_seed(0)
    layer = Comba(32, 2, short_conv=False, output_norm=False).double()
    with torch.no_grad():
        layer.p_gain.copy_(torch.tensor([0.3, -1.0]))
        layer.d.copy_(torch.tensor([0.5, 2.0]))
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    q, k, v = layer._qkv(x, None)
    qn, kn = l2_normalize(q), l2_normalize(k)
    p = torch.sigmoid(layer.p_gain)[:, None] * kn
    ref, _ = comba_ref(qn - layer.d[:, None] * p, kn, v, layer.beta(x), p=p, g=layer.log_gate(x))
    with torch.no_grad():
        o = layer._mix(q, k, v, x, None)
    assert rel_err(o, ref) < 1e-12


# ---------------------------------------------------------------- `linattn bench ops` rows

@pytest.mark.parametrize("op", ["comba", "delta_product", "kda"])
def test_bench_rows(op, monkeypatch):
    from linattn.bench import ops as bench
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")  # the PyTorch chunk form (the compiled scan uses no chunks)
    assert bench.OP_BY_KEY[op].family == "delta-variants" and "delta-variants" in bench.FAMILIES
    spec = dict(B=1, T=20, H=2, K=8, V=8, chunk_size=8)
    for mode in ("chunk", "recurrent"):
        for ps in ("fwd", "fwdbwd"):
            bench.build_case(op, mode, ps, **spec)()
    used = bench.case_chunk_size(op, "chunk", "fwd", **spec)
    assert used == 8 and bench.case_chunk_size(op, "recurrent", "fwd", **spec) is None
    n = bench.DP_HOUSEHOLDER if op == "delta_product" else 1
    f = bench.flops(op, "chunk", "fwd", 1, 20, 2, 8, 8, used)
    assert f == 1 * 2 * 20 * n * (6 * used * 8 + 4 * used * 8 + 6 * 8 * 8)


# ---------------------------------------------------------------- the Triton path (interpreter on CPU)

TRITON_SCRIPT = r"""
import warnings
import torch, torch.nn.functional as F
import linattn
from linattn.ops.reference import delta_product_ref, rel_err
torch.manual_seed(0)
B, T, H, n, K, V = 1, 20, 2, 2, 16, 16
q, v = torch.randn(B, T, H, K), torch.randn(B, T, H, n, V)
k = F.normalize(torch.randn(B, T, H, n, K), dim=-1)
b, g = 2 * torch.rand(B, T, H, n), -0.3 * torch.rand(B, T, H)
ro, rS = delta_product_ref(q, k, v, b, g=g)
for mode in ("chunk", "recurrent"):
    o, S = linattn.delta_product(q, k, v, b, g=g, mode=mode, chunk_size=16, output_final_state=True, backend="triton")
    assert rel_err(o, ro) < 1e-5 and rel_err(S, rS) < 1e-5, (mode, rel_err(o, ro))
leaves = [x.clone().requires_grad_() for x in (q, k, v, b, g)]
grads = []
for be in ("triton", "torch"):
    o, _ = linattn.delta_product(*leaves[:4], g=leaves[4], chunk_size=16, backend=be)
    grads.append(torch.autograd.grad(o.square().sum(), leaves))
assert all(rel_err(a, c) < 1e-5 for a, c in zip(*grads))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    linattn.comba(q, k[:, :, :, 0], v[:, :, :, 0], b[..., 0], backend="triton")
assert any("read key" in str(x.message) for x in w)   # no kernel for Comba's read key: PyTorch, with a warning
print("ok")
"""


def test_triton_interpreter_delta_product_and_comba_fallback():
    """delta_product's interleaved calls are covered by the delta-rule kernels (per-head gate, no read key):
    forward (chunk, recurrent) and chunk backward on Triton's interpreter agree with the reference."""
    import importlib.util
    import os
    import subprocess
    import sys
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("C", [1, 5, 8, 17, 40])
def test_channel_scores_sub_blocks_match_explicit_decays(C, strict):
    """The per-channel chunk scores by sub-blocks (a matmul across sub-blocks, each side rescaled to the earlier
    sub-block's last log-decay) equal the explicit sum_d x_td y_id e^{Gx_td - Gy_id} on and below the diagonal,
    with log-gates down to -50 per token: a chunk decays by up to e^-2000, which a single reference point per
    chunk would turn into e^+1000 factors (inf even in fp64)."""
    from linattn.ops.delta_core import _channel_scores

    gen = torch.Generator().manual_seed(C)
    x, y = (torch.randn(2, 3, C, 6, dtype=torch.float64, generator=gen) for _ in range(2))
    g = -50 * torch.rand(2, 3, C, 6, dtype=torch.float64, generator=gen)
    Gy = g.cumsum(-2)
    Gx = Gy - g if strict else Gy
    keep = torch.ones(C, C, dtype=torch.bool).tril(-1 if strict else 0)
    decay = torch.exp((Gx.unsqueeze(-2) - Gy.unsqueeze(-3)).masked_fill(~keep[..., None], float("-inf")))
    want = torch.einsum("...td,...tid,...id->...ti", x, decay, y)
    got = _channel_scores(x, y, Gx, Gy, strict=strict)
    assert got.shape == want.shape
    assert torch.isfinite(got).all()
    assert torch.allclose(got.masked_fill(~keep, 0.0), want, rtol=1e-12, atol=1e-300)


def test_channel_scores_gradients():
    """The written-out backward of the sub-block product (and the rest of _channel_scores) against finite
    differences, fp64, both masks, a chunk length that pads the last sub-block."""
    from linattn.ops.delta_core import _channel_scores

    gen = torch.Generator().manual_seed(7)
    x, y = (torch.randn(2, 11, 3, dtype=torch.float64, generator=gen).requires_grad_() for _ in range(2))
    g = (-2 * torch.rand(2, 11, 3, dtype=torch.float64, generator=gen)).requires_grad_()
    for strict in (False, True):
        def scores(x, y, g):
            G = g.cumsum(-2)
            keep = torch.ones(11, 11, dtype=torch.bool).tril(-1 if strict else 0)
            return _channel_scores(x, y, G - g if strict else G, G, strict=strict).masked_fill(~keep, 0.0)
        assert torch.autograd.gradcheck(scores, (x, y, g))
