"""RWKV-7's compiled scan (linattn/cpu/rwkv7.py, csrc/rwkv7.c), what `rwkv7` runs on CPU tensors: outputs, final
states and the gradients of every input (r, w, k, v, a, b, initial_state) against the fp64 token loop (rwkv7_ref)
and the PyTorch fallback, stretches across the backward's checkpoints, T = 1, packed sequences, value widths over
the kernel's column blocks, fp64 gradcheck, half inputs, hostile decays and magnitudes, poison and prefix
causality, thread counts, the dispatch rules and the custom ops' registrations. Skips with a reason when there is
no C compiler (CI has gcc)."""
from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.cpu import build as cbuild
from linattn.ops.reference import rwkv7_ref
from linattn.ops.rwkv7 import prepare_rwkv7

HAVE_CC = shutil.which(os.environ.get("CC", "").strip() or "cc") is not None
pytestmark = [pytest.mark.skipif(not HAVE_CC, reason="no C compiler (cc / $CC): the compiled CPU kernels cannot "
                                 "build"), pytest.mark.usefixtures("one_thread_module")]

TOL = {torch.float32: 2e-5, torch.float64: 1e-11}
NAMES = ["r", "w", "k", "v", "a", "b", "initial_state"]


@pytest.fixture(scope="module", autouse=True)
def _kernels_on():
    """The kernels switched on and built once for the module (seconds, then the cache)."""
    if not cbuild.enabled():
        pytest.skip("LINATTN_CPU_KERNELS=0")
    from linattn.cpu.rwkv7 import available
    assert available(), "csrc/rwkv7.c did not build although a compiler exists"


def _inputs(Bsz, T, H, K, V, dtype, seed=0, N=None, w_scale=0.6065306597126334):
    """As the RWKV-7 layer makes them: w in (-w_scale, 0), a = -kk, b = kk * (0, 1), kk unit."""
    g = torch.Generator().manual_seed(seed)
    r, k = torch.randn(Bsz, T, H, K, generator=g), torch.randn(Bsz, T, H, K, generator=g)
    w = -w_scale * torch.rand(Bsz, T, H, K, generator=g)
    kk = F.normalize(torch.randn(Bsz, T, H, K, generator=g), dim=-1)
    a, b = -kk, kk * torch.rand(Bsz, T, H, K, generator=g)
    v = torch.randn(Bsz, T, H, V, generator=g)
    S0 = torch.randn(Bsz if N is None else N, H, K, V, generator=g)
    return [x.to(dtype) for x in (r, w, k, v, a, b, S0)]


def _op(backend, cu_seqlens=None, mode="chunk", scale=0.7):
    def run(r, w, k, v, a, b, S0):
        return linattn.rwkv7(r, w, k, v, a, b, scale=scale, initial_state=S0, output_final_state=True,
                             cu_seqlens=cu_seqlens, mode=mode, chunk_size=16, backend=backend)
    return run


def _ref(offsets=None, scale=0.7):
    def run(r, w, k, v, a, b, S0):
        if offsets is None:
            return rwkv7_ref(r, w, k, v, a, b, scale=scale, S0=S0)
        outs, states = [], []
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            o, S = rwkv7_ref(*(x[:, lo:hi] for x in (r, w, k, v, a, b)), scale=scale, S0=S0[i:i + 1])
            outs.append(o), states.append(S)
        return torch.cat(outs, 1), torch.cat(states)
    return run


def _grads(fn, tensors, wo, wS):
    """(o, S, gradients of every input) for the loss sum(o * wo) + sum(S * wS), in fp64."""
    leaves = [x.detach().clone().requires_grad_() for x in tensors]
    o, S = fn(*leaves)
    loss = (o.double() * wo).sum() + (S.double() * wS).sum()
    return o, S, torch.autograd.grad(loss, leaves)


def _close(a, b, tol, what):
    err = (a.double() - b.double()).abs().max().item() / max(1.0, b.double().abs().max().item())
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


