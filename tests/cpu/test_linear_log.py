"""The log-space feature maps (ELA's Hadamard Exp, FAVOR+) on the compiled CPU kernels (csrc/linear_log.c,
cpu/linear_log.py): against the fp64 reference written from the formulas (ops/reference.py), both forms the kernel
serves (chunk, recurrent), outputs and gradients of q, k, v, the gate and the initial state, T not a multiple of
the chunk, T = 1, cu_seqlens, initial / final states with their log-scale, fp32 / fp64 / bf16 inputs, magnitudes a
linear-space kernel would overflow at, poison and prefix bits, the K_phi limit, and the one-token decoding step of
a LinearAttention layer."""
import os
import shutil

import pytest
import torch

from linattn import FAVORPlus, LinattnError, explain, linear_attention
from linattn.cpu import linear_log as cpu_log
from linattn.ops.reference import linear_attention_ref

HAVE_CC = shutil.which(os.environ.get("CC", "").strip() or "cc") is not None
pytestmark = [pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the compiled CPU kernels cannot build"),
              pytest.mark.usefixtures("one_thread_module")]

MAPS = ("hadamard_exp", "favor+")
FORMS = ("chunk", "recurrent")


def _fmap(name, K):
    return FAVORPlus(K, n_features=12, seed=3) if name == "favor+" else name


def _inputs(B, T, H, K, V, dtype, seed=0, mag=1.0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) * mag for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.5
    return q.to(dtype), k.to(dtype), v.to(dtype), g.to(dtype)


def _ref(q, k, v, fm, g=None, normalize=True, cu=None):
    """The fp64 reference; packed sequences one by one."""
    fmap = fm if not isinstance(fm, str) else None
    name = fm if isinstance(fm, str) else "favor+"
    if cu is None:
        return linear_attention_ref(q, k, v, name, log_gate=g, fmap=fmap, normalize=normalize)
    parts = [linear_attention_ref(q[:, a:b], k[:, a:b], v[:, a:b], name, fmap=fmap, normalize=normalize,
                                  log_gate=None if g is None else g[:, a:b]) for a, b in zip(cu[:-1], cu[1:])]
    return torch.cat(parts, 1)


def _run(q, k, v, fm, g=None, **kw):
    return linear_attention(q, k, v, feature_map=fm, g=g, backend="cpu", **kw)


def test_the_compiled_kernel_takes_the_log_space_maps():
    q, k, v, _ = _inputs(1, 5, 2, 8, 4, torch.float32)
    for name in MAPS:
        for mode in FORMS:
            why = explain(linear_attention, q, k, v, feature_map=_fmap(name, 8), mode=mode)
            assert str(why).startswith("cpu"), why


@pytest.mark.parametrize("gate", [False, True], ids=["no-gate", "scalar-gate"])
@pytest.mark.parametrize("mode", FORMS)
@pytest.mark.parametrize("name", MAPS)
@pytest.mark.parametrize("T", [1, 37], ids=["T1", "T37"])
def test_outputs_and_gradients_against_the_fp64_reference(name, mode, gate, T):
    """fp64 inputs, chunk 16 (37 is not a multiple of it): outputs and the gradients of q, k, v and g."""
    B, H, K, V = 2, 2, 8, 5
    q, k, v, g = _inputs(B, T, H, K, V, torch.float64, seed=1, mag=1.5)
    g = g if gate else None
    fm = _fmap(name, K)
    leaves = [t.clone().requires_grad_() for t in (q, k, v) + ((g,) if gate else ())]
    o, _ = _run(*leaves[:3], fm, leaves[3] if gate else None, mode=mode, chunk_size=16)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v) + ((g,) if gate else ())]
    r = _ref(*ref_leaves[:3], fm, ref_leaves[3] if gate else None)
    torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(r)
    got = torch.autograd.grad((o * w).sum(), leaves)
    want = torch.autograd.grad((r * w).sum(), ref_leaves)
    for name_, a, b in zip("qkvg", got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name_}: {m}")


@pytest.mark.parametrize("V", [16, 32, 64, 70, 80, 129])
def test_value_widths_of_the_vector_blocks(V):
    """The token update's column passes (blocks of 4 vector lines, single lines, scalar columns; z riding along the
    first vector pass or on its own): value widths that take each of them in fp32 (16 lanes) and fp64 (8 lanes),
    outputs and gradients against the fp64 reference, keys that raise the running maximum mid-sequence."""
    B, T, H, K = 1, 37, 2, 8
    q, k, v, g = _inputs(B, T, H, K, V, torch.float64, seed=11, mag=2.0)
    k[:, 20] += 30.0
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    o, _ = _run(*leaves[:3], "hadamard_exp", leaves[3], chunk_size=16)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    r = _ref(*ref_leaves[:3], "hadamard_exp", ref_leaves[3])
    torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(r)
    for name_, a, b in zip("qkvg", torch.autograd.grad((o * w).sum(), leaves),
                           torch.autograd.grad((r * w).sum(), ref_leaves)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"d{name_}: {m}")
    o32, _ = _run(q.float(), k.float(), v.float(), "hadamard_exp", g.float(), normalize=False, chunk_size=16)
    r32 = _ref(q, k, v, "hadamard_exp", g, normalize=False)
    torch.testing.assert_close(o32.double(), r32, rtol=3e-5, atol=3e-5 * float(r32.abs().max()))


