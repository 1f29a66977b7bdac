"""The serial part of a compiled call (issue 53, round 10 in docs/cpu_kernels.md): the torch operators cut from
around the Gated DeltaNet scan keep the bits they replace (the raw preparation writing a = beta max(|k|^2, 1)
itself), at every thread count; and `bench threads`' Amdahl bound of the serial part."""
import pytest
import torch

from linattn.bench.threads import amdahl_bound, summarise
from linattn.cpu import available

needs_kernels = pytest.mark.skipif(not available("deltaprep") or not available("delta"),
                                   reason="compiled CPU kernels unavailable")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _hostile_keys(k: torch.Tensor) -> torch.Tensor:
    """Rows of norm below 1, above 1, exactly 1 and 0; where K allows, one whose float |k|^2 overflows, one inf and
    one NaN (the raw pass's wide rows and NaN rule)."""
    k = k.clone()
    flat = k.view(-1, k.shape[-1])
    flat[0] *= 1e-3
    flat[1 % flat.shape[0]] *= 40.0
    flat[2 % flat.shape[0]] = 0.0
    if flat.shape[0] > 6:
        flat[3, 0] = 1.0
        flat[3, 1:] = 0.0
        flat[4, 0] = 1e20 if k.dtype == torch.float32 else 1e160
        flat[5, -1] = float("inf")
        flat[6, 0] = float("nan")
    return k


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 7, 3, 5, 3), (2, 33, 2, 64, 65), (1, 1, 1, 1, 1), (1, 700, 4, 16, 8)])
@pytest.mark.parametrize("nthreads", [1, 2, 3])
def test_raw_pass_with_a_has_the_bits_of_raw_then_write_strength(dtype, shape, nthreads):
    """delta_prepare_raw_a = delta_prepare_raw then write_strength, to the bit: outputs and the gradients of q, k,
    v, beta, at 1-3 threads (R = 2800 rows: the threads' blocks of 1,024 rows split it), hostile rows included."""
    from linattn.cpu.delta import delta_prepare_raw, delta_prepare_raw_a, write_strength

    B, T, H, K, V = shape
    gen = torch.Generator().manual_seed(B * 100 + T + K)
    q, v = torch.randn(B, T, H, K, generator=gen, dtype=dtype), torch.randn(B, T, H, V, generator=gen, dtype=dtype)
    k = _hostile_keys(torch.randn(B, T, H, K, generator=gen, dtype=dtype))
    beta = torch.rand(B, T, H, generator=gen, dtype=dtype)
    beta.view(-1)[0] = 0.0
    grads = [torch.randn(B, T, H, D, generator=gen, dtype=dtype) for D in (K, K, V)] + [
        torch.randn(B, T, H, generator=gen, dtype=dtype)]
    prev = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        xa = [t.clone().requires_grad_() for t in (q, k, v, beta)]
        xb = [t.clone().requires_grad_() for t in (q, k, v, beta)]
        got = delta_prepare_raw_a(*xa, 0.3)
        qo, ko, vo, lam = delta_prepare_raw(*xb[:3], 0.3)
        want = (qo, ko, vo, write_strength(xb[3], lam))
        torch.autograd.backward(got, grads)
        torch.autograd.backward(want, grads)
    finally:
        torch.set_num_threads(prev)
    for a, b in zip(got, want):
        assert _same(a.detach(), b.detach())
    for a, b in zip(xa, xb):
        assert _same(a.grad, b.grad)


