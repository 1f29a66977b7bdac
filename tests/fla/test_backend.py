"""backend="fla": every translated call equals linattn's PyTorch form (outputs, final states, every gradient), on the
CPU with stand-ins for fla's kernels (tests/fla/standins.py: each honours every argument of the fla function it
replaces, and is checked against fla's own naive references in test_standins.py). fp64 (allowed in place of fla's
fp32 for these tests) to 1e-10, fp32 to 1e-5 relative; each translated argument changes the output."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import linattn
from linattn.ops.backend import BackendDeviceError, BackendUnavailableError
from tests.fla.standins import fla_backend_on_cpu
from tests.helpers import fresh_import_probe

pytest.importorskip("fla")
pytestmark = pytest.mark.usefixtures("one_thread_module")

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def rel(a, b):
    if a is None or b is None:   # an unused input: no gradient on one path, zeros on the other
        assert a is None and b is None or not (a if b is None else b).any()
        return 0.0
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _leaves(args, kwargs):
    """The tensors a gradient is taken for: every floating tensor argument, the initial state's too."""
    out = [a for a in args if isinstance(a, torch.Tensor)]
    for key in ("g", "gamma", "beta"):
        if isinstance(kwargs.get(key), torch.Tensor):
            out.append(kwargs[key])
    s = kwargs.get("initial_state")
    if isinstance(s, linattn.LinearAttentionState):
        out += [s.kv, s.z]
    elif isinstance(s, torch.Tensor):
        out.append(s)
    return out


def _run(op, args, kwargs, backend, grad):
    leaves = _leaves(args, kwargs)
    for t in leaves:
        t.grad = None
        t.requires_grad_(grad)
    o, state = op(*args, backend=backend, **kwargs)
    states = [] if state is None else ([state] if isinstance(state, torch.Tensor) else [state.kv, state.z])
    grads = []
    if grad:
        loss = (o.double() * torch.linspace(-1, 1, o.numel(), dtype=torch.float64).view(o.shape)).sum()
        loss = loss + sum((s.double() ** 2).sum() for s in states)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    for t in leaves:
        t.requires_grad_(False)
    return [o.detach(), *(s.detach() for s in states), *grads]


def check_equal(monkeypatch, op, args, kwargs, grad=True, fp64=None):
    """fla (stand-ins) against backend="torch": outputs, states and gradients within the dtype's tolerance."""
    dtype = args[0].dtype
    ref = _run(op, args, kwargs, "torch", grad)
    with fla_backend_on_cpu(monkeypatch, fp64=dtype == torch.float64 if fp64 is None else fp64) as calls:
        got = _run(op, args, kwargs, "fla", grad)
    assert calls, "the fla backend did not call fla"
    assert len(got) == len(ref)
    errs = [rel(a, b) for a, b in zip(got, ref)]
    assert max(errs) <= TOL[dtype], errs
    return got, calls


# ---------------------------------------------------------------------------------------------- linear_attention