@pytest.mark.parametrize("name", MAPS)
def test_unnormalised_and_fp32(name):
    B, T, H, K, V = 1, 29, 3, 8, 4
    fm = _fmap(name, K)
    q, k, v, g = _inputs(B, T, H, K, V, torch.float32, seed=2)
    r = _ref(q.double(), k.double(), v.double(), fm, g.double(), normalize=False)
    o, _ = _run(q, k, v, fm, g, normalize=False, chunk_size=8)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o.double(), r, rtol=2e-5, atol=2e-5)
    o, _ = _run(q, k, v, fm, g, chunk_size=8)
    torch.testing.assert_close(o.double(), _ref(q.double(), k.double(), v.double(), fm, g.double()),
                               rtol=2e-5, atol=2e-5)


def test_bf16_inputs():
    q, k, v, g = _inputs(2, 21, 2, 8, 4, torch.bfloat16, seed=3)
    o, _ = _run(q, k, v, "hadamard_exp", g, chunk_size=8)
    assert o.dtype == torch.bfloat16
    r = _ref(q.double(), k.double(), v.double(), "hadamard_exp", g.double())
    torch.testing.assert_close(o.double(), r, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype, mag", [(torch.float32, 120.0), (torch.float64, 100.0)])
def test_magnitudes_a_linear_space_kernel_overflows_at(dtype, mag):
    """exp(q_d + k_d) reaches e^~600 here (fp32 overflows past e^88; the fp64 reference near e^709 bounds the
    magnitudes): the kernel stays exact, gradients too."""
    B, T, H, K, V = 1, 33, 2, 6, 4
    q, k, v, g = _inputs(B, T, H, K, V, dtype, seed=4, mag=mag)
    assert (q.double() + k.double()).abs().max() > 100
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, st = _run(*leaves, "hadamard_exp", g, chunk_size=8, output_final_state=True)
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    r = _ref(*ref_leaves, "hadamard_exp", g.double())
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(o.double(), r, rtol=tol, atol=tol)
    assert torch.isfinite(st.kv).all() and torch.isfinite(st.log_scale).all()
    w = torch.randn_like(r)
    for a, b in zip(torch.autograd.grad((o * w.to(dtype)).sum(), leaves),
                    torch.autograd.grad((r * w).sum(), ref_leaves)):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a.double(), b, rtol=50 * tol, atol=50 * tol)


@pytest.mark.parametrize("mode", FORMS)
def test_cu_seqlens(mode):
    cu = [0, 1, 17, 40, 41]
    q, k, v, g = _inputs(1, cu[-1], 2, 8, 3, torch.float64, seed=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    o, st = _run(*leaves[:3], "hadamard_exp", leaves[3], mode=mode, chunk_size=8,
                 cu_seqlens=torch.tensor(cu), output_final_state=True)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v, g)]
    r = _ref(*ref_leaves[:3], "hadamard_exp", ref_leaves[3], cu=cu)
    torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-10)
    assert st.kv.shape[0] == 4 and st.log_scale.shape == (4, 2, 8)
    w = torch.randn_like(r)
    for a, b in zip(torch.autograd.grad((o * w).sum(), leaves), torch.autograd.grad((r * w).sum(), ref_leaves)):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", MAPS)