def _weights(o_shape, S_shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(o_shape, generator=g, dtype=torch.float64),
            torch.randn(S_shape, generator=g, dtype=torch.float64))


# ------------------------------------------------------------------ outputs, states and gradients

@pytest.mark.parametrize("T", [1, 45, 64, 130])  # 64: one whole stretch; 130: three, the last of 2 tokens
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_matches_reference_and_torch(dtype, T):
    Bsz, H, K, V = 2, 2, 8, 5
    x = _inputs(Bsz, T, H, K, V, dtype)
    wo, wS = _weights((Bsz, T, H, V), (Bsz, H, K, V))
    co, cS, cg = _grads(_op("cpu"), x, wo, wS)
    ro, rS, rg = _grads(_ref(), [t.double() for t in x], wo, wS)
    to, tS, tg = _grads(_op("torch"), x, wo, wS)
    assert co.dtype == dtype and cS.dtype == dtype
    for name, c, r, t in zip(["o", "S"] + [f"d{n}" for n in NAMES], [co, cS, *cg], [ro, rS, *rg], [to, tS, *tg]):
        _close(c, r, TOL[dtype], f"{name} vs the fp64 reference")
        _close(c, t, TOL[dtype], f"{name} vs the PyTorch fallback")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K,V", [(3, 70), (33, 129), (64, 64)])
def test_value_widths_across_column_blocks(K, V, dtype):
    """V over one or more of the kernel's column blocks (64 floats / 32 doubles with AVX-512, half without) plus a
    narrower tail, odd K, and the benchmark's K = V = 64."""
    x = _inputs(1, 20, 2, K, V, dtype, seed=2)
    wo, wS = _weights((1, 20, 2, V), (1, 2, K, V))
    co, cS, cg = _grads(_op("cpu"), x, wo, wS)
    ro, rS, rg = _grads(_ref(), [t.double() for t in x], wo, wS)
    for name, c, r in zip(["o", "S"] + [f"d{n}" for n in NAMES], [co, cS, *cg], [ro, rS, *rg]):
        _close(c, r, TOL[dtype], f"K={K} V={V} {name}")


def test_gradcheck_fp64():
    """torch.autograd.gradcheck of every input (a and b included) against finite differences, with and without the
    final state in the loss, across a checkpoint (T = 66)."""
    x = [t.requires_grad_() for t in _inputs(1, 66, 2, 3, 2, torch.float64, seed=3)]
    # fast_mode: a random projection u^T J v, numerical against analytical (a wrong term moves it), not all of J
    assert torch.autograd.gradcheck(lambda *t: _op("cpu")(*t), x, atol=1e-7, rtol=1e-6, fast_mode=True)
    assert torch.autograd.gradcheck(lambda *t: _op("cpu")(*t)[0], x, atol=1e-7, rtol=1e-6, fast_mode=True)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_packed_sequences_with_initial_states(mode):
    """cu_seqlens with uneven lengths (one of 1 token, one across two checkpoints) and a state per sequence."""
    offsets = [0, 1, 9, 139, 160]
    x = _inputs(1, offsets[-1], 2, 6, 5, torch.float64, seed=4, N=len(offsets) - 1)
    cu = torch.tensor(offsets)
    wo, wS = _weights((1, offsets[-1], 2, 5), (len(offsets) - 1, 2, 6, 5))
    co, cS, cg = _grads(_op("cpu", cu_seqlens=cu, mode=mode), x, wo, wS)
    ro, rS, rg = _grads(_ref(offsets), x, wo, wS)
    for name, c, r in zip(["o", "S"] + [f"d{n}" for n in NAMES], [co, cS, *cg], [ro, rS, *rg]):
        _close(c, r, TOL[torch.float64], f"packed {name}")