@needs_kernels
@pytest.mark.parametrize("nthreads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_public_gated_deltanet_keeps_the_bits_of_the_torch_steps(nthreads, dtype, monkeypatch):
    """delta_rule on the compiled path (no qk_l2norm, a gate per head) runs no write_strength between the raw pass
    and the scan, and gives the bits of the composition it replaces (delta_prepare_raw, write_strength, the
    clamped gate, delta_scan): output, final state and every gradient."""
    from linattn import delta_rule
    from linattn.cpu import delta as cdelta

    B, T, H, K, V = 2, 150, 3, 16, 24
    gen = torch.Generator().manual_seed(11)
    q, k = torch.randn(B, T, H, K, generator=gen), _hostile_keys(torch.randn(B, T, H, K, generator=gen))
    k.view(-1, K)[4:7] = 2.0  # no inf / NaN here: the scan's outputs would all be NaN
    v, beta = torch.randn(B, T, H, V, generator=gen), torch.rand(B, T, H, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 3
    do, dS = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    xs = [t.to(dtype) for t in (q, k, v, beta, g)]
    prev = torch.get_num_threads()
    torch.set_num_threads(nthreads)
    try:
        calls = []
        monkeypatch.setattr(cdelta, "write_strength", lambda *a: calls.append(a))
        xa = [t.clone().requires_grad_() for t in xs]
        o, S = delta_rule(*xa[:4], g=xa[4], backend="cpu", output_final_state=True)
        torch.autograd.backward((o, S), (do.to(dtype), dS))
        monkeypatch.undo()
        assert calls == []
        xb = [t.clone().requires_grad_() for t in xs]
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        qc, kc, vc, bc, gc = (t.to(cdt) for t in xb)
        qo, ko, vo, lam = cdelta.delta_prepare_raw(qc, kc, vc, K ** -0.5)
        a = cdelta.write_strength(bc, lam)
        flat = [t.reshape(B * T, H, -1) for t in (qo, ko, vo)]
        ow, Sw = cdelta.delta_scan(*flat, a.reshape(B * T, H), gc.clamp_min(-1e4).reshape(B * T, H), None,
                                   [i * T for i in range(B + 1)])
        ow = ow.view(B, T, H, V).to(dtype)
        torch.autograd.backward((ow, Sw), (do.to(dtype), dS))
    finally:
        torch.set_num_threads(prev)
    assert _same(o.detach(), ow.detach()) and _same(S.detach(), Sw.detach())
    for a_, b_ in zip(xa, xb):
        assert _same(a_.grad, b_.grad)


@needs_kernels
def test_public_gated_deltanet_matches_the_fp64_reference():
    """The compiled path after the cuts against the PyTorch forms in fp64: output and gradients."""
    from linattn import delta_rule

    B, T, H, K, V = 1, 200, 2, 8, 12
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen),
          torch.randn(B, T, H, V, generator=gen), torch.rand(B, T, H, generator=gen),
          -torch.rand(B, T, H, generator=gen)]
    do = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    xa = [t.clone().requires_grad_() for t in xs]
    xr = [t.double().requires_grad_() for t in xs]
    o = delta_rule(*xa[:4], g=xa[4], backend="cpu")[0]
    r = delta_rule(*xr[:4], g=xr[4], backend="torch", mode="recurrent")[0]
    o.backward(do.float())
    r.backward(do)
    assert torch.allclose(o.double(), r, rtol=1e-4, atol=1e-5)
    for a, b in zip(xa, xr):
        assert torch.allclose(a.grad.double(), b.grad, rtol=1e-3, atol=1e-4), (a.grad.double() - b.grad).abs().max()


def test_amdahl_bound_of_the_serial_part():
    assert amdahl_bound(40.0, 0.0, 0.0, 2) == 2.0            # nothing serial: n
    assert amdahl_bound(40.0, 40.0, 40.0, 2) == 1.0          # all serial: 1
    assert amdahl_bound(40.0, 2.0, 2.0, 2) == pytest.approx(40.0 / 21.0)
    assert amdahl_bound(40.0, 2.0, 4.0, 4) == pytest.approx(40.0 / 13.5)  # a serial part that grows with n counts
    case = {"level": "op", "op": "linear", "pass": "fwd", "ms": {1: [40.0, 42.0], 2: [21.0, 22.0]},
            "calls": {n: [{"cpu_ms": 1.0, "wait_ms": 0.0, "kernel_ms": ms - 2.0, "faults": 0, "threads": n, "cpus": n}
                          for ms in ([40.0, 42.0] if n == 1 else [21.0, 22.0])] for n in (1, 2)}}
    rec = summarise([case], [1, 2])[0]
    assert rec["around_ms"] == {1: 2.0, 2: 2.0} and rec["bound"][2] == pytest.approx(41.0 / (2.0 + 39.0 / 2))


@needs_kernels
def test_bench_threads_prep_level(tmp_path, capsys):
    """`--levels prep`: Gated DeltaNet's preparation pass alone beside the public call, whose row has the bound."""
    import json

    from linattn.cli import main

    args = ["bench", "threads", "--quick", "--ops", "gated_deltanet,linear", "--levels", "op,prep", "--out",
            str(tmp_path), "--quiet"]
    assert main(args) == 0
    assert "bound" in capsys.readouterr().out
    recs = json.loads((tmp_path / "threads.json").read_text())["records"]
    assert {(r["level"], r["op"]) for r in recs} == {("op", "gated_deltanet"), ("op", "linear"),
                                                     ("prep", "gated_deltanet")}
    for r in recs:
        assert all(c["kernel_ms"] > 0 for n in ("1", "2") for c in r["calls"][n])
        if r["level"] == "op":
            assert r["bound"]["2"] == pytest.approx(amdahl_bound(r["median_ms"]["1"], r["around_ms"]["1"],
                                                                 r["around_ms"]["2"], 2))
    assert main(["bench", "threads", "--quick", "--ops", "linear", "--levels", "prep", "--out", str(tmp_path),
                 "--overwrite", "--quiet"]) == 2