def _linear_inputs(dtype, B=2, T=11, H=2, K=4, V=3, HV=None):
    gen = torch.Generator().manual_seed(0)
    q = 0.5 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64).to(dtype)
    k = 0.5 * torch.randn(B, T, H, K, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(B, T, HV or H, V, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def _gate(kind, dtype, B, T, H, K):
    gen = torch.Generator().manual_seed(1)
    if kind == "g":
        return {"g": -torch.rand(B, T, H, generator=gen, dtype=torch.float64).to(dtype)}
    if kind == "gk":
        return {"g": -0.5 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64).to(dtype)}
    if kind == "gamma":
        return {"gamma": 0.9}
    if kind == "gamma_h":
        return {"gamma": torch.tensor([0.8, 0.95][:H] * (H // 2 or 1), dtype=dtype)}
    return {}


LINEAR_CASES = [
    dict(feature_map="elu+1"),
    dict(feature_map=None, scale=0.7),
    dict(feature_map="elu+1", normalize=False, gate="g"),
    dict(feature_map="elu+1", gate="gamma"),
    dict(feature_map=None, normalize=False, gate="gamma_h"),
    dict(feature_map="elu+1", gate="gk"),
    dict(feature_map=None, normalize=False, gate="gk", scale=0.5),
    dict(feature_map="relu", gate="g", state=True),
    dict(feature_map="elu+1", gate="gk", state=True, mode="recurrent"),
    dict(feature_map=None, normalize=False, gate="g", mode="recurrent", state=True),
    dict(feature_map="elu+1", gate="g", varlen=True, state=True),
    dict(feature_map="elu+1", varlen=True, state=True),                # no gate: the running key sum
    dict(feature_map="elu+1", state=True, mode="recurrent"),
    dict(feature_map="elu+1", HV=4),                                   # grouped value heads, folded
    dict(feature_map="elu+1", gate="gamma", HV=4),                     # grouped value heads, folded
    dict(feature_map="elu+1", gate="g", HV=4, state=True),             # grouped value heads, repeated q/k
]


def _linear_call(case, dtype):
    B = 1 if case.get("varlen") else 2
    H, K, T = 2, 4, 11
    q, k, v = _linear_inputs(dtype, B=B, T=T, H=H, K=K, HV=case.get("HV"))
    HV = v.shape[2]
    kw = dict(feature_map=case["feature_map"], normalize=case.get("normalize", True), mode=case.get("mode", "chunk"),
              output_final_state=True, chunk_size=4)
    if "scale" in case:
        kw["scale"] = case["scale"]
    kw.update(_gate(case.get("gate"), dtype, B, T, HV if case.get("state") and case.get("HV") else H, K))
    if case.get("varlen"):
        kw["cu_seqlens"] = torch.tensor([0, 3, 4, 11])
    if case.get("state"):
        N = 3 if case.get("varlen") else B
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        gen = torch.Generator().manual_seed(7)
        kv = 0.3 * torch.randn(N, HV, K, v.shape[-1], generator=gen, dtype=torch.float64).to(cdt)
        z = 0.5 + torch.rand(N, HV, K, generator=gen, dtype=torch.float64).to(cdt)
        kw["initial_state"] = linattn.LinearAttentionState(kv, z, None, torch.full((N,), 5, dtype=torch.int64))
    return (q, k, v), kw


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_linear_attention_equals_torch(monkeypatch, case, dtype):
    if dtype == torch.float32 and case["feature_map"] is None and case.get("normalize", True):
        pytest.skip("signed identity features normalised: den ~ 0 amplifies fp32 rounding (fp64 checks it)")
    args, kw = _linear_call(case, dtype)
    check_equal(monkeypatch, linattn.linear_attention, args, kw)


def test_linear_routing_and_gamma(monkeypatch):
    """A constant gamma without a gradient is fla's g_gamma; a gamma that needs one goes as g (fla's g_gamma has
    no gradient); per-feature gates take chunk_gla; the recurrent form fla's fused_recurrent_* twins."""
    args, kw = _linear_call(dict(feature_map="elu+1", gate="gamma"), torch.float64)
    _, calls = check_equal(monkeypatch, linattn.linear_attention, args, kw, grad=False)
    assert calls[0][0] == "chunk_simple_gla" and "g_gamma" in calls[0][1]
    gamma = torch.tensor([0.8, 0.9], dtype=torch.float64, requires_grad=True)
    kw["gamma"] = gamma
    _, calls = check_equal(monkeypatch, linattn.linear_attention, args, kw)
    assert calls[0][0] == "chunk_simple_gla" and "g" in calls[0][1] and "g_gamma" not in calls[0][1]
    args, kw = _linear_call(dict(feature_map="elu+1", gate="gk", mode="recurrent"), torch.float64)
    _, calls = check_equal(monkeypatch, linattn.linear_attention, args, kw, grad=False)
    assert calls[0][0] == "fused_recurrent_gla"


# ---------------------------------------------------------------------------------------------- delta_rule

def _delta_inputs(dtype, B=2, T=11, H=2, K=4, V=3, HV=None, unit=True):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = F.normalize(k, dim=-1) if unit else 0.6 * k
    v = torch.randn(B, T, HV or H, V, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, HV or H, generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, beta))


DELTA_CASES = [
    dict(),                                                 # DeltaNet
    dict(gate="g"),                                         # Gated DeltaNet
    dict(gate="gk"),                                        # KDA
    dict(exact=True, unit=False),                           # EFLA on unnormalised keys
    dict(exact=True, gate="g", qk_l2norm=True, unit=False),
    dict(qk_l2norm=True, unit=False, scale=0.3),
    dict(qk_l2norm="clamp", unit=False, gate="gk"),
    dict(gate="g", state=True),
    dict(gate="gk", state=True, varlen=True, qk_l2norm=True, unit=False),
    dict(varlen=True, state=True),
    dict(gate="g", HV=4, state=True),                       # grouped value heads
    dict(gate="gk", HV=4, qk_l2norm=True, unit=False),
    dict(HV=4),                                             # DeltaNet with grouped heads: the gated kernel
]


def _delta_call(case, dtype, mode="chunk"):
    B = 1 if case.get("varlen") else 2
    H, K, T = 2, 4, 11
    q, k, v, beta = _delta_inputs(dtype, B=B, T=T, H=H, K=K, HV=case.get("HV"), unit=case.get("unit", True))
    HV = v.shape[2]
    kw = dict(mode=mode, chunk_size=4, output_final_state=True, exact=case.get("exact", False),
              qk_l2norm=case.get("qk_l2norm", False))
    if "scale" in case:
        kw["scale"] = case["scale"]
    gen = torch.Generator().manual_seed(3)
    if case.get("gate") == "g":
        kw["g"] = -torch.rand(B, T, HV, generator=gen, dtype=torch.float64).to(dtype)
    elif case.get("gate") == "gk":
        kw["g"] = -0.5 * torch.rand(B, T, HV, K, generator=gen, dtype=torch.float64).to(dtype)
    if case.get("varlen"):
        kw["cu_seqlens"] = torch.tensor([0, 3, 4, 11])
    if case.get("state"):
        N = 3 if case.get("varlen") else B
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        kw["initial_state"] = 0.3 * torch.randn(N, HV, K, v.shape[-1], generator=gen, dtype=torch.float64).to(cdt)
    return (q, k, v, beta), kw


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", DELTA_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "deltanet")
def test_delta_rule_equals_torch(monkeypatch, case, dtype):
    args, kw = _delta_call(case, dtype)
    check_equal(monkeypatch, linattn.delta_rule, args, kw)


@pytest.mark.parametrize("case", DELTA_CASES[:4] + DELTA_CASES[7:11], ids=str)
def test_delta_rule_recurrent_equals_torch(monkeypatch, case):
    """fla's fused_recurrent delta kernels are forward-only: outputs and states."""
    args, kw = _delta_call(case, torch.float64, mode="recurrent")
    _, calls = check_equal(monkeypatch, linattn.delta_rule, args, kw, grad=False)
    assert calls[0][0] == ("fused_recurrent_kda" if case.get("gate") == "gk" else "fused_recurrent_gated_delta_rule")


DELTA_ROUTES = [
    (torch.bfloat16, None, None, "chunk_delta_rule"),
    (torch.float16, None, None, "chunk_delta_rule"),
    (torch.float32, None, None, "chunk_gated_delta_rule"),      # chunk_delta_rule rejects fp32
    (torch.bfloat16, 4, None, "chunk_gated_delta_rule"),        # ... and grouped value heads
    (torch.bfloat16, None, "g", "chunk_gated_delta_rule"),
    (torch.bfloat16, None, "gk", "chunk_kda"),
]


@pytest.mark.parametrize("dtype, HV, gate, expected", DELTA_ROUTES)
def test_delta_routing_half_precision(monkeypatch, dtype, HV, gate, expected):
    """Which fla kernel a DeltaNet / Gated DeltaNet / KDA call takes, in every kernel dtype; half precision
    agrees with the PyTorch form to its own rounding, and the output keeps the input dtype."""
    case = dict(HV=HV, gate=gate) if HV else dict(gate=gate)
    args, kw = _delta_call(case, dtype)
    ref, _ = linattn.delta_rule(*args, backend="torch", **kw)
    with fla_backend_on_cpu(monkeypatch) as calls:
        o, S = linattn.delta_rule(*args, backend="fla", **kw)
    assert calls[0][0] == expected
    assert o.dtype == dtype and S.dtype == torch.float32
    assert rel(o, ref) < (3e-2 if dtype == torch.bfloat16 else 3e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_half_precision(monkeypatch, dtype):
    args, kw = _linear_call(dict(feature_map="elu+1", gate="g", state=True), dtype)
    ref, _ = linattn.linear_attention(*args, backend="torch", **kw)
    with fla_backend_on_cpu(monkeypatch):
        o, s = linattn.linear_attention(*args, backend="fla", **kw)
    assert o.dtype == dtype and s.kv.dtype == torch.float32
    assert rel(o, ref) < (3e-2 if dtype == torch.bfloat16 else 3e-3)


# ---------------------------------------------------------------------------------------------- each argument moves

def _fla_out(monkeypatch, op, args, kw):
    with fla_backend_on_cpu(monkeypatch, fp64=True):
        o, s = op(*args, backend="fla", **kw)
    return torch.cat([o.flatten(), *(t.flatten() for t in ([s] if isinstance(s, torch.Tensor) else [s.kv, s.z]))])


LINEAR_MOVES = {
    "scale": dict(scale=0.5),
    "scale-identity": dict(feature_map=None, scale=0.5),
    "normalize": dict(normalize=False),
    "gamma": dict(gamma=0.8),
    "gamma-per-head": dict(gamma=torch.tensor([0.7, 0.99], dtype=torch.float64)),
    "g": dict(g=-torch.rand(2, 11, 2, dtype=torch.float64)),
    "g-per-feature": dict(g=-torch.rand(2, 11, 2, 4, dtype=torch.float64)),
    "feature_map": dict(feature_map="relu"),
    "initial_state": dict(initial_state=linattn.LinearAttentionState(
        torch.ones(2, 2, 4, 3, dtype=torch.float64), torch.ones(2, 2, 4, dtype=torch.float64), None,
        torch.zeros(2, dtype=torch.int64))),
    "mode": dict(mode="recurrent", v_scale=2.0),   # same function: moves only with the values (the check below)
}


@pytest.mark.parametrize("name", sorted(LINEAR_MOVES))
def test_linear_each_argument_moves_the_output(monkeypatch, name):
    """A dropped or mistranslated argument fails: changing it moves the fla output, and the moved output is the
    PyTorch form's."""
    args, _ = _linear_call(dict(feature_map="elu+1"), torch.float64)
    base = dict(feature_map="elu+1", output_final_state=True)
    change = dict(LINEAR_MOVES[name])
    v_scale = change.pop("v_scale", 1.0)
    moved_args = (args[0], args[1], args[2] * v_scale)
    before = _fla_out(monkeypatch, linattn.linear_attention, args, base)
    after = _fla_out(monkeypatch, linattn.linear_attention, moved_args, {**base, **change})
    assert rel(after, before) > 1e-3
    check_equal(monkeypatch, linattn.linear_attention, moved_args, {**base, **change}, grad=False)


def test_linear_cu_seqlens_moves_the_output(monkeypatch):
    args, _ = _linear_call(dict(feature_map="elu+1", varlen=True), torch.float64)
    base = dict(feature_map="elu+1", output_final_state=False)
    o1 = _fla_out_plain(monkeypatch, linattn.linear_attention, args, base)
    o2 = _fla_out_plain(monkeypatch, linattn.linear_attention, args, {**base, "cu_seqlens": torch.tensor([0, 5, 11])})
    assert rel(o2, o1) > 1e-3
    check_equal(monkeypatch, linattn.linear_attention, args, {**base, "cu_seqlens": torch.tensor([0, 5, 11])})


def _fla_out_plain(monkeypatch, op, args, kw):
    with fla_backend_on_cpu(monkeypatch, fp64=True):
        return op(*args, backend="fla", **kw)[0]


DELTA_MOVES = {
    "scale": dict(scale=0.3),
    "qk_l2norm": dict(qk_l2norm=True),
    "qk_l2norm-clamp": dict(qk_l2norm="clamp"),     # differs from rsqrt only for small keys: below
    "exact": dict(exact=True),
    "g": dict(g=-torch.rand(2, 11, 2, dtype=torch.float64)),
    "g-per-channel": dict(g=-torch.rand(2, 11, 2, 4, dtype=torch.float64)),
    "initial_state": dict(initial_state=torch.ones(2, 2, 4, 3, dtype=torch.float64)),
    "beta": dict(beta_scale=0.5),
}


@pytest.mark.parametrize("name", sorted(DELTA_MOVES))
def test_delta_each_argument_moves_the_output(monkeypatch, name):
    q, k, v, beta = _delta_inputs(torch.float64, unit=False)
    change = dict(DELTA_MOVES[name])
    beta2 = beta * change.pop("beta_scale", 1.0)
    base = dict(output_final_state=True)
    if name == "qk_l2norm-clamp":   # tiny keys: rsqrt(sum k^2 + 1e-6) and 1 / max(||k||, 1e-6) differ
        q, k = q * 1e-3, k * 1e-3
        base["qk_l2norm"] = True
    before = _fla_out(monkeypatch, linattn.delta_rule, (q, k, v, beta), base)
    after = _fla_out(monkeypatch, linattn.delta_rule, (q, k, v, beta2), {**base, **change})
    assert rel(after, before) > 1e-3
    check_equal(monkeypatch, linattn.delta_rule, (q, k, v, beta2), {**base, **change}, grad=False)


def test_delta_scale_default_is_linattn_not_fla(monkeypatch):
    """scale=None is K**-0.5 in delta_rule and 1 in linear_attention; fla's default is K**-0.5 for both: the
    backend passes linattn's value explicitly (check_equal fails if it passed None to fla)."""
    args, kw = _linear_call(dict(feature_map=None), torch.float64)
    _, calls = check_equal(monkeypatch, linattn.linear_attention, args, kw, grad=False)
    assert "scale" in calls[0][1]
    args, kw = _delta_call(dict(), torch.float64)
    _, calls = check_equal(monkeypatch, linattn.delta_rule, args, kw, grad=False)
    assert "scale" in calls[0][1]


# ---------------------------------------------------------------------------------------------- never silent

def test_fla_on_cpu_tensors_raises_device_error():
    q, k, v, beta = _delta_inputs(torch.float32)
    with pytest.raises(BackendDeviceError, match=r'CUDA tensors.*linattn\[gpu\]'):
        linattn.delta_rule(q, k, v, beta, backend="fla")
    with pytest.raises(BackendDeviceError, match="CUDA"):
        linattn.linear_attention(q, k, v, backend="fla")


@pytest.mark.parametrize("op", ["linear", "delta"])
def test_fla_rejects_fp64_and_uncovered_calls(monkeypatch, op):
    with fla_backend_on_cpu(monkeypatch):
        if op == "delta":
            q, k, v, beta = _delta_inputs(torch.float64)
            with pytest.raises(BackendUnavailableError, match=r"float64.*linattn\[gpu\]"):
                linattn.delta_rule(q, k, v, beta, backend="fla")
            with pytest.raises(BackendUnavailableError, match="mode='parallel'"):
                linattn.delta_rule(q.float(), k.float(), v.float(), beta.float(), mode="parallel", backend="fla")
            q, k, v, beta = _delta_inputs(torch.float32, K=260)
            with pytest.raises(BackendUnavailableError, match="K <= 256, got K = 260"):
                linattn.delta_rule(q, k, v, beta, backend="fla")
            with pytest.raises(BackendUnavailableError, match="forward-only"):
                linattn.delta_rule(q[..., :4].requires_grad_(), k[..., :4], v, beta, mode="recurrent", backend="fla")
        else:
            q, k, v = _linear_inputs(torch.float64)
            with pytest.raises(BackendUnavailableError, match="float64"):
                linattn.linear_attention(q, k, v, backend="fla")
            q, k, v = _linear_inputs(torch.float32)
            with pytest.raises(BackendUnavailableError, match="log-space"):
                linattn.linear_attention(q, k, v, feature_map="hadamard_exp", backend="fla")
            with pytest.raises(BackendUnavailableError, match="causal=False"):
                linattn.linear_attention(q, k, v, causal=False, backend="fla")


@pytest.mark.parametrize("why, patch", [
    ("not installed", lambda m, lfla: m.setattr("importlib.util.find_spec", lambda name, *a: None)),
    ("tested with 0.6.0 only", lambda m, lfla: m.setattr(lfla, "_installed_version", lambda: "0.5.0")),
])
def test_fla_missing_or_untested_version_raises(monkeypatch, why, patch):
    import linattn.fla as lfla

    monkeypatch.setattr(lfla, "_UNAVAILABLE", None)
    monkeypatch.setattr(lfla, "runs_on", lambda device: True)
    patch(monkeypatch, lfla)
    q, k, v, beta = _delta_inputs(torch.float32)
    with pytest.raises(BackendUnavailableError, match=rf'{why}.*linattn\[gpu\]'):
        linattn.delta_rule(q, k, v, beta, backend="fla")
    monkeypatch.setattr(lfla, "_UNAVAILABLE", None)   # the next test sees the real environment again


class _FakeCuda:
    """A prepared call on a CUDA device, for the decision alone (nothing runs)."""
    def __init__(self, fla_why=None, triton_why=None):
        self.q = type("Q", (), {"device": torch.device("cuda"), "is_cuda": True})()
        self._fla, self._triton = fla_why, triton_why

    def fla_unsupported(self):
        return self._fla

    def triton_unsupported(self):
        return self._triton


def test_auto_prefers_fla_on_cuda_then_triton_then_torch(monkeypatch):
    import linattn.fla as lfla
    from linattn.ops import backend

    monkeypatch.setattr(lfla, "unavailable", lambda: None)
    monkeypatch.setattr(backend, "available", lambda: True)
    choice = backend.choose_backend("auto", _FakeCuda())
    assert choice.backend == "fla" and "covers" in choice.reason
    choice = backend.choose_backend("auto", _FakeCuda(fla_why="mode='parallel' has no fla kernel"))
    assert choice.backend == "triton" and "mode='parallel'" in choice.reason
    choice = backend.choose_backend("auto", _FakeCuda(fla_why="x", triton_why="y"))
    assert choice.backend == "torch" and "no fla: x" in choice.reason and "no Triton: y" in choice.reason
    monkeypatch.setattr(lfla, "unavailable", lambda: "fla-core is not installed")
    choice = backend.choose_backend("auto", _FakeCuda())
    assert choice.backend == "triton" and "not installed" in choice.reason


def test_explain_and_backend_log(monkeypatch):
    q, k, v, beta = _delta_inputs(torch.float32)
    assert linattn.explain("delta_rule", q, k, v, beta, backend="torch").backend == "torch"
    choice = linattn.explain(linattn.delta_rule, q, k, v, beta, backend="auto")
    assert choice.backend in ("cpu", "torch") and "CPU tensors" in choice.reason
    with fla_backend_on_cpu(monkeypatch):
        assert str(linattn.explain("delta_rule", q, k, v, beta, backend="fla")).startswith("fla: ")
        with pytest.raises(BackendUnavailableError, match="float64"):
            linattn.explain("delta_rule", q.double(), k.double(), v.double(), beta.double(), backend="fla")
    assert linattn.explain("softmax_attention", q, k, v).backend == "torch"
    from linattn.ops import backend

    monkeypatch.setattr(backend, "_LOGGED", set())
    monkeypatch.setenv("LINATTN_BACKEND_LOG", "1")
    import logging

    lines = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("linattn.backend")
    logger.addHandler(handler)
    try:
        for _ in range(3):
            linattn.delta_rule(q, k, v, beta, backend="torch")
    finally:
        logger.removeHandler(handler)
    assert len(lines) == 1 and "backend='torch' -> torch" in lines[0], lines


def test_cpu_calls_import_neither_fla_nor_triton():
    # a clean interpreter after PyTorch-path calls, explain() and a backend='fla' call on CPU tensors
    probe = fresh_import_probe()["fla"]
    bad = [m for m in probe["modules"] if m == 'fla' or m.startswith('fla.') or m == 'triton']
    assert not bad, bad


def test_fla_package_never_imports_ops():
    from tests.helpers import PKG, import_graph_once

    graph = import_graph_once()
    bad = {m: sorted(t for t in ts if t.startswith(f"{PKG}.ops")) for m, ts in graph.items()
           if m.startswith(f"{PKG}.fla")}
    assert bad and not any(bad.values()), bad


def test_chunk_size_used_on_fla(monkeypatch):
    q, k, v, beta = _delta_inputs(torch.float32)
    with fla_backend_on_cpu(monkeypatch):
        assert linattn.chunk_size_used("delta_rule", q, k, v, beta, chunk_size=16, backend="fla") == 64
        assert linattn.chunk_size_used("linear_attention", q, k, v, chunk_size=16, backend="fla") == 64


# ---------------------------------------------------------------------------------------------- the other delta ops

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gate", [None, "g", "gk"])
def test_delta_product_equals_torch(monkeypatch, gate, dtype):
    """delta_product's interleaved core problem runs on fla's delta kernels as it is (n sub-steps per token)."""
    gen = torch.Generator().manual_seed(4)
    B, T, H, n, K, V = 2, 7, 2, 2, 4, 3
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64).to(dtype)
    k = F.normalize(torch.randn(B, T, H, n, K, generator=gen, dtype=torch.float64), dim=-1).to(dtype)
    v = torch.randn(B, T, H, n, V, generator=gen, dtype=torch.float64).to(dtype)
    beta = (2 * torch.rand(B, T, H, n, generator=gen, dtype=torch.float64)).to(dtype)
    kw = dict(output_final_state=True, chunk_size=4)
    if gate == "g":
        kw["g"] = -torch.rand(B, T, H, generator=gen, dtype=torch.float64).to(dtype)
    elif gate == "gk":
        kw["g"] = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64).to(dtype)
    check_equal(monkeypatch, linattn.delta_product, (q, k, v, beta), kw)


def _rwkv7_inputs(dtype, B=2, T=9, H=2, K=4, V=3):
    gen = torch.Generator().manual_seed(5)
    r, k = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    w = -0.6 * torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    kk = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    a, b = -kk, kk * torch.rand(B, T, H, 1, generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (r, w, k, v, a, b))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("variant", ["plain", "state", "varlen", "scale"])
def test_rwkv7_equals_torch(monkeypatch, variant, dtype):
    """rwkv7 has fla's chunk_rwkv7 arguments: on fla it runs the tokens themselves (the core runs 2 sub-steps)."""
    B = 1 if variant == "varlen" else 2
    args = _rwkv7_inputs(dtype, B=B)
    kw = dict(output_final_state=True, chunk_size=4)
    if variant == "scale":
        kw["scale"] = 0.5
    if variant == "varlen":
        kw["cu_seqlens"] = torch.tensor([0, 2, 9])
    if variant in ("state", "varlen"):
        cdt = torch.float64 if dtype == torch.float64 else torch.float32
        gen = torch.Generator().manual_seed(8)
        kw["initial_state"] = 0.3 * torch.randn(2, 2, 4, 3, generator=gen, dtype=torch.float64).to(cdt)
    _, calls = check_equal(monkeypatch, linattn.rwkv7, args, kw)
    assert calls[0][0] == "chunk_rwkv7" and "scale" in calls[0][1]


def test_rwkv7_recurrent_passes_scale(monkeypatch):
    """fused_recurrent_rwkv7's default scale is K**-0.5, chunk_rwkv7's 1.0, linattn's 1.0: always passed."""
    args = _rwkv7_inputs(torch.float64)
    _, calls = check_equal(monkeypatch, linattn.rwkv7, args, dict(mode="recurrent", output_final_state=True),
                           grad=False)
    assert calls[0][0] == "fused_recurrent_rwkv7"


def test_comba_is_not_covered_yet(monkeypatch):
    q, k, v, beta = _delta_inputs(torch.float32)
    with fla_backend_on_cpu(monkeypatch):
        with pytest.raises(BackendUnavailableError, match="read key of its own"):
            linattn.comba(q, k, v, beta, backend="fla")
        with pytest.raises(BackendUnavailableError, match="read key of its own"):
            linattn.comba(q, k, v, beta, p=0.5 * k, backend="fla")
        choice = linattn.explain("comba", q, k, v, beta)
        assert choice.backend != "fla"


def test_calls_for_fla_skip_the_pytorch_preprocessing(monkeypatch):
    """A delta_rule call that fla's kernels take is not preprocessed (fla reads the caller's tensors); one they do
    not take is, and runs elsewhere; an unprepared problem refuses any other backend."""
    from linattn.ops.delta_core import run_delta

    q, k, v, beta = _delta_inputs(torch.float32)
    with fla_backend_on_cpu(monkeypatch):
        p = linattn.prepare_delta(q, k, v, beta, qk_l2norm=True, backend="fla")
        assert not p.prepared and p.q is q and p.k is k
        assert linattn.prepare_delta(q, k, v, beta, backend="torch").prepared
        assert linattn.prepare_delta(q, k, v, beta).prepared
        with pytest.raises(linattn.LinattnError, match="prepared for fla"):
            run_delta(p, "torch")
        o, _ = run_delta(p, "fla")
    ref, _ = linattn.delta_rule(q, k, v, beta, qk_l2norm=True, backend="torch")
    assert rel(o, ref) < 1e-5


@pytest.mark.parametrize("name", [n for n in linattn.feature_map_names()
                                  if not linattn.get_feature_map(n, 4).log_space])
def test_every_linear_space_feature_map_on_fla(monkeypatch, name):
    """Every registered map that fla covers (features applied before the kernel, ELA's linear-space kernels and
    the positional cosFormer included), with a gate and a carried state, forward and gradients, in fp64."""
    args, kw = _linear_call(dict(feature_map=name, gate="g", state=False), torch.float64)
    kw["normalize"] = name not in ("identity", "magnitude_direction")   # signed weights: the plain sum
    check_equal(monkeypatch, linattn.linear_attention, args, kw)
    kw.pop("output_final_state")
    o1, st = linattn.linear_attention(*(x[:, :5] for x in args), backend="torch", output_final_state=True,
                                      **{**kw, "g": kw["g"][:, :5]})
    kw2 = {**kw, "g": kw["g"][:, 5:], "initial_state": st}
    check_equal(monkeypatch, linattn.linear_attention, tuple(x[:, 5:] for x in args), kw2)


@pytest.mark.parametrize("op", ["linear", "delta", "kda", "rwkv7"])
def test_single_token_on_fla(monkeypatch, op):
    """T = 1 (a decoding step), from a carried state."""
    if op == "linear":
        args, kw = _linear_call(dict(feature_map="elu+1", gate="g", state=True), torch.float64)
        args, kw["g"] = tuple(x[:, :1] for x in args), kw["g"][:, :1]
        fn = linattn.linear_attention
    elif op == "rwkv7":
        args = tuple(x[:, :1] for x in _rwkv7_inputs(torch.float64))
        kw, fn = dict(initial_state=torch.randn(2, 2, 4, 3, dtype=torch.float64), output_final_state=True), \
            linattn.rwkv7
    else:
        args, kw = _delta_call(dict(gate="g" if op == "delta" else "gk", state=True), torch.float64)
        args, kw["g"] = tuple(x[:, :1] for x in args), kw["g"][:, :1]
        fn = linattn.delta_rule
    for mode in ("chunk", "recurrent"):
        check_equal(monkeypatch, fn, args, {**kw, "mode": mode}, grad=mode == "chunk" or op == "linear")


def test_normaliser_without_gate_is_a_running_sum(monkeypatch):
    """No gate: fla's kernel gets v as it is (den is a running key sum); with a gate, v and a ones column."""
    from tests.fla import standins

    widths = []

    def chunk_simple_gla(q, k, v, **kw):
        widths.append(v.shape[-1])
        return standins.chunk_simple_gla(q, k, v, **kw)

    for gate, width in ((None, 3), ("g", 4)):
        args, kw = _linear_call(dict(feature_map="elu+1", gate=gate, state=True), torch.float64)
        widths.clear()
        with fla_backend_on_cpu(monkeypatch, fp64=True, replace={"fla.ops.simple_gla.chunk_simple_gla":
                                                                 chunk_simple_gla}):
            linattn.linear_attention(*args, backend="fla", **kw)
        assert widths == [width]
    check_equal(monkeypatch, linattn.linear_attention, args, kw)


def test_auto_does_not_take_fla_under_torch_compile(monkeypatch):
    """fla's functions are torch.compiler.disable'd: auto would break a fullgraph compile, so it skips them."""
    import linattn.fla as lfla
    from linattn.ops import backend

    monkeypatch.setattr(lfla, "unavailable", lambda: None)
    monkeypatch.setattr(backend, "available", lambda: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    choice = backend.choose_backend("auto", _FakeCuda())
    assert choice.backend == "triton" and "torch.compile" in choice.reason



@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("variant", ["plain", "no-gate", "window", "varlen", "scale"])
def test_forgetting_attention_equals_torch(monkeypatch, variant, dtype):
    """forgetting_attention on fla's parallel_forgetting_attn: outputs and every gradient."""
    B = 1 if variant == "varlen" else 2
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(B, 11, 2, 4, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))
    g = None if variant == "no-gate" else (-torch.rand(B, 11, 2, generator=gen, dtype=torch.float64)).to(dtype)
    kw = dict(block_size=4)
    if variant == "window":
        kw["window"] = 3
    if variant == "varlen":
        kw["cu_seqlens"] = torch.tensor([0, 4, 11])
    if variant == "scale":
        kw["scale"] = 0.3

    def op(q, k, v, *rest, backend, **kw):
        return linattn.forgetting_attention(q, k, v, rest[0] if rest else None, backend=backend, **kw), None

    args = (q, k, v) if g is None else (q, k, v, g)
    _, calls = check_equal(monkeypatch, op, args, kw)
    assert calls[0][0] == "parallel_forgetting_attn" and "scale" in calls[0][1]


def test_forgetting_attention_uncovered_on_fla(monkeypatch):
    q = k = v = torch.randn(1, 5, 2, 4)
    g = -torch.rand(1, 5, 2)
    with fla_backend_on_cpu(monkeypatch):
        with pytest.raises(BackendUnavailableError, match="decoding state"):
            linattn.forgetting_attention(q, k, v, g, output_final_state=True, backend="fla")
        with pytest.raises(BackendUnavailableError, match="chunk"):
            linattn.forgetting_attention(q, k, v, g, mode="parallel", backend="fla")
        assert linattn.explain("forgetting_attention", q, k, v, g, backend="fla").backend == "fla"
        assert linattn.chunk_size_used("forgetting_attention", q, k, v, g, backend="fla") == 128


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("variant", ["plain", "no-gate", "varlen", "scale"])
def test_path_attention_equals_torch(monkeypatch, variant, dtype):
    """path_attention on fla's parallel_path_attn (whose kernel scales the gate with the scores: the adapter
    divides it by the scale first): outputs and every gradient."""
    B, T, H, K = (1 if variant == "varlen" else 2), 9, 2, 16
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, T, H, K, generator=gen, dtype=torch.float64).to(dtype) for _ in range(3))
    w = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64), dim=-1).to(dtype)
    beta = (2 * torch.rand(B, T, H, generator=gen, dtype=torch.float64)).to(dtype)
    kw = dict(block_size=4)
    if variant != "no-gate":
        kw["g"] = (-torch.rand(B, T, H, generator=gen, dtype=torch.float64)).to(dtype)
    if variant == "varlen":
        kw["cu_seqlens"] = torch.tensor([0, 4, 9])
    if variant == "scale":
        kw["scale"] = 0.7

    def op(*args, backend, **kw):
        return linattn.path_attention(*args, backend=backend, **kw), None

    _, calls = check_equal(monkeypatch, op, (q, k, v, w, beta), kw)
    assert calls[0][0] == "parallel_path_attn"