def test_no_initial_state_no_final_state_and_partial_grads():
    """Without initial_state and output_final_state (zeros in, no state gradient), and with only some inputs
    requiring a gradient."""
    r, w, k, v, a, b, _ = _inputs(2, 70, 2, 4, 3, torch.float64, seed=5)
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    o, S = linattn.rwkv7(r, w, k, v, a, b, backend="cpu")
    assert S is None
    wo = torch.randn(o.shape, dtype=torch.float64)
    ga, gb = torch.autograd.grad((o * wo).sum(), [a, b])
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ro, _ = rwkv7_ref(r, w, k, v, a2, b2)
    ra, rb = torch.autograd.grad((ro * wo).sum(), [a2, b2])
    _close(o, ro, 1e-12, "o"), _close(ga, ra, 1e-11, "da"), _close(gb, rb, 1e-11, "db")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_compute_in_float32(dtype):
    """Half inputs: the scan in float32 (as the PyTorch path), the output in the input dtype, the final state in
    float32; outputs and gradients as the fp64 loop on the same (rounded) inputs, to the output's rounding."""
    x = [t.to(dtype) for t in _inputs(1, 40, 2, 8, 8, torch.float32, seed=6)]
    leaves = [t.clone().requires_grad_() for t in x]
    o, S = _op("cpu")(*leaves)
    assert o.dtype == dtype and S.dtype == torch.float32
    ro, rS = _ref()(*(t.double() for t in x))
    _close(o, ro, 1e-2, "o"), _close(S, rS, 1e-5, "S")
    o.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == dtype and torch.isfinite(t.grad).all() for t in leaves)
    tref = [t.double().requires_grad_() for t in x]
    _ref()(*tref)[0].sum().backward()
    for name, t, rt in zip(NAMES, leaves, tref):
        _close(t.grad, rt.grad, 3e-2, f"half d{name}")


# ------------------------------------------------------------------ hostile inputs

@pytest.mark.parametrize("case", ["decay-near-0", "decay-0", "decay-near-1", "no-decay", "huge-values", "tiny-values"])
def test_hostile_decays_and_magnitudes(case):
    """Decays near 0 (w down to -1e3 per token, and -inf: exp(w) = 0) and near 1 (w = -1e-7, and 0), values at
    1e15 and 1e-30 in float32: the scan multiplies by exp(w) <= 1 alone and never divides, so it is finite wherever
    the recurrence is, and matches the fp64 loop (outputs, states, gradients)."""
    r, w, k, v, a, b, S0 = _inputs(1, 100, 2, 8, 6, torch.float32, seed=7)
    if case == "decay-near-0":
        w = w * 1e3 / 0.6065306597126334
    elif case == "decay-0":
        w = torch.where(torch.rand(w.shape, generator=torch.Generator().manual_seed(0)) < 0.5, float("-inf"), w)
    elif case == "decay-near-1":
        w = torch.full_like(w, -1e-7)
    elif case == "no-decay":
        w = torch.zeros_like(w)
    elif case == "huge-values":
        v, S0 = v * 1e15, S0 * 1e15
    else:
        v, S0, r = v * 1e-30, S0 * 1e-30, r * 1e-8
    x = [r, w, k, v, a, b, S0]
    wo, wS = _weights((1, 100, 2, 6), (1, 2, 8, 6))
    co, cS, cg = _grads(_op("cpu"), x, wo, wS)
    ro, rS, rg = _grads(_ref(), [t.double() for t in x], wo, wS)
    assert torch.isfinite(co).all() and torch.isfinite(cS).all()
    for name, c, rr in zip(["o", "S"] + [f"d{n}" for n in NAMES], [co, cS, *cg], [ro, rS, *rg]):
        if name == "dw" and case == "decay-0":   # d/dw of exp(w) at w = -inf is 0 (the fp64 loop: nan where w = -inf)
            assert torch.isfinite(c).all()
            fin = torch.isfinite(w)
            c, rr = c[fin], rr[fin]
        scale = max(1.0, rr.abs().max().item())
        assert torch.isfinite(c).all(), name
        assert (c.double() - rr).abs().max().item() / scale < 1e-4, f"{case} {name}"


