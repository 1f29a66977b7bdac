"""Issue 15: the fast chunk form of causal linear attention without a gate (ops/linear_chunk.py), its
hand-written backward and its blocked running sum, against the fp64 references and autograd."""
import pytest
import torch

import linattn
from linattn.ops import linear as L
from linattn.ops.linear_chunk import SCAN_BLOCK, LinearChunk, _scan, linear_chunk
from linattn.ops.reference import linear_attention_ref

pytestmark = pytest.mark.usefixtures("one_thread_module")

B, H, K, V, C = 2, 2, 8, 5, 16


def _qkv(T, dtype, seed=0, B=B):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, T, H, d, generator=g, dtype=torch.float64).to(dtype) for d in (K, K, V))


@pytest.mark.parametrize("fused", [None, "identity", "relu", "elu+1"])
@pytest.mark.parametrize("T", [1, 21, 40])
def test_gradcheck_fp64(fused, T):
    q, k, v = (x.requires_grad_() for x in _qkv(T, torch.float64))
    if fused is None:  # features given: keep them positive, as a map's would be
        q, k = (x.detach().exp().requires_grad_() for x in (q, k))
    if fused == "relu":  # away from relu's kink
        q, k = (torch.where(x.abs() < 0.05, x + 0.1, x).detach().requires_grad_() for x in (q, k))
    S0 = torch.randn(B, H, K, V + 1, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, S0):
        return LinearChunk.apply(q, k, v, S0, C, fused)

    # fast_mode: one random projection u^T J v of the Jacobian, numerical against analytical, instead of all of J
    # (a wrong gradient term still moves it; the full Jacobians of T = 40 cost ~1,800 forward passes each case)
    assert torch.autograd.gradcheck(f, (q, k, v, S0), fast_mode=True)


def test_gradcheck_fp64_many_chunks_and_unused_outputs():
    """More chunks than one scan block, and gradients through only one of the two outputs."""
    T = (SCAN_BLOCK + 3) * 4 - 1
    q, k, v = (x.requires_grad_() for x in _qkv(T, torch.float64, B=1))
    S0 = torch.randn(1, H, K, V + 1, dtype=torch.float64, requires_grad=True)
    for i in range(3):
        assert torch.autograd.gradcheck(lambda *a: LinearChunk.apply(*a, 4, "elu+1")[i], (q, k, v, S0), fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 5, 16, 40, 16 * (SCAN_BLOCK + 2) + 3])