def test_path_attention_head_sizes_on_fla(monkeypatch):
    q = k = v = w = torch.randn(1, 5, 2, 8)
    with fla_backend_on_cpu(monkeypatch):
        with pytest.raises(BackendUnavailableError, match="head sizes K, V in"):
            linattn.path_attention(q, k, v, w, torch.rand(1, 5, 2), backend="fla")


# ------------------------------------------------------------- fla's refusal of gated chunk backwards (#640)

REFUSED = "fla-core 0.6.0 refuses the backward of its gated chunk kernels here (stand-in reason, fla issue #640)"


@pytest.mark.parametrize("dtype, HV, gate, expected", DELTA_ROUTES)
def test_gated_backward_refusal_routes_delta_calls(monkeypatch, dtype, HV, gate, expected):
    """Where fla-core refuses its gated chunk kernels' backward (Hopper with Triton >= 3.4, < 3.7.1: it raises from
    inside the backward pass, after the forward ran), a call that needs gradients and would take such a kernel is
    not fla's: backend='fla' raises before anything runs, naming the reason (auto takes the next backend: the
    same `fla_unsupported`); the forward alone, and the kernels whose backward fla keeps, still run on fla."""
    import linattn.fla as lfla

    monkeypatch.setattr(lfla, "gated_backward_refused", lambda: REFUSED)
    args, kw = _delta_call(dict(HV=HV, gate=gate) if HV else dict(gate=gate), dtype)
    args[0].requires_grad_()
    with fla_backend_on_cpu(monkeypatch) as calls:
        if expected in lfla.GATED_BACKWARD_KERNELS:
            with pytest.raises(BackendUnavailableError, match="#640") as err:
                linattn.delta_rule(*args, backend="fla", **kw)
            assert not calls and "backend='auto'" in str(err.value)
        else:
            linattn.delta_rule(*args, backend="fla", **kw)
            assert calls[-1][0] == expected
        with torch.no_grad():
            linattn.delta_rule(*args, backend="fla", **kw)
        assert calls[-1][0] == expected
        args[0].requires_grad_(False)   # no input needs a gradient: fla's forward is all that runs
        linattn.delta_rule(*args, backend="fla", **kw)
        assert calls[-1][0] == expected