def test_states_carry_and_match_the_torch_forms(name):
    """A split run through the final state (its log-scale included) gives the full run; the state is the torch
    forms' (kv, z, log_scale: the running maximum of the decayed keys) and exp(log_scale) [kv | z] is the true
    state written from the formula."""
    B, T, H, K, V = 2, 30, 2, 8, 4
    fm = _fmap(name, K)
    q, k, v, g = _inputs(B, T, H, K, V, torch.float64, seed=6, mag=3.0)
    o1, s1 = _run(q[:, :13], k[:, :13], v[:, :13], fm, g[:, :13], chunk_size=8, output_final_state=True)
    o2, s2 = _run(q[:, 13:], k[:, 13:], v[:, 13:], fm, g[:, 13:], chunk_size=8, initial_state=s1,
                  output_final_state=True)
    torch.testing.assert_close(torch.cat([o1, o2], 1), _ref(q, k, v, fm, g), rtol=1e-10, atol=1e-10)
    for mode in FORMS:
        _, st = linear_attention(q, k, v, feature_map=fm, g=g, backend="torch", mode=mode, chunk_size=8,
                                 output_final_state=True)
        torch.testing.assert_close(s2.log_scale, st.log_scale, rtol=0, atol=1e-12)
        torch.testing.assert_close(s2.kv, st.kv, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(s2.z, st.z, rtol=1e-10, atol=1e-12)
    lk = fm.psi(k) if name == "favor+" else k  # [B, T, H, Kf] log-features
    G = g.cumsum(1)
    logw = lk + (G[:, -1:] - G).unsqueeze(-1)                       # log of each key's weight at the end
    true_kv = torch.einsum("bthd,bthv->bhdv", torch.exp(logw), v)
    torch.testing.assert_close(torch.exp(s2.log_scale).unsqueeze(-1) * s2.kv, true_kv, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s2.log_scale, logw.amax(1), rtol=0, atol=1e-10)


def test_gradients_through_initial_and_final_states():
    """gradcheck (fp64) of the compiled path with an initial state (kv, z) and a loss on the final state too (on the
    true state exp(log_scale) [kv | z]: the log-scale is a stabiliser without gradient, as in the torch forms)."""
    B, T, H, K, V = 1, 11, 2, 4, 3
    q, k, v, g = _inputs(B, T, H, K, V, torch.float64, seed=7, mag=2.0)
    _, s0 = _run(q, k, v, "hadamard_exp", g, output_final_state=True)
    w = torch.randn(B, H, K, V, dtype=torch.float64)

    def f(q, k, v, g, kv, z):
        st = s0._replace(kv=kv, z=z)
        o, s = _run(q, k, v, "hadamard_exp", g, chunk_size=4, initial_state=st, output_final_state=True)
        scale = torch.exp(s.log_scale)
        return o, (scale.unsqueeze(-1) * s.kv * w).sum() + (scale * s.z).sum()

    args = [t.clone().requires_grad_() for t in (q, k, v, g, s0.kv, s0.z)]
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6, rtol=1e-5)


def test_poison_and_prefix_bits():
    """An inf / NaN at position t leaves every earlier output's bits; a prefix run gives the full run's first t
    outputs to the bit (both forms, fp32, a key 100 nats above the rest mid-chunk)."""
    B, T, H, K, V = 2, 40, 2, 8, 5
    q, k, v, g = _inputs(B, T, H, K, V, torch.float32, seed=8)
    k[:, 10] += 100.0
    for mode in FORMS:
        full, _ = _run(q, k, v, "hadamard_exp", g, mode=mode, chunk_size=16)
        assert torch.isfinite(full).all()
        for t in (1, 11, 16, 23, 39):
            pre, _ = _run(q[:, :t], k[:, :t], v[:, :t], "hadamard_exp", g[:, :t], mode=mode, chunk_size=16)
            assert torch.equal(pre, full[:, :t]), (mode, t)
        for t in (5, 17, 33):
            for which, bad in (("k", float("inf")), ("v", float("nan")), ("q", float("nan")), ("k", float("-inf"))):
                x = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
                x[which][:, t] = bad
                out = linear_attention(x["q"], x["k"], x["v"], feature_map="hadamard_exp", g=g, mode=mode,
                                       chunk_size=16, backend="cpu")[0]
                assert torch.equal(out[:, :t], full[:, :t]), (mode, t, which)


def test_feature_width_limit():
    """K_phi beyond the kernel's limit: the dispatch says why and falls back; the kernel's entry refuses it."""
    K = 4
    fm = FAVORPlus(K, n_features=cpu_log.MAX_FEATURES + 1)
    q, k, v, _ = _inputs(1, 3, 1, K, 2, torch.float32)
    why = explain(linear_attention, q, k, v, feature_map=fm)
    assert "K_phi" in str(why) and str(cpu_log.MAX_FEATURES) in str(why)
    with pytest.warns(UserWarning, match="K_phi"):
        o, _ = linear_attention(q, k, v, feature_map=fm, backend="cpu")
    torch.testing.assert_close(o, linear_attention(q, k, v, feature_map=fm, backend="torch")[0])
    lq = torch.zeros(3, 1, cpu_log.MAX_FEATURES + 1)
    with pytest.raises(LinattnError, match="K_phi"):
        cpu_log.chunk_linear_log_attention(lq, lq, torch.zeros(3, 1, 2), None, None, None, starts=[0, 3],
                                           chunk_size=8)
    fm = FAVORPlus(K, n_features=cpu_log.MAX_FEATURES)
    assert str(explain(linear_attention, q, k, v, feature_map=fm)).startswith("cpu")
