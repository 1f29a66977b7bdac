"""Triton kernels against the PyTorch forms, on CPU under Triton's interpreter (TRITON_INTERPRET=1).

Every kernel is exercised through the Triton entry points: outputs, final states and the gradients
of every input (q, k, v, gates, beta, initial states), with several chunks per sequence, a partial
last chunk, packed sequences (cu_seqlens), more than one K or V tile, fp32 and bf16.

Tolerances (ratio of RMS errors, `rel_err`): fp32 <= 1e-3 (the issue's bound; measured ~1e-7..1e-6).
bf16 <= 1e-2: both sides compute in fp32 from the same bf16 inputs and round the output (and the
input gradients) to bf16, whose unit roundoff is 2^-8 = 3.9e-3, so two fp32 results that differ in
their last bits can round to neighbouring bf16 values (one ulp: up to 7.8e-3 of an element); on a GPU
the kernels' tf32 dot products (for 16-bit inputs; 2^-11 relative per product) add to that.

Shapes are tiny (the interpreter runs each program in Python): T <= 40, K, V <= 16 except where a
case needs two K or V tiles. TRITON_INTERPRET must be set before triton is imported: it is set here,
at the top, before anything imports triton.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import linattn  # noqa: E402
from linattn import LinearAttentionState  # noqa: E402
from linattn.feature_maps import CosFormer  # noqa: E402
from linattn.ops import backend as B  # noqa: E402
from linattn.ops.reference import rel_err  # noqa: E402
from tests.helpers import fresh_import_probe  # noqa: E402

TOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2}


def _triton_runs_here() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


needs_triton = pytest.mark.skipif(not _triton_runs_here(),
                                  reason="triton not importable, or no GPU and TRITON_INTERPRET != 1")
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _grads(out, state_parts, inputs, seed=1):
    """Gradients of a random linear functional of the output and of the final state."""
    gen = torch.Generator().manual_seed(seed)
    loss = 0.0
    for t in (out,) + tuple(state_parts):
        w = torch.randn(t.shape, generator=gen).to(device=t.device, dtype=t.dtype)
        loss = loss + (t * w).float().sum()
    return torch.autograd.grad(loss, inputs, allow_unused=True)


def _check(name, a, b, tol, errs):
    e = rel_err(a, b)
    errs[name] = e
    assert torch.isfinite(a).all(), f"{name}: non-finite values"
    assert e <= tol, f"{name}: rel RMS error {e:.3g} > {tol:g}"


# ------------------------------------------------------------------------ linear attention, chunk

LINEAR_CASES = [
    # id, feature map, gate, normalize, varlen, initial state, dtype, (T, H, K, V)
    ("elu1-g-norm-state-2Vtiles", "elu+1", "g", True, False, True, torch.float32, (40, 1, 16, 72)),
    ("relu-gamma-plain-varlen", "relu", "gamma", False, True, True, torch.float32, (40, 2, 16, 16)),
    ("identity-nogate-norm", "identity", None, True, False, False, torch.float32, (40, 1, 16, 16)),
    ("taylor2-g-norm-2Ktiles", "taylor2", "g", True, False, True, torch.float32, (33, 1, 8, 16)),
    ("cosformer-varlen-state", "cosformer", None, True, True, True, torch.float32, (40, 2, 8, 16)),
    ("elu1-g-norm-varlen-bf16", "elu+1", "g", True, True, True, torch.bfloat16, (40, 2, 16, 16)),
]


def _linear_inputs(fm, gate, varlen, with_state, dtype, shape, seed=0):
    T, H, K, V = shape
    Bsz = 1 if varlen else 2
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen)

    q, k, v = rnd(Bsz, T, H, K), rnd(Bsz, T, H, K), rnd(Bsz, T, H, V)
    if fm == "identity":  # a signed kernel's normalised form is ill-conditioned where den -> 0
        q, k = q.abs() * 0.5, k.abs() * 0.5
    if fm == "taylor2":
        q, k = q * 0.5, k * 0.5
    kw = {"feature_map": CosFormer(max_len=64) if fm == "cosformer" else fm, "scale": 0.8}
    leaves = [q, k, v]
    if gate == "g":
        kw["g"] = -torch.rand(Bsz, T, H, generator=gen) * 0.5
        leaves.append(kw["g"])
    elif gate == "gamma":
        kw["gamma"] = torch.tensor([0.9, 0.7])[:H]
        leaves.append(kw["gamma"])
    cu = torch.tensor([0, 13, T]) if varlen else None
    N = 2
    state_leaves = []
    if with_state:
        Kf = linattn.get_feature_map(kw["feature_map"], K).phi(
            torch.zeros(1, 1, 1, K), torch.zeros(1, 1, dtype=torch.long)).shape[-1]
        kv0, z0 = rnd(N, H, Kf, V), torch.rand(N, H, Kf, generator=gen) + 0.5
        state_leaves = [kv0, z0]
    leaves = [x.to(DEV) for x in leaves]
    state_leaves = [x.to(DEV) for x in state_leaves]
    for x in leaves + state_leaves:
        x.requires_grad_(True)
    q, k, v = leaves[0].to(dtype), leaves[1].to(dtype), leaves[2].to(dtype)
    if gate == "g":
        kw["g"] = leaves[3]
    elif gate == "gamma":
        kw["gamma"] = leaves[3]
    if with_state:
        kw["initial_state"] = LinearAttentionState(state_leaves[0], state_leaves[1], None,
                                                   torch.tensor([3, 5], device=DEV))
    if cu is not None:
        kw["cu_seqlens"] = cu.to(DEV)
    return q, k, v, kw, leaves + state_leaves


@needs_triton
@pytest.mark.parametrize("case", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_chunk_linear_attention(case):
    _, fm, gate, normalize, varlen, with_state, dtype, shape = case
    q, k, v, kw, leaves = _linear_inputs(fm, gate, varlen, with_state, dtype, shape)
    o1, s1 = linattn.linear_attention(q, k, v, normalize=normalize, chunk_size=16, output_final_state=True,
                                      mode="chunk", backend="triton", **kw)
    o2, s2 = linattn.linear_attention(q, k, v, normalize=normalize, chunk_size=16, output_final_state=True,
                                      mode="chunk", backend="torch", **kw)
    tol, errs = TOL[dtype], {}
    assert o1.dtype == dtype and s1.kv.dtype == torch.float32 and s1.z.dtype == torch.float32
    assert s1.log_scale is None and torch.equal(s1.offset, s2.offset)
    _check("o", o1, o2, tol, errs)
    _check("kv", s1.kv, s2.kv, tol, errs)
    _check("z", s1.z, s2.z, tol, errs)
    g1 = _grads(o1, (s1.kv, s1.z), leaves)
    g2 = _grads(o2, (s2.kv, s2.z), leaves)
    for i, (a, b) in enumerate(zip(g1, g2)):
        _check(f"grad{i}", a, b, tol, errs)
    print(case[0], {n: f"{e:.1e}" for n, e in errs.items()})


@needs_triton
def test_chunk_linear_attention_no_state_outputs():
    """Output only (no final state requested, no normaliser): the kernels skip the z state."""
    q, k, v, kw, leaves = _linear_inputs("elu+1", "g", False, False, torch.float32, (24, 1, 16, 16))
    o1, s1 = linattn.linear_attention(q, k, v, normalize=False, chunk_size=16, backend="triton", **kw)
    o2, _ = linattn.linear_attention(q, k, v, normalize=False, chunk_size=16, mode="chunk", backend="torch", **kw)
    assert s1 is None
    errs = {}
    _check("o", o1, o2, 1e-3, errs)
    for i, (a, b) in enumerate(zip(_grads(o1, (), leaves), _grads(o2, (), leaves))):
        _check(f"grad{i}", a, b, 1e-3, errs)


# ---------------------------------------------------------------------- linear attention, decoding

@needs_triton
@pytest.mark.parametrize("fm,dtype", [("elu+1", torch.float32), ("taylor2", torch.float32),
                                      ("relu", torch.bfloat16)])
def test_fused_recurrent_linear_attention(fm, dtype):
    with torch.no_grad():
        q, k, v, kw, _ = _linear_inputs(fm, "g", True, True, dtype, (20, 2, 8, 16))
        kw["cu_seqlens"] = torch.tensor([0, 7, 20], device=DEV)
        o1, s1 = linattn.linear_attention(q, k, v, output_final_state=True, mode="recurrent", backend="triton", **kw)
        o2, s2 = linattn.linear_attention(q, k, v, output_final_state=True, mode="recurrent", backend="torch", **kw)
        errs = {}
        _check("o", o1, o2, TOL[dtype], errs)
        _check("kv", s1.kv, s2.kv, TOL[dtype], errs)
        _check("z", s1.z, s2.z, TOL[dtype], errs)
        assert torch.equal(s1.offset, s2.offset)
        # single-token decoding continues the state of a chunked prefix
        st = kw.pop("initial_state")
        kw.pop("cu_seqlens")
        q1, k1, v1 = q[:, :1], k[:, :1], v[:, :1]
        kw["g"] = kw["g"][:, :1]
        _, pre = linattn.linear_attention(q[:, 1:], k[:, 1:], v[:, 1:], output_final_state=True, backend="triton",
                                          feature_map=kw["feature_map"], scale=kw["scale"], chunk_size=16)
        o3, s3 = linattn.linear_attention(q1, k1, v1, initial_state=LinearAttentionState(
            pre.kv[:1], pre.z[:1], None, pre.offset[:1]), output_final_state=True, mode="recurrent",
            backend="triton", **kw)
        o4, s4 = linattn.linear_attention(q1, k1, v1, initial_state=LinearAttentionState(
            pre.kv[:1], pre.z[:1], None, pre.offset[:1]), output_final_state=True, mode="recurrent", **kw)
        _check("o_decode", o3, o4, TOL[dtype], errs)
        _check("kv_decode", s3.kv, s4.kv, TOL[dtype], errs)
        del st


# ------------------------------------------------------------------------------ delta rule, chunk

DELTA_CASES = [
    # id, exact, gate, qk_l2norm, varlen, initial state, dtype, key scale, (T, H, K, V)
    ("deltanet-l2-state", False, False, True, False, True, torch.float32, 1.0, (40, 1, 16, 16)),
    ("gated-deltanet-varlen", False, True, True, True, True, torch.float32, 1.0, (40, 2, 16, 16)),
    ("efla-gated-bigkeys", True, True, False, False, True, torch.float32, 30.0, (40, 1, 16, 16)),
    ("efla-varlen-2Ktiles", True, False, False, True, False, torch.float32, 1.0, (24, 2, 72, 16)),
    ("gated-deltanet-bf16", False, True, True, False, True, torch.bfloat16, 1.0, (40, 1, 16, 16)),
]


def _delta_inputs(exact, gate, l2, varlen, with_state, dtype, kscale, shape, seed=0):
    T, H, K, V = shape
    Bsz = 1 if varlen else 2
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(Bsz, T, H, K, generator=gen), torch.randn(Bsz, T, H, K, generator=gen) * kscale,
               torch.randn(Bsz, T, H, V, generator=gen))
    if not l2 and not exact:
        k = k / K ** 0.5  # plain DeltaNet with raw keys is stable only for beta ||k||^2 < 2
    beta = torch.rand(Bsz, T, H, generator=gen)
    leaves = [q, k, v, beta]
    if gate:
        leaves.append(-torch.rand(Bsz, T, H, generator=gen) * 0.5)
    if with_state:
        leaves.append(torch.randn(2, H, K, V, generator=gen) * 0.5)
    leaves = [x.to(DEV).requires_grad_(True) for x in leaves]
    q, k, v = (x.to(dtype) for x in leaves[:3])
    beta = leaves[3].to(dtype)
    kw = {"exact": exact, "qk_l2norm": l2}
    i = 4
    if gate:
        kw["g"] = leaves[i]
        i += 1
    if with_state:
        kw["initial_state"] = leaves[i]
    if varlen:
        kw["cu_seqlens"] = torch.tensor([0, 13, T], device=DEV)
    return q, k, v, beta, kw, leaves


@needs_triton
@pytest.mark.parametrize("case", DELTA_CASES, ids=[c[0] for c in DELTA_CASES])
def test_chunk_delta_rule(case):
    _, exact, gate, l2, varlen, with_state, dtype, kscale, shape = case
    q, k, v, beta, kw, leaves = _delta_inputs(exact, gate, l2, varlen, with_state, dtype, kscale, shape)
    o1, s1 = linattn.delta_rule(q, k, v, beta, chunk_size=16, output_final_state=True, mode="chunk",
                                backend="triton", **kw)
    o2, s2 = linattn.delta_rule(q, k, v, beta, chunk_size=16, output_final_state=True, mode="chunk",
                                backend="torch", **kw)
    tol, errs = TOL[dtype], {}
    assert o1.dtype == dtype and s1.dtype == torch.float32
    _check("o", o1, o2, tol, errs)
    _check("S", s1, s2, tol, errs)
    for i, (a, b) in enumerate(zip(_grads(o1, (s1,), leaves), _grads(o2, (s2,), leaves))):
        _check(f"grad{i}", a, b, tol, errs)
    print(case[0], {n: f"{e:.1e}" for n, e in errs.items()})


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_recurrent_delta_rule(dtype):
    with torch.no_grad():
        q, k, v, beta, kw, _ = _delta_inputs(True, True, True, True, True, dtype, 1.0, (20, 2, 16, 16))
        o1, s1 = linattn.delta_rule(q, k, v, beta, output_final_state=True, mode="recurrent", backend="triton", **kw)
        o2, s2 = linattn.delta_rule(q, k, v, beta, output_final_state=True, mode="recurrent", backend="torch", **kw)
    errs = {}
    _check("o", o1, o2, TOL[dtype], errs)
    _check("S", s1, s2, TOL[dtype], errs)


# --------------------------------------------------------------------------------------- dispatch

def _problem(q=None, **kw):
    q = torch.zeros(1, 4, 2, 8) if q is None else q
    return linattn.prepare_linear_attention(q, q, q, **kw)


def test_select_backend_rules(monkeypatch):
    p = _problem()
    assert B.select_backend("torch", p) == "torch"
    assert B.select_backend("auto", p) in ("torch", "cpu")  # CPU tensors: never triton (issue 34 added "cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        B.select_backend("cuda", p)
    monkeypatch.setattr(B, "available", lambda: False)
    with pytest.raises(ImportError, match="linattn\\[triton\\]") as e:
        B.select_backend("triton", p)
    assert isinstance(e.value, B.BackendUnavailableError) and isinstance(e.value, linattn.LinattnError)
    monkeypatch.setattr(B, "available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1") as e:
        B.select_backend("triton", p)
    assert isinstance(e.value, B.BackendDeviceError) and isinstance(e.value, linattn.LinattnError)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert B.select_backend("triton", p) == "triton"
    with pytest.warns(UserWarning, match="falling back"):
        assert B.select_backend("triton", _problem(feature_map="hadamard_exp", mode="parallel")) == "torch"


def test_unsupported_configurations():
    q = torch.zeros(1, 4, 2, 8)
    assert _problem().triton_unsupported() is None
    assert _problem(feature_map="taylor2", g=torch.zeros(1, 4, 2)).triton_unsupported() is None
    assert "log-space" in _problem(feature_map="hadamard_exp").triton_unsupported()
    assert "log-space" in _problem(feature_map=linattn.FAVORPlus(8)).triton_unsupported()
    assert "diagonal" in _problem(g=torch.zeros(1, 4, 2, 8)).triton_unsupported()
    assert "causal" in _problem(causal=False).triton_unsupported()
    assert "parallel" in _problem(mode="parallel").triton_unsupported()
    assert "fp16 / bf16 / fp32" in _problem(q.double()).triton_unsupported()
    leaf = torch.zeros(1, 4, 2, 8, requires_grad=True)
    assert "forward-only" in _problem(leaf, mode="recurrent").triton_unsupported()
    with torch.no_grad():
        assert _problem(leaf, mode="recurrent").triton_unsupported() is None

    def delta(q, **kw):
        return linattn.prepare_delta(q, q, q, torch.ones(q.shape[:3]), **kw)

    assert delta(q).triton_unsupported() is None
    assert "K <= 256" in delta(torch.zeros(1, 4, 2, 300)).triton_unsupported()
    assert "forward-only" in delta(leaf, mode="recurrent").triton_unsupported()
    assert delta(q, g=torch.zeros(1, 4, 2, 8), channel_gate=True).triton_unsupported() is None  # KDA chunk kernels
    assert "read key" in delta(q, r=q).triton_unsupported()


@needs_triton
def test_operator_backends_agree():
    """backend="triton" reproduces backend="torch"; uncovered calls fall back to PyTorch."""
    q, k, v, kw, _ = _linear_inputs("elu+1", "g", False, True, torch.float32, (24, 1, 16, 16))
    o1, s1 = linattn.linear_attention(q, k, v, chunk_size=16, output_final_state=True, backend="triton", **kw)
    o2, s2 = linattn.linear_attention(q, k, v, chunk_size=16, output_final_state=True, backend="torch", **kw)
    assert rel_err(o1, o2) < 1e-3 and rel_err(s1.kv, s2.kv) < 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # hadamard_exp falls back to PyTorch with a warning
        o3, _ = linattn.linear_attention(q, k, v, feature_map="hadamard_exp", backend="triton")
    assert torch.allclose(o3, linattn.linear_attention(q, k, v, feature_map="hadamard_exp", backend="torch")[0])
    q, k, v, beta, kw, _ = _delta_inputs(False, True, True, False, True, torch.float32, 1.0, (24, 1, 16, 16))
    o1, s1 = linattn.delta_rule(q, k, v, beta, chunk_size=16, output_final_state=True, backend="triton", **kw)
    o2, s2 = linattn.delta_rule(q, k, v, beta, chunk_size=16, output_final_state=True, backend="torch", **kw)
    assert rel_err(o1, o2) < 1e-3 and rel_err(s1, s2) < 1e-3


def test_import_linattn_does_not_import_triton():
    # the PyTorch path (backend='torch'): calling a torch.library custom op, as the compiled CPU kernels
    # (backend 'cpu', which 'auto' picks for CPU tensors) are, makes torch itself import triton
    # (torch._dynamo -> torch.utils._triton.has_triton_package), so those calls are not part of this check
    probe = fresh_import_probe()   # a clean interpreter: `import linattn`, those calls, select_backend's picks
    assert "triton" not in probe["import"]["modules"], "import linattn imported triton"
    assert all(p in ("torch", "cpu") for p in probe["picks"]["picks"]), probe["picks"]["picks"]
    assert "triton" not in probe["picks"]["modules"], "triton was imported"
