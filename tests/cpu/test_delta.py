"""The compiled CPU kernels of the delta family (issue 34; linattn/cpu/delta.py, csrc/delta.c): DeltaNet, Gated
DeltaNet, EFLA, Kimi Delta Attention and DeltaProduct on backend="cpu" against the PyTorch forms and the fp64
references (outputs, final states, every gradient), stretches across the backward's checkpoints, T = 1, packed
sequences, initial states, extreme gates, half inputs, poison and prefix causality, the dispatch rules and the
custom ops' registrations. Skips with a reason when there is no C compiler (CI has gcc)."""
from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

from linattn import delta_rule
from linattn.cpu import build as cbuild
from linattn.ops import backend as B
from linattn.ops.comba import comba
from linattn.ops.delta_core import prepare_delta
from linattn.ops.delta_product import delta_product
from linattn.ops.reference import delta_product_ref, delta_rule_ref

HAVE_CC = shutil.which(os.environ.get("CC", "").strip() or "cc") is not None
pytestmark = [pytest.mark.skipif(not HAVE_CC, reason="no C compiler (cc / $CC): the compiled CPU kernels cannot "
                                 "build"), pytest.mark.usefixtures("one_thread_module")]

TOL = {torch.float32: 2e-5, torch.float64: 1e-11}
VARIANTS = ["deltanet", "gated-deltanet", "efla", "efla-gated", "kda"]


@pytest.fixture(scope="module", autouse=True)
def _kernels_on():
    """The kernels switched on and built once for the module (seconds, then the cache)."""
    if not cbuild.enabled():
        pytest.skip("LINATTN_CPU_KERNELS=0")
    from linattn.cpu.delta import available
    assert available(), "csrc/delta.c did not build although a compiler exists"