@pytest.mark.parametrize("gate, refused", [(None, False), ("g", True), ("gamma", False), ("gk", False)])
def test_gated_backward_refusal_routes_linear_calls(monkeypatch, gate, refused):
    """The same for linear attention: only a per-head gate tensor reaches fla's gated chunk_bwd_dqkwg (a constant
    gamma without a gradient is fla's g_gamma; per-feature gates are chunk_gla's own backward)."""
    import linattn.fla as lfla

    monkeypatch.setattr(lfla, "gated_backward_refused", lambda: REFUSED)
    q, k, v = _linear_inputs(torch.float32)
    kw = _gate(gate, torch.float32, *q.shape)
    q.requires_grad_()
    with fla_backend_on_cpu(monkeypatch) as calls:
        if refused:
            with pytest.raises(BackendUnavailableError, match="#640"):
                linattn.linear_attention(q, k, v, feature_map="elu+1", backend="fla", **kw)
            with pytest.raises(BackendUnavailableError, match="#640"):
                linattn.explain("linear_attention", q, k, v, feature_map="elu+1", backend="fla", **kw)
        else:
            linattn.linear_attention(q, k, v, feature_map="elu+1", backend="fla", **kw)
        with torch.no_grad():
            linattn.linear_attention(q, k, v, feature_map="elu+1", backend="fla", **kw)
        assert calls[-1][0] == ("chunk_gla" if gate == "gk" else "chunk_simple_gla")
        assert linattn.explain("linear_attention", q.detach(), k, v, feature_map="elu+1", backend="fla",
                               **kw).backend == "fla"