@pytest.mark.parametrize("fm", ["elu+1", "relu", "identity", "taylor2"])
def test_matches_reference(fm, T, dtype):
    """Outputs, final state and gradients of the fast form against the fp64 quadratic reference and the
    recurrent form (which gives the state's reference)."""
    q, k, v = _qkv(T, dtype, seed=1)
    if fm == "identity":
        q, k = q.abs(), k.abs()  # a denominator far from 0
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    p = linattn.prepare_linear_attention(q, k, v, feature_map=fm, chunk_size=C)
    assert L._fast_chunk(p)
    o, st = linattn.linear_attention(q, k, v, feature_map=fm, chunk_size=C, output_final_state=True, scale=0.7)
    ref = linear_attention_ref(q.detach(), k.detach(), v.detach(), fm, scale=0.7)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(o.double(), ref, **tol)
    w = torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    g = torch.autograd.grad((o.double() * w).sum() + st.kv.double().sum() + st.z.double().sum(), (q, k, v))
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    o_r, st_r = linattn.linear_attention(qd, kd, vd, feature_map=fm, mode="recurrent", output_final_state=True,
                                         scale=0.7)
    torch.testing.assert_close(o_r, ref, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(st.kv.double(), st_r.kv.detach(), **tol)
    torch.testing.assert_close(st.z.double(), st_r.z.detach(), **tol)
    g_r = torch.autograd.grad((o_r * w).sum() + st_r.kv.sum() + st_r.z.sum(), (qd, kd, vd))
    for a, b in zip(g, g_r):
        torch.testing.assert_close(a.double(), b, **tol)


def test_state_hand_off_and_initial_state_gradient():
    """chunk -> chunk through the state equals one call, and the initial state's gradient matches the
    recurrent form's."""
    q, k, v = _qkv(50, torch.float64, seed=3)
    o, _ = linattn.linear_attention(q, k, v, chunk_size=C)
    _, s = linattn.linear_attention(q[:, :23], k[:, :23], v[:, :23], chunk_size=C, output_final_state=True)
    o2, _ = linattn.linear_attention(q[:, 23:], k[:, 23:], v[:, 23:], chunk_size=C, initial_state=s)
    torch.testing.assert_close(o2, o[:, 23:], rtol=1e-10, atol=1e-12)
    kv, z = s.kv.clone().requires_grad_(), s.z.clone().requires_grad_()
    grads = []
    for mode in ("chunk", "recurrent"):
        st = linattn.LinearAttentionState(kv, z, None, s.offset)
        out = linattn.linear_attention(q[:, 23:], k[:, 23:], v[:, 23:], chunk_size=C, mode=mode, initial_state=st)[0]
        grads.append(torch.autograd.grad(out.sum(), (kv, z)))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_cu_seqlens_equals_separate_calls():
    q, k, v = _qkv(45, torch.float64, seed=4, B=1)
    cu = torch.tensor([0, 7, 30, 45])
    o, s = linattn.linear_attention(q, k, v, chunk_size=C, cu_seqlens=cu, output_final_state=True)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        oi, si = linattn.linear_attention(q[:, a:b], k[:, a:b], v[:, a:b], chunk_size=C, output_final_state=True)
        torch.testing.assert_close(o[:, a:b], oi, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(s.kv[i:i + 1], si.kv, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("n", [1, 5, SCAN_BLOCK, SCAN_BLOCK * 2 + 3])
def test_scan_is_a_running_sum(n, reverse):
    U = torch.randn(2, 3, n, 4, 5, dtype=torch.float64)
    S0 = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    P, total = _scan(U, S0, reverse=reverse)
    Uo = U.flip(2) if reverse else U
    incl = S0.unsqueeze(2) + Uo.cumsum(2)
    want = torch.cat([S0.unsqueeze(2), incl[:, :, :-1]], dim=2)
    torch.testing.assert_close(P, want.flip(2) if reverse else want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(total, incl[:, :, -1], rtol=1e-12, atol=1e-12)


def test_scan_prefix_is_bitwise():
    """The state before chunk c is formed by the same additions whatever the number of chunks after it."""
    U = torch.randn(1, 2, 3 * SCAN_BLOCK + 5, 8, 6)
    S0 = torch.randn(1, 2, 8, 6)
    full, _ = _scan(U, S0)
    for n in (1, 3, SCAN_BLOCK, SCAN_BLOCK + 1, 2 * SCAN_BLOCK + 7):
        P, total = _scan(U[:, :, :n].contiguous(), S0)
        assert torch.equal(P, full[:, :, :n])
        if n < U.shape[2]:
            assert torch.equal(total, full[:, :, n])


def test_poisoned_value_in_the_fast_form():
    """A NaN value at t: outputs before t bitwise unchanged, later ones not finite; the gradients of the
    earlier outputs stay finite (causal_matmul's guarantee, kept by the in-place product)."""
    q, k, v = _qkv(40, torch.float32, seed=5)
    clean = linear_chunk(q, k, v, torch.zeros(B, H, K, V + 1), C, "elu+1").num
    vp = v.clone()
    vp[0, 21, 1, 2] = float("nan")
    num = linear_chunk(q, k, vp, torch.zeros(B, H, K, V + 1), C, "elu+1").num
    assert torch.equal(num[:, :, :21], clean[:, :, :21])
    assert not torch.isfinite(num[0, 1, 21:]).all()
    q, k, vp = (x.requires_grad_() for x in (q, k, vp))
    o = linattn.linear_attention(q, k, vp, chunk_size=C)[0]
    o[:, :21].sum().backward()
    assert all(torch.isfinite(x.grad[:, :21]).all() for x in (q, k, vp))


def test_gated_and_compiled_calls_keep_the_autograd_form():
    q, k, v = _qkv(20, torch.float32)
    assert not L._fast_chunk(linattn.prepare_linear_attention(q, k, v, gamma=0.9))
    assert not L._fast_chunk(linattn.prepare_linear_attention(q, k, v, mode="recurrent"))
    assert not L._fast_chunk(linattn.prepare_linear_attention(q, k, v, feature_map="hadamard_exp"))
    assert L._fast_chunk(linattn.prepare_linear_attention(q, k, v, feature_map="cosformer"))


def test_bench_peer_rows(tmp_path):
    """`bench ops --families peer`: flash-linear-attention's pure-PyTorch chunk functions when they import,
    otherwise listed as skipped with the reason; never part of the default families."""
    import json

    from linattn import cli
    from linattn.bench import ops

    assert "peer" not in ops.DEFAULT_FAMILIES and "peer" in ops.FAMILIES
    if ops.peer_unavailable(64) is None:
        assert "T % 64" in ops.peer_unavailable(100)
    out = tmp_path / "b"
    assert cli.main(["bench", "ops", "--T", "64", "--H", "2", "--K", "16", "--V", "16", "--repeats", "1", "--warmup",
                     "0", "--min-time", "0", "--matmul-n", "64", "--families", "peer", "--passes", "fwd",
                     "--no-memory", "--quiet", "--out", str(out)]) == 0
    report = json.loads((out / "ops.json").read_text())
    rows = {r["op"]: r for r in report["results"]}
    skipped = {s["op"]: s["reason"] for s in report["skipped"]}
    for key in ("fla_linear", "fla_deltanet", ops.HF_GDN):
        why = ops.peer_unavailable(64, key)
        if why is None:
            assert rows[key]["ms"] > 0 and key not in skipped
        else:
            assert skipped[key] == why and key not in rows
    if "fla_linear" in rows:
        assert rows["fla_linear"]["chunk_size_used"] == 64


def test_bench_transformers_gdn_row_and_target(tmp_path):
    """The transformers peer row computes what linattn's Gated DeltaNet row computes (same inputs), and with
    --targets 34 the T = 2048 ratio target is derived from the two rows of the run (never hard-coded)."""
    import json

    import pytest
    import torch

    from linattn import cli
    from linattn.bench import ops

    if ops.peer_unavailable(64, ops.HF_GDN):
        pytest.skip("transformers is not installed")
    x = ops._make_inputs(ops.OP_BY_KEY[ops.HF_GDN], 1, 70, 2, 8, 8, torch.float64, "cpu", 0)
    _, hf, args, kw = ops._hf_gdn_call(x, "chunk", 64)
    _, mine, args2, kw2 = ops._delta_call(False)(x, "chunk", 16)
    ref = mine(*args2, **kw2)[0]
    torch.testing.assert_close(hf(*args, **kw), ref, rtol=0, atol=1e-5)   # transformers computes in fp32
    assert (hf(*args, **kw) - ref).abs().max() > 0   # really transformers' function, not ours
    out = tmp_path / "b"
    assert cli.main(["bench", "ops", "--T", str(ops.HF_GDN_T), "--H", "1", "--K", "8", "--V", "8", "--repeats", "1",
                     "--warmup", "0", "--min-time", "0", "--matmul-n", "64", "--families", "delta,peer", "--modes",
                     "chunk", "--passes", "fwd", "--backends", "torch", "--targets", "34", "--no-memory", "--quiet",
                     "--out", str(out)]) == 0
    report = json.loads((out / "ops.json").read_text())
    rows = {(r["op"], r.get("backend")): r for r in report["results"]}
    t = next(t for t in report["targets"] if "torch_chunk_gated_delta_rule" in t["target"])
    assert t["threshold"] == 3.0 and t["T"] == ops.HF_GDN_T
    assert t["measured"] == rows[(ops.HF_GDN, None)]["ms"] / rows[("gated_deltanet", "torch")]["ms"]