def _inputs(variant, Bsz, T, H, K, V, dtype, seed=0, N=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(Bsz, T, H, K, generator=g, dtype=dtype)
    k = F.normalize(torch.randn(Bsz, T, H, K, generator=g, dtype=dtype), dim=-1)
    k = k * torch.empty(Bsz, T, H, 1, dtype=dtype).uniform_(0.2, 1.4, generator=g)
    v = torch.randn(Bsz, T, H, V, generator=g, dtype=dtype)
    beta = torch.rand(Bsz, T, H, generator=g, dtype=dtype)
    gate = None
    if variant in ("gated-deltanet", "efla-gated"):
        gate = -0.5 * torch.rand(Bsz, T, H, generator=g, dtype=dtype)
    elif variant == "kda":
        gate = -0.5 * torch.rand(Bsz, T, H, K, generator=g, dtype=dtype)
    S0 = torch.randn(Bsz if N is None else N, H, K, V, generator=g, dtype=dtype)
    return q, k, v, beta, gate, S0


def _grads(fn, tensors, wo, wS):
    """(o, S, gradients of every non-None input) for the loss sum(o * wo) + sum(S * wS) in fp64."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in tensors]
    o, S = fn(*leaves)
    loss = (o.double() * wo).sum() + (S.double() * wS).sum()
    return o, S, torch.autograd.grad(loss, [x for x in leaves if x is not None])


def _op(variant, backend, cu_seqlens=None, mode="chunk"):
    exact = variant.startswith("efla")

    def run(q, k, v, beta, g, S0):
        return delta_rule(q, k, v, beta, g=g, exact=exact, initial_state=S0, output_final_state=True, mode=mode,
                          chunk_size=16, cu_seqlens=cu_seqlens, backend=backend)
    return run


def _ref(variant, offsets=None):
    exact = variant.startswith("efla")

    def run(q, k, v, beta, g, S0):
        if offsets is None:
            return delta_rule_ref(q, k, v, beta, g=g, exact=exact, S0=S0)
        outs, states = [], []
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            o, S = delta_rule_ref(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], beta[:, lo:hi],
                                  g=g[:, lo:hi] if g is not None else None, exact=exact, S0=S0[i:i + 1])
            outs.append(o), states.append(S)
        return torch.cat(outs, 1), torch.cat(states)
    return run


def _close(a, b, tol, what):
    err = (a.double() - b.double()).abs().max().item() / max(1.0, b.double().abs().max().item())
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


# ------------------------------------------------------------------ outputs, states and gradients

@pytest.mark.parametrize("T", [1, 45, 130])  # 130: three stretches between the backward's checkpoints (64)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cpu_matches_reference_and_torch(variant, dtype, T):
    Bsz, H, K, V = 2, 2, 8, 5
    x = _inputs(variant, Bsz, T, H, K, V, dtype)
    g = torch.Generator().manual_seed(1)
    wo = torch.randn(Bsz, T, H, V, generator=g, dtype=torch.float64)
    wS = torch.randn(Bsz, H, K, V, generator=g, dtype=torch.float64)
    co, cS, cg = _grads(_op(variant, "cpu"), x, wo, wS)
    ro, rS, rg = _grads(_ref(variant), x, wo, wS)
    to, tS, tg = _grads(_op(variant, "torch"), x, wo, wS)
    assert co.dtype == dtype and cS.dtype == dtype
    names = ["q", "k", "v", "beta"] + (["g"] if x[4] is not None else []) + ["initial_state"]
    for name, a, r, t in zip(["o", "S"] + [f"d{n}" for n in names], [co, cS, *cg], [ro, rS, *rg], [to, tS, *tg]):
        _close(a, r, TOL[dtype], f"{variant} {name} vs the fp64 reference")
        _close(a, t, TOL[dtype], f"{variant} {name} vs the PyTorch chunk form")


def test_delta_product_on_cpu_matches_reference():
    """DeltaProduct interleaves n sub-steps per token into the same scan (per-head gate on the first)."""
    Bsz, T, H, K, V, n = 1, 23, 2, 6, 4, 2
    g = torch.Generator().manual_seed(2)
    q = torch.randn(Bsz, T, H, K, generator=g)
    k = F.normalize(torch.randn(Bsz, T, H, n, K, generator=g), dim=-1)
    v = torch.randn(Bsz, T, H, n, V, generator=g)
    beta = 2 * torch.rand(Bsz, T, H, n, generator=g)
    gate = -torch.rand(Bsz, T, H, generator=g)
    S0 = torch.randn(Bsz, H, K, V, generator=g)
    wo, wS = torch.randn(Bsz, T, H, V, dtype=torch.float64), torch.randn(Bsz, H, K, V, dtype=torch.float64)

    def op(backend):
        return lambda q, k, v, b, gt, s: delta_product(q, k, v, b, g=gt, initial_state=s, output_final_state=True,
                                                       backend=backend)
    co, cS, cg = _grads(op("cpu"), (q, k, v, beta, gate, S0), wo, wS)
    ro, rS, rg = _grads(lambda q, k, v, b, gt, s: delta_product_ref(q, k, v, b, g=gt, S0=s),
                        (q, k, v, beta, gate, S0), wo, wS)
    for name, a, r in zip(["o", "S", "dq", "dk", "dv", "dbeta", "dg", "dS0"], [co, cS, *cg], [ro, rS, *rg]):
        _close(a, r, 5e-5, f"delta_product {name}")


@pytest.mark.parametrize("variant", ["gated-deltanet", "kda"])
def test_packed_sequences_with_initial_states(variant):
    """cu_seqlens with uneven lengths (one of 1 token, one across a checkpoint) and a state per sequence."""
    offsets = [0, 1, 9, 79, 100]
    T, H, K, V = offsets[-1], 2, 8, 6
    x = _inputs(variant, 1, T, H, K, V, torch.float32, N=len(offsets) - 1)
    cu = torch.tensor(offsets, dtype=torch.int64)
    wo = torch.randn(1, T, H, V, dtype=torch.float64)
    wS = torch.randn(len(offsets) - 1, H, K, V, dtype=torch.float64)
    co, cS, cg = _grads(_op(variant, "cpu", cu), x, wo, wS)
    ro, rS, rg = _grads(_ref(variant, offsets), x, wo, wS)
    for name, a, r in zip(["o", "S", "dq", "dk", "dv", "dbeta", "dg", "dS0"], [co, cS, *cg], [ro, rS, *rg]):
        _close(a, r, TOL[torch.float32], f"packed {variant} {name}")
    # each packed sequence gives the bits of its own call
    for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        xi = [t[:, lo:hi] for t in x[:5]] + [x[5][i:i + 1]]
        oi, Si = _op(variant, "cpu")(*xi)
        assert torch.equal(oi, co[:, lo:hi]) and torch.equal(Si, cS[i:i + 1])


def test_final_state_gradient_alone_and_states_carry():
    """A loss on the final state only (no output gradient), and a state carried across two calls."""
    q, k, v, beta, gate, S0 = _inputs("gated-deltanet", 1, 70, 2, 8, 6, torch.float32)
    leaves = [t.clone().requires_grad_() for t in (k, v, beta, gate)]
    _, S = delta_rule(q, *leaves[:3], g=leaves[3], output_final_state=True, backend="cpu")
    S.sum().backward()
    ref = [t.clone().requires_grad_() for t in (k, v, beta, gate)]
    _, rS = delta_rule_ref(q, *ref[:3], g=ref[3])
    rS.sum().backward()
    for a, r in zip(leaves, ref):
        _close(a.grad, r.grad, TOL[torch.float32], "final-state gradient")
    o1, S1 = delta_rule(q[:, :33], k[:, :33], v[:, :33], beta[:, :33], g=gate[:, :33], output_final_state=True,
                        backend="cpu")
    o2, S2 = delta_rule(q[:, 33:], k[:, 33:], v[:, 33:], beta[:, 33:], g=gate[:, 33:], initial_state=S1,
                        output_final_state=True, backend="cpu")
    o, S = delta_rule(q, k, v, beta, g=gate, output_final_state=True, backend="cpu")
    assert torch.equal(torch.cat([o1, o2], 1), o) and torch.equal(S2, S)  # one scan: the same bits


@pytest.mark.parametrize("gate_value", [0.0, -1e-6, -30.0, -200.0])
def test_extreme_gates(gate_value):
    """No decay, almost none, a decay that underflows to 0 in fp32 (exp(-200)): as the reference."""
    q, k, v, beta, _, S0 = _inputs("gated-deltanet", 1, 40, 2, 8, 5, torch.float32)
    gate = torch.full((1, 40, 2), gate_value)
    wo, wS = torch.randn(1, 40, 2, 5, dtype=torch.float64), torch.randn(1, 2, 8, 5, dtype=torch.float64)
    co, cS, cg = _grads(_op("gated-deltanet", "cpu"), (q, k, v, beta, gate, S0), wo, wS)
    ro, rS, rg = _grads(_ref("gated-deltanet"), (q, k, v, beta, gate, S0), wo, wS)
    for name, a, r in zip(["o", "S", "dq", "dk", "dv", "dbeta", "dg", "dS0"], [co, cS, *cg], [ro, rS, *rg]):
        assert torch.isfinite(a).all(), name
        _close(a, r, TOL[torch.float32], f"g = {gate_value}: {name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_compute_in_fp32(dtype):
    q, k, v, beta, gate, S0 = (t.to(dtype) for t in _inputs("gated-deltanet", 1, 30, 2, 8, 4, torch.float32))
    o, S = delta_rule(q, k, v, beta, g=gate, initial_state=S0.float(), output_final_state=True, backend="cpu")
    to, tS = delta_rule(q, k, v, beta, g=gate, initial_state=S0.float(), output_final_state=True, backend="torch")
    assert o.dtype == dtype and S.dtype == torch.float32
    _close(S, tS, 1e-5, "fp32 state from half inputs")
    _close(o.float(), to.float(), 1e-2, "half output")


def test_modes_and_thread_counts_give_the_same_bits():
    """The compiled scan is one exact recurrence: every mode, chunk size and thread count gives the same bits
    (each (sequence, head) runs on one thread, in token order)."""
    q, k, v, beta, gate, S0 = _inputs("kda", 2, 50, 3, 8, 5, torch.float32)
    outs = [delta_rule(q, k, v, beta, g=gate, initial_state=S0, mode=m, chunk_size=c, backend="cpu",
                       output_final_state=True) for m, c in [("chunk", 16), ("chunk", 64), ("recurrent", 64),
                                                             ("parallel", 64)]]
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs.append(delta_rule(q, k, v, beta, g=gate, initial_state=S0, backend="cpu", output_final_state=True))
    finally:
        torch.set_num_threads(n)
    for o, S in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(S, outs[0][1])
    p = prepare_delta(q, k, v, beta, g=gate, channel_gate=True, mode="chunk", chunk_size=16)
    assert p.chunk_size_used("cpu") == 1 and p.chunk_size_used("torch") == 16


def test_empty_batch():
    q = torch.randn(0, 5, 2, 4)
    o, S = delta_rule(q, q, torch.randn(0, 5, 2, 3), torch.rand(0, 5, 2), output_final_state=True, backend="cpu")
    assert o.shape == (0, 5, 2, 3) and S.shape == (0, 2, 4, 3)


# ------------------------------------------------------------------ causality and poison

@pytest.mark.parametrize("value", [float("inf"), float("nan"), 1e30])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("variant", ["deltanet", "gated-deltanet", "efla", "kda"])
def test_later_poison_never_reaches_earlier_outputs(variant, where, value):
    T, t = 40, 23
    q, k, v, beta, gate, _ = _inputs(variant, 2, T, 2, 8, 5, torch.float32)
    run = _op(variant, "cpu")
    clean, _ = run(q, k, v, beta, gate, None)
    x = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
    x[where][:, t] = value
    poisoned, _ = run(x["q"], x["k"], x["v"], beta, gate, None)
    assert torch.equal(poisoned[:, :t], clean[:, :t])
    if value != 1e30:
        assert not torch.isfinite(poisoned[0, t:]).all()  # ... and not hidden from the outputs that see it


@pytest.mark.parametrize("variant", ["deltanet", "gated-deltanet", "efla", "kda"])
def test_poisoned_value_keeps_earlier_gradients_finite(variant):
    """As the PyTorch forms (tests/test_poison_causality.py): a NaN value at t, a loss on the outputs before t."""
    T, t = 100, 70  # t after a checkpoint: the backward recomputes the poisoned stretch
    q, k, v, beta, gate, _ = _inputs(variant, 1, T, 2, 8, 5, torch.float32)
    v = v.clone()
    v[:, t] = float("nan")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o, _ = _op(variant, "cpu")(*leaves, beta, gate, None)
    o[:, :t].sum().backward()
    assert all(torch.isfinite(leaf.grad[:, :t]).all() for leaf in leaves)


@pytest.mark.parametrize("variant", ["deltanet", "gated-deltanet", "efla", "kda"])
def test_prefix_is_bitwise(variant):
    q, k, v, beta, gate, S0 = _inputs(variant, 2, 77, 2, 8, 5, torch.float32)
    full, _ = _op(variant, "cpu")(q, k, v, beta, gate, S0)
    for t in (1, 16, 64, 65):
        part, _ = _op(variant, "cpu")(*(x[:, :t].contiguous() for x in (q, k, v, beta)),
                                     gate[:, :t].contiguous() if gate is not None else None, S0)
        assert torch.equal(part, full[:, :t]), t


# ------------------------------------------------------------------ dispatch and the custom ops

def test_auto_takes_the_kernels_and_comba_falls_back(monkeypatch):
    q, k, v, beta, gate, _ = _inputs("gated-deltanet", 1, 20, 2, 8, 4, torch.float32)
    p = prepare_delta(q, k, v, beta, g=gate)
    assert p.cpu_unsupported() is None and B.select_backend("auto", p) == "cpu"
    assert torch.equal(delta_rule(q, k, v, beta, g=gate)[0], delta_rule(q, k, v, beta, g=gate, backend="cpu")[0])
    pc = prepare_delta(q, k, v, beta, g=gate, r=k)
    assert "read key" in pc.cpu_unsupported() and B.select_backend("auto", pc) == "torch"
    B._WARNED.discard(("cpu", pc.cpu_unsupported()))
    with pytest.warns(UserWarning, match="backend='cpu': a read key of its own .* falling back"):
        o = comba(q, k, v, beta, g=gate, backend="cpu")[0]
    assert torch.equal(o, comba(q, k, v, beta, g=gate, backend="torch")[0])
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    assert B.select_backend("auto", p) == "torch"
    with pytest.raises(B.BackendUnavailableError, match="LINATTN_CPU_KERNELS=0"):
        delta_rule(q, k, v, beta, g=gate, backend="cpu")


@pytest.mark.parametrize("gate", ["none", "head", "channel"])
def test_custom_op_registrations(gate):
    """torch.library.opcheck: schema, fake (meta) kernel, autograd registration, as torch.compile needs them."""
    from linattn.cpu import checkpoint_offsets
    from linattn.cpu.delta import CHECKPOINT, delta_fwd
    TT, H, K, V = 70, 2, 4, 3
    starts = [0, 30, 70]
    offs, n = checkpoint_offsets(starts, CHECKPOINT)
    g = {"none": None, "head": -torch.rand(TT, H), "channel": -torch.rand(TT, H, K)}[gate]
    args = (torch.randn(TT, H, K, requires_grad=True), F.normalize(torch.randn(TT, H, K), dim=-1).requires_grad_(),
            torch.randn(TT, H, V, requires_grad=True), torch.rand(TT, H, requires_grad=True),
            g.requires_grad_() if g is not None else None, torch.randn(2, H, K, V, requires_grad=True),
            torch.tensor(starts), torch.tensor(offs), n)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(delta_fwd, args, test_utils=("test_schema", "test_faketensor",
                                                           "test_autograd_registration"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("K,V", [(3, 70), (33, 129)])
def test_value_widths_across_column_blocks(K, V, dtype):
    """V over one or more of the kernel's column blocks (64 floats / 32 doubles with AVX-512, half without)
    plus a narrower tail, and odd K: outputs, states and gradients as the fp64 reference."""
    x = _inputs("gated-deltanet", 1, 20, 2, K, V, dtype)
    wo, wS = torch.randn(1, 20, 2, V, dtype=torch.float64), torch.randn(1, 2, K, V, dtype=torch.float64)
    co, cS, cg = _grads(_op("gated-deltanet", "cpu"), x, wo, wS)
    ro, rS, rg = _grads(_ref("gated-deltanet"), x, wo, wS)
    for name, a, r in zip(["o", "S", "dq", "dk", "dv", "dbeta", "dg", "dS0"], [co, cS, *cg], [ro, rS, *rg]):
        _close(a, r, TOL[dtype], f"K={K} V={V} {name}")


def test_grouped_value_heads():
    """HV = 2 H value heads (value head j reads q/k head j // 2): on the kernels, as the reference on q and k
    repeated to the value heads (gradients of q and k summed over each group)."""
    Bsz, T, H, K, V = 1, 30, 2, 8, 5
    g0 = torch.Generator().manual_seed(3)
    q, k = torch.randn(Bsz, T, H, K, generator=g0), F.normalize(torch.randn(Bsz, T, H, K, generator=g0), dim=-1)
    v, beta = torch.randn(Bsz, T, 2 * H, V, generator=g0), torch.rand(Bsz, T, 2 * H, generator=g0)
    gate, S0 = -torch.rand(Bsz, T, 2 * H, generator=g0), torch.randn(Bsz, 2 * H, K, V, generator=g0)
    wo, wS = torch.randn(Bsz, T, 2 * H, V, dtype=torch.float64), torch.randn(Bsz, 2 * H, K, V, dtype=torch.float64)
    p = prepare_delta(q, k, v, beta, g=gate)
    assert p.cpu_unsupported() is None and B.select_backend("auto", p) == "cpu"
    co, cS, cg = _grads(_op("gated-deltanet", "cpu"), (q, k, v, beta, gate, S0), wo, wS)

    def ref(q, k, v, b, g, s):
        return delta_rule_ref(q.repeat_interleave(2, dim=2), k.repeat_interleave(2, dim=2), v, b, g=g, S0=s)
    ro, rS, rg = _grads(ref, (q, k, v, beta, gate, S0), wo, wS)
    for name, a, r in zip(["o", "S", "dq", "dk", "dv", "dbeta", "dg", "dS0"], [co, cS, *cg], [ro, rS, *rg]):
        _close(a, r, TOL[torch.float32], f"grouped heads {name}")