# ------------------------------------------------------------------ causality and poison

@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e30])
@pytest.mark.parametrize("where", ["r", "k", "v", "a", "b"])
def test_later_poison_never_reaches_earlier_outputs(where, value):
    """A non-finite (or huge) input at token t leaves every output before t bitwise as it is without it (t = 70:
    after a checkpoint; 23: before one)."""
    T = 100
    x = dict(zip(NAMES, _inputs(2, T, 2, 8, 5, torch.float32, seed=8)))
    clean, _ = _op("cpu")(*x.values())
    for t in (23, 70):
        y = {n: z.clone() for n, z in x.items()}
        y[where][:, t] = value
        poisoned, _ = _op("cpu")(*y.values())
        assert torch.equal(poisoned[:, :t], clean[:, :t]), t
        if value != 1e30 and where != "r":
            assert not torch.isfinite(poisoned[0, t:]).all()  # ... and not hidden from the outputs that see it
        if where == "r":  # the read touches its own output only
            assert torch.equal(poisoned[:, t + 1:], clean[:, t + 1:])


@pytest.mark.parametrize("where", ["v", "k"])
def test_poisoned_input_keeps_earlier_gradients_finite(where):
    """As tests/test_poison_causality.py asks of the other ops: a NaN value (or key) at t, a loss on the outputs
    before t: every input's gradient before t stays finite, as in the fp64 loop (t after a checkpoint: the backward
    recomputes the poisoned stretch). A NaN in r, a or b at t reaches the earlier gradients in the fp64 loop's own
    autograd too (0 * NaN in dL/dS_{t-1}), so it is not asked of the kernel."""
    T, t = 100, 70
    x = _inputs(1, T, 2, 8, 5, torch.float32, seed=9)
    i = NAMES.index(where)
    x[i] = x[i].clone()
    x[i][:, t] = float("nan")
    leaves = [z.clone().requires_grad_() for z in x]
    o, _ = _op("cpu")(*leaves)
    o[:, :t].sum().backward()
    assert all(torch.isfinite(leaf.grad[:, :t]).all() for leaf in leaves[:6])
    assert torch.isfinite(leaves[6].grad).all()


def test_prefix_is_bitwise():
    """A prefix x[:, :t] gives the bits of the full run's first t outputs (and its state after t tokens equals a
    run's final state to the bit)."""
    x = _inputs(2, 77, 2, 8, 5, torch.float32, seed=10)
    full, _ = _op("cpu")(*x)
    for t in (1, 16, 64, 65):
        part, S_t = _op("cpu")(*(z[:, :t].contiguous() for z in x[:6]), x[6])
        assert torch.equal(part, full[:, :t]), t
        _, S_again = _op("cpu")(*(z[:, :t].contiguous() for z in x[:6]), x[6])
        assert torch.equal(S_t, S_again)


def test_modes_chunk_sizes_and_threads_give_the_same_bits():
    """The compiled scan is one exact recurrence: every mode, chunk size and thread count gives the same bits
    (each (sequence, head) runs on one thread, in token order)."""
    x = _inputs(2, 50, 3, 8, 5, torch.float32, seed=11)
    r, w, k, v, a, b, S0 = x
    outs = [linattn.rwkv7(r, w, k, v, a, b, initial_state=S0, mode=m, chunk_size=c, backend="cpu",
                          output_final_state=True) for m, c in [("chunk", 16), ("chunk", 64), ("recurrent", 64),
                                                                ("parallel", 64)]]
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs.append(linattn.rwkv7(r, w, k, v, a, b, initial_state=S0, backend="cpu", output_final_state=True))
    finally:
        torch.set_num_threads(n)
    for o, S in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(S, outs[0][1])


# ------------------------------------------------------------------ dispatch and the custom ops