@pytest.mark.parametrize("hopper, above_340, above_371, tilelang, dispatch_off", [
    (True, True, False, False, False),    # H100 / H200 with Triton 3.4-3.7.0 (torch 2.11's 3.6.0): refused
    (True, True, False, True, False),     # ... with tilelang, which fla dispatches the call to
    (True, True, False, True, True),      # ... tilelang installed but FLA_DISABLE_BACKEND_DISPATCH=1: refused
    (True, True, True, False, False),     # Triton >= 3.7.1
    (True, False, False, False, False),   # Triton < 3.4
    (False, True, False, False, False),   # not Hopper
])
def test_gated_backward_refused_reads_fla_flags(monkeypatch, hopper, above_340, above_371, tilelang, dispatch_off):
    """`gated_backward_refused` follows fla-core's own flags and its tilelang backend's availability (fla's
    objects, patched here since this machine is no Hopper GPU), checked once and cached."""
    import fla.utils
    from fla.ops.common.backends.tilelang import CommonTileLangBackend

    import linattn.fla as lfla

    monkeypatch.setattr(lfla, "_GATED_BACKWARD", None)
    monkeypatch.setattr(fla.utils, "IS_NVIDIA_HOPPER", hopper)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_4_0", above_340)
    monkeypatch.setattr(fla.utils, "TRITON_ABOVE_3_7_1", above_371)
    monkeypatch.setattr(CommonTileLangBackend, "can_use", classmethod(lambda cls: tilelang))
    if dispatch_off:
        monkeypatch.setenv("FLA_DISABLE_BACKEND_DISPATCH", "1")
    else:
        monkeypatch.delenv("FLA_DISABLE_BACKEND_DISPATCH", raising=False)
    why = lfla.gated_backward_refused()
    if hopper and above_340 and not above_371 and (dispatch_off or not tilelang):
        assert "#640" in why and "Hopper" in why and "tilelang" in why
    else:
        assert why is None
    monkeypatch.setattr(fla.utils, "IS_NVIDIA_HOPPER", not hopper)   # cached: the flags are read once
    assert lfla.gated_backward_refused() == why
    monkeypatch.setattr(lfla, "unavailable", lambda: "fla-core is not installed")
    monkeypatch.setattr(lfla, "_GATED_BACKWARD", None)
    assert lfla.gated_backward_refused() is None   # (the dispatch names the missing fla-core first)

