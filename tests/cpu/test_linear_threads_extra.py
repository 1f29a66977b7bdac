"""linear.c's chains (few (sequence, head) units per thread) without shared cache lines between their threads: the
normalisers written head-major and copied into den [TT, H] after the threads (lin_den_rows), the carried states and
state gradients in whole cache lines per unit (lin_lines). The kernel ops' own outputs (den, chunk states, final
states, dS0) at 1, 2 and 3 threads: the same bits, and den, num and the final states against a float64 reference.
Awkward shapes: an empty sequence, a tail chunk, K * (V + 1) not a whole number of cache lines, a gate, an initial
state. Skips without a C compiler."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from linattn.cpu import build as cbuild

HAVE_CC = shutil.which(os.environ.get("CC", "").strip() or "cc") is not None
pytestmark = pytest.mark.skipif(not HAVE_CC or not cbuild.enabled(),
                                reason="no C compiler (cc / $CC) or LINATTN_CPU_KERNELS=0")

CHUNK = 64
# chains need fewer than 4 (sequence, head) units per thread (linear.c's LIN_UNITS_PER_THREAD): one sequence of 1100
# rows and 4 heads (the bench's B = 1, H = 4: pairs of heads at 2 threads, single heads at 3), or an empty sequence
# and one of 1900 rows with 3 heads (a group of 3 at 2 threads); several runs of 8 chunks and a tail chunk
CASES = {"B1H4": ([0, 1100], 4, 16, 8), "empty,H3": ([0, 0, 1900], 3, 5, 3)}  # K (V + 1) = 20: not whole lines


@pytest.fixture(autouse=True)
def _every_call_threaded(monkeypatch):
    """Small calls: without this the kernels would get one thread (cpu.threads' grain)."""
    from linattn.cpu import linear as clinear

    monkeypatch.setattr(clinear, "GRAIN", 1.0)


def _inputs(starts, H, K, V, dtype, gate, seed=0):
    gen = torch.Generator().manual_seed(seed)
    TT, N = starts[-1], len(starts) - 1
    x = {"q": torch.randn(TT, H, K, generator=gen, dtype=torch.float64),
         "k": torch.randn(TT, H, K, generator=gen, dtype=torch.float64),
         "v": torch.randn(TT, H, V, generator=gen, dtype=torch.float64),
         "g": -0.05 * torch.rand(TT, H, generator=gen, dtype=torch.float64) if gate else None,
         "S0": torch.rand(N, H, K, V + 1, generator=gen, dtype=torch.float64),
         "dnum": torch.randn(TT, H, V, generator=gen, dtype=torch.float64),
         "dden": torch.randn(TT, H, generator=gen, dtype=torch.float64),
         "dS": torch.randn(N, H, K, V + 1, generator=gen, dtype=torch.float64)}
    x = {n: (t.to(dtype) if t is not None else None) for n, t in x.items()}
    x["starts"] = starts
    return x


def _kernels(x, threads):
    """The forward (num undivided, den, final states, chunk states) and the backward at `threads` threads."""
    from linattn.cpu import linear as clinear

    n0 = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fmap = clinear.FMAPS["elu+1"]
        num, den, S, P, _ = torch.ops.linattn.cpu_linear_chunk_fwd(x["q"], x["k"], x["v"], x["g"], x["S0"], x["starts"],
                                                                     CHUNK, True, fmap, 1.0, True, -1.0)
        grads = torch.ops.linattn.cpu_linear_chunk_bwd(x["q"], x["k"], x["v"], x["g"], P, x["dnum"], x["dden"],
                                                       x["dS"], x["starts"], CHUNK, True, fmap, 1.0)
    finally:
        torch.set_num_threads(n0)
    return (num, den, S, P) + tuple(grads)


def _reference(x):
    """num, den and the final states [N, H, K, V + 1] in float64, token by token."""
    phi = {n: F.elu(x[n].double()) + 1 for n in ("q", "k")}
    v, g = x["v"].double(), x["g"]
    TT, H, K = phi["q"].shape
    num, den = torch.zeros(TT, H, v.shape[-1], dtype=torch.float64), torch.zeros(TT, H, dtype=torch.float64)
    finals = []
    starts = x["starts"]
    for s in range(len(starts) - 1):
        S = x["S0"][s].double().clone()
        for t in range(starts[s], starts[s + 1]):
            if g is not None:
                S = S * torch.exp(g[t].double())[:, None, None]
            S = S + phi["k"][t][:, :, None] * torch.cat([v[t], torch.ones(H, 1, dtype=torch.float64)], -1)[:, None]
            o = torch.einsum("hk,hkw->hw", phi["q"][t], S)
            num[t], den[t] = o[:, :-1], o[:, -1]
        finals.append(S)
    return num, den, torch.stack(finals)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_chains_outputs_same_bits_at_every_thread_count(case, gate, dtype):
    x = _inputs(*CASES[case], dtype, gate)
    one = _kernels(x, 1)
    for threads in (2, 3):
        many = _kernels(x, threads)
        for name, a, b in zip(("num", "den", "S", "P", "dq", "dk", "dv", "dg", "dS0"), one, many, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"{name} at {threads} threads"
    num, den, S = _reference(x)
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-4)
    for name, got, want in (("num", one[0], num), ("den", one[1], den), ("S", one[2], S)):
        torch.testing.assert_close(got.double(), want, **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_den_rows_come_from_their_own_head_and_token():
    """A permuted copy of den (heads or tokens swapped) would still give finite values: den must follow each head's
    own keys. A head whose keys are scaled up has a larger den at every token, the others unchanged."""
    x = _inputs(*CASES["B1H4"], torch.float64, False)
    base = _kernels(x, 2)[1]
    x["k"] = x["k"].clone()
    x["k"][:, 2] += 3.0  # elu+1 of k grows: head 2's den grows, the others' do not change
    den = _kernels(x, 2)[1]
    assert torch.equal(den[:, [0, 1, 3]], base[:, [0, 1, 3]])
    assert bool((den[:, 2] > base[:, 2]).all())