def test_auto_takes_the_kernel_and_the_switch_falls_back(monkeypatch):
    r, w, k, v, a, b, S0 = _inputs(1, 20, 2, 8, 4, torch.float32, seed=12)
    p = prepare_rwkv7(r, w, k, v, a, b)
    assert p.cpu_unsupported() is None
    assert linattn.explain("rwkv7", r, w, k, v, a, b).backend == "cpu"
    assert linattn.chunk_size_used("rwkv7", r, w, k, v, a, b) == 1
    assert linattn.chunk_size_used("rwkv7", r, w, k, v, a, b, backend="torch") == 16   # 8 tokens, 16 sub-steps
    assert torch.equal(linattn.rwkv7(r, w, k, v, a, b)[0], linattn.rwkv7(r, w, k, v, a, b, backend="cpu")[0])
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    assert linattn.explain("rwkv7", r, w, k, v, a, b).backend == "torch"
    _close(linattn.rwkv7(r, w, k, v, a, b)[0], rwkv7_ref(*(t.double() for t in (r, w, k, v, a, b)))[0], 2e-5,
           "the fallback with the kernels off")
    from linattn.ops.backend import BackendUnavailableError
    with pytest.raises(BackendUnavailableError, match="LINATTN_CPU_KERNELS=0"):
        linattn.rwkv7(r, w, k, v, a, b, backend="cpu")


def test_empty_dimensions_take_the_fallback():
    """B = 0, H = 0 or V = 0: nothing to scan; the PyTorch path returns empty outputs of the right shape."""
    for shape, V in (((0, 5, 2, 4), 3), ((1, 5, 0, 4), 3), ((1, 5, 2, 4), 0)):
        r = torch.randn(shape)
        v = torch.randn(*shape[:3], V)
        p = prepare_rwkv7(r, -torch.rand(shape), r, v, r, r)
        assert "empty" in p.cpu_unsupported()
        o, S = linattn.rwkv7(r, -torch.rand(shape), r, v, r, r, output_final_state=True)
        assert o.shape == (*shape[:3], V) and S.shape == (shape[0], shape[2], shape[3], V)


def test_custom_op_registrations():
    """torch.library.opcheck: schema, fake (meta) kernel, autograd registration, as torch.compile needs them."""
    from linattn.cpu import checkpoint_offsets
    from linattn.cpu.rwkv7 import CHECKPOINT, rwkv7_fwd
    TT, H, K, V = 70, 2, 4, 3
    starts = [0, 30, 70]
    offs, n = checkpoint_offsets(starts, CHECKPOINT)
    r, w, k, v, a, b, _ = (t[0] for t in _inputs(1, TT, H, K, V, torch.float32, seed=13))
    args = (*(t.clone().requires_grad_() for t in (r, w, k, v, a, b)), torch.randn(2, H, K, V, requires_grad=True),
            torch.tensor(starts), torch.tensor(offs), n, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(rwkv7_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                           "test_autograd_registration"))


def test_layer_runs_the_kernel_and_matches_the_fallback(monkeypatch):
    """The RWKV-7 layer (layers/rwkv7.py) on CPU goes through the compiled scan: forward and parameter gradients as
    with the kernels switched off."""
    from linattn.layers.rwkv7 import RWKV7
    torch.manual_seed(0)
    layer = RWKV7(32, 2).double()
    x = torch.randn(2, 70, 32, dtype=torch.float64)
    y = layer(x)
    y = y[0] if isinstance(y, tuple) else y
    grads = torch.autograd.grad(y.square().sum(), list(layer.parameters()))
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    y2 = layer(x)
    y2 = y2[0] if isinstance(y2, tuple) else y2
    grads2 = torch.autograd.grad(y2.square().sum(), list(layer.parameters()))
    _close(y, y2, 1e-11, "layer output")
    for g1, g2 in zip(grads, grads2):
        _close(g1, g2, 1e-10, "layer parameter gradient")
