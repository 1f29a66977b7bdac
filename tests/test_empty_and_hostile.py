"""Issue 33 (points 4 and 6): every public operator over empty dimensions and hostile values.

An empty dimension gives either the same result in every mode (the right shape, zeros where an output
has entries) or a `LinattnError` that names the dimension, never a raw traceback from inside an op. A
non-finite `scale` is refused by every operator, naming `scale`.
"""
import pytest
import torch

import linattn
from linattn.errors import LinattnError

DIMS = "BTHKV"
BASE = dict(B=2, T=3, H=2, K=4, V=4)


def _inputs(B, T, H, K, V):
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    g = -torch.rand(B, T, H, generator=gen)
    return q, k, v, beta, g


def _pairs(x, n=2):  # [B, T, H, *] -> [B, T, H, n, *]: DeltaProduct's n keys/values per token
    return x.unsqueeze(3).expand(*x.shape[:3], n, *x.shape[3:]).contiguous()


def _lam(q):  # MesaNet's ridge [H, K]
    return torch.ones(q.shape[2], q.shape[3])


# name -> (call(q, k, v, beta, g, mode, **kw), modes, {dim: what an empty dim must raise, matched})
OPS = {
    "linear_attention": (lambda q, k, v, b, g, m, **kw: linattn.linear_attention(q, k, v, mode=m, **kw),
                         ("parallel", "chunk", "recurrent"), {"V": "V >= 1"}),
    "linear_attention_gla": (lambda q, k, v, b, g, m, **kw: linattn.linear_attention(q, k, v, g=g, mode=m, **kw),
                             ("parallel", "chunk", "recurrent"), {"V": "V >= 1"}),
    "delta_rule": (lambda q, k, v, b, g, m, **kw: linattn.delta_rule(q, k, v, b, g=g, mode=m, **kw),
                   ("parallel", "chunk", "recurrent"), {}),
    "delta_rule_efla_l2": (lambda q, k, v, b, g, m, **kw: linattn.delta_rule(q, k, v, b, exact=True, qk_l2norm=True,
                                                                             mode=m, **kw),
                           ("parallel", "chunk", "recurrent"), {}),
    "comba": (lambda q, k, v, b, g, m, **kw: linattn.comba(q, k, v, b, g=g, mode=m, **kw),
              ("parallel", "chunk", "recurrent"), {}),
    "delta_product": (lambda q, k, v, b, g, m, **kw: linattn.delta_product(q, _pairs(k), _pairs(v), _pairs(b), g=g,
                                                                           mode=m, **kw),
                      ("parallel", "chunk", "recurrent"), {}),
    "mesa_net": (lambda q, k, v, b, g, m, **kw: linattn.mesa_net(q, k, v, b, g, _lam(q), mode=m, **kw),
                 ("parallel", "chunk", "recurrent"), {}),
    "mesa_net_exact": (lambda q, k, v, b, g, m, **kw: linattn.mesa_net(q, k, v, b, g, _lam(q), solver="exact", mode=m,
                                                                       **kw),
                       ("parallel", "chunk", "recurrent"), {}),
    "ttt": (lambda q, k, v, b, g, m, **kw: linattn.ttt(q, k, v, b, mini_batch=2, mode=m, **kw),
            ("chunk", "recurrent"), {"V": "V >= 1"}),
    "titans": (lambda q, k, v, b, g, m, **kw: linattn.titans(q, k, v, b, b, b, mini_batch=2, residual=False,
                                                             mode=m, **kw),
               ("chunk", "recurrent"), {"V": "V >= 1"}),
    "forgetting_attention": (lambda q, k, v, b, g, m, **kw: linattn.forgetting_attention(q, k, v, g, mode=m,
                                                                                         block_size=2, **kw),
                             ("parallel", "chunk", "recurrent"), {}),
    "deltaformer": (lambda q, k, v, b, g, m, **kw: linattn.deltaformer(q, k, v, b, mode=m, block_size=2, **kw),
                    ("parallel", "chunk", "recurrent"), {}),
    "path_attention": (lambda q, k, v, b, g, m, **kw: linattn.path_attention(q, k, v, torch.ones_like(q), b, mode=m,
                                                                             block_size=2, **kw),
                       ("parallel", "chunk", "recurrent"), {}),
    "softmax_attention": (lambda q, k, v, b, g, m, **kw: linattn.softmax_attention(q, k, v, **kw),
                          ("parallel",), {}),
}
# every operator refuses T = 0 (nothing to attend to) and K = 0 (no key dimension), except that softmax
# attention defines K = 0: every score is 0, so each output is the mean of the values it sees
REFUSED = {"T": "T must be at least 1", "K": "K >= 1"}


def _expected_error(name, dim):
    if name == "softmax_attention" and dim == "K":
        return None
    return OPS[name][2].get(dim, REFUSED.get(dim))


def _output(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("name", sorted(OPS))
def test_empty_dimension_is_consistent_or_named(name, dim):
    call, modes, _ = OPS[name]
    shape = dict(BASE, **{dim: 0})
    expected = _expected_error(name, dim)
    outputs = []
    for mode in modes:
        q, k, v, b, g = _inputs(**shape)
        if expected is not None:
            with pytest.raises(LinattnError, match=expected):
                call(q, k, v, b, g, mode)
            continue
        q.requires_grad_(True)
        o = _output(call(q, k, v, b, g, mode))
        assert tuple(o.shape) == (shape["B"], shape["T"], shape["H"], shape["V"])
        if o.numel() and o.requires_grad:
            o.sum().backward()   # the empty call is part of the graph like any other
        outputs.append(o.detach())
    for o in outputs[1:]:
        torch.testing.assert_close(o, outputs[0], rtol=0, atol=1e-6)
    if outputs and dim != "K":
        assert outputs[0].numel() == 0   # B, H or V = 0: nothing to compute, and nothing invented
    if outputs and name != "softmax_attention":   # the final states have one layout in every mode
        layouts = {_layout(call(*_inputs(**shape), mode, output_final_state=True)[1]) for mode in modes}
        assert len(layouts) == 1, layouts


def _layout(state):
    if isinstance(state, torch.Tensor):
        return tuple(state.shape)
    if isinstance(state, (tuple, list)):
        return tuple(_layout(x) for x in state)
    return state if state is None or isinstance(state, (int, float)) else type(state).__name__


def test_softmax_attention_with_empty_keys_averages_the_values():
    q, k, v, _, _ = _inputs(1, 4, 1, 0, 3)
    o = linattn.softmax_attention(q, k, v)
    expected = v.cumsum(1) / torch.arange(1, 5).view(1, 4, 1, 1)
    torch.testing.assert_close(o, expected)


@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_ttt_with_no_heads_keeps_the_mini_batch_position(mode):
    q, k, v, b, _ = _inputs(2, 5, 0, 4, 4)
    _, state = linattn.ttt(q, k, v, b, mini_batch=3, mode=mode, output_final_state=True)
    assert state.position == (2, 2)


@pytest.mark.parametrize("mode", ["chunk", "parallel"])
def test_empty_batch_of_the_blockwise_softmax_forms(mode):
    # the case of the issue: forgetting_attention with B = 0 in the chunk form (_flash.py's reshape)
    q, k, v, _, g = _inputs(0, 5, 2, 4, 3)
    o = linattn.forgetting_attention(q, k, v, g, mode=mode, block_size=2)
    assert o.shape == (0, 5, 2, 3)


def test_linear_attention_empty_keys_named_in_every_mode():
    # the case of the issue: K = 0 in chunk mode was a raw reshape error, parallel/recurrent returned zeros
    q, k, v, _, _ = _inputs(2, 3, 2, 0, 4)
    for mode in ("parallel", "chunk", "recurrent"):
        with pytest.raises(LinattnError, match="K >= 1"):
            linattn.linear_attention(q, k, v, mode=mode)


SCALES = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("scale", SCALES, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_non_finite_scale_is_refused(name, scale):
    call, modes, _ = OPS[name]
    q, k, v, b, g = _inputs(**BASE)
    for mode in modes:
        with pytest.raises(LinattnError, match="scale"):
            call(q, k, v, b, g, mode, scale=scale)


@pytest.mark.parametrize("scale", SCALES, ids=["nan", "inf", "-inf"])
def test_non_finite_scale_is_refused_by_the_decoding_steps(scale):
    q, k, v, b, g = _inputs(**BASE)
    with pytest.raises(LinattnError, match="scale"):
        linattn.forgetting_attention_step(q, k, v, g, scale=scale)
    with pytest.raises(LinattnError, match="scale"):
        linattn.deltaformer_step(q, k, v, b, scale=scale)
    with pytest.raises(LinattnError, match="scale"):
        linattn.path_attention_step(q, k, v, torch.ones_like(q), b, scale=scale)


def test_finite_scales_still_work():
    q, k, v, b, g = _inputs(**BASE)
    for scale in (0.0, -0.5, 2, 1e-30):
        o, _ = linattn.delta_rule(q, k, v, b, scale=scale)
        assert torch.isfinite(o).all()


# ---------------------------------------------------------------------------------------------
# Issue 33.6: every exception a user can meet is importable from `linattn` (the README lists them)
# ---------------------------------------------------------------------------------------------

# raised and caught inside `linattn bench gpu` (control flow of its time budget), and inside `linattn serve`
# (turned into the HTTP error a client receives: ApiError, QueueFull's 429), never seen by a Python user
INTERNAL = {"BudgetExceeded", "Terminated", "NotCovered", "ApiError", "QueueFull"}


def _exception_classes_in_src():
    import ast
    import importlib
    from pathlib import Path
    src = Path(linattn.__file__).resolve().parent
    found = {}
    for path in src.rglob("*.py"):
        rel = path.relative_to(src.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_") and node.bases:
                if node.name.endswith(("Error", "Exception")) or node.name in INTERNAL or any(
                        "Error" in ast.unparse(b) or "Exception" in ast.unparse(b) for b in node.bases):
                    found[node.name] = module
    classes = {}
    for name, module in found.items():
        if module.startswith("linattn.hf"):
            continue   # needs transformers; checked below when it is installed
        obj = getattr(importlib.import_module(module), name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            classes[name] = obj
    return classes


def test_every_user_facing_exception_is_exported_and_listed():
    from pathlib import Path

    import linattn.errors as errors_module
    classes = _exception_classes_in_src()
    assert {"CheckpointWriteError", "RunFolderBusy", "TokenizerError", "TrainingDiverged"} <= set(classes)
    public = {n: c for n, c in classes.items() if n not in INTERNAL}
    for name in [n for n, c in vars(errors_module).items() if isinstance(c, type) and issubclass(c, Exception)]:
        assert getattr(linattn, name) is getattr(errors_module, name)
    for name, cls in public.items():
        assert getattr(linattn, name) is cls, name
        assert issubclass(cls, linattn.LinattnError), name
        assert name in linattn.__all__ and name in linattn.ERRORS, name
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    missing = [n for n in linattn.ERRORS if f"`{n}`" not in readme]
    assert not missing, f"README does not list {missing}"


def test_import_linattn_stays_light():
    from tests.helpers import fresh_import_probe

    probe = fresh_import_probe()   # a clean interpreter's sys.modules after `import linattn`, then after more
    heavy = [m for m in ('linattn.checkpoint', 'linattn.vision.train', 'linattn.experiments.common', 'safetensors',
                         'starlette', 'transformers', 'fla') if m in probe["import"]["modules"]]
    assert not heavy, heavy
    assert probe["lock"]["name"] == "RunFolderBusy" and "linattn.training.lock" in probe["lock"]["modules"]


# ---------------------------------------------------------------------------------------------
# Issue 33.4: inputs up to float32's largest values. Where the math has a finite answer that float32 can
# hold, the result matches the fp64 reference; where a quantity inside the computation exceeds the dtype
# (scores q.k, MesaNet's sum of k k^T, TTT's weights), a LinattnError says so instead of inf/NaN or zeros.
# ---------------------------------------------------------------------------------------------

from linattn.ops import reference as ref  # noqa: E402
from linattn.ops.ttt import _ln  # noqa: E402

FMAX = torch.finfo(torch.float32).max


def _small(B=1, T=9, H=2, K=4, V=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, H, D, generator=gen) for D in (K, K, V))
    return q, k, v, torch.rand(B, T, H, generator=gen), -0.1 * torch.rand(B, T, H, generator=gen)


@pytest.mark.parametrize("c", [1e19, 1e30, FMAX / 8])
@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("mode", ["chunk", "recurrent"])
def test_ttt_layer_norm_of_huge_values_matches_fp64(mode, residual, c):
    # LN(z) is scale-invariant, but its variance squared z: for |z| > ~1e19 it overflowed and LN gave 0 or
    # NaN (max relative error 1.0 at c = 1e19 before). q and v scale z without touching the weights' range.
    q, k, v, b, _ = _small()
    for qc, vc in ((q * c if c < 1e37 else q * 1e30, v), (q, v * min(c, 1e30))):
        o, _ = linattn.ttt(qc, k, vc, 0.1 * b, mini_batch=4, residual=residual, mode=mode)
        W0 = (torch.zeros(1, 2, 4, 4, dtype=torch.float64), torch.zeros(1, 2, 4, dtype=torch.float64))
        expected, _, _ = ref.ttt_ref(qc, k, vc, 0.1 * b, W0, mini_batch=4, residual=residual)
        assert torch.isfinite(o).all()
        assert ref.rel_err(o, expected) < 1e-5


def test_layer_norm_scaling_keeps_the_bits_of_ordinary_rows():
    # the rescaling is by powers of two: for rows that never overflowed, LN and 1/sigma have the bits of the
    # plain formula
    z = torch.randn(64, 16, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 15, 64).unsqueeze(1)
    w, b, eps = torch.rand(16) + 0.5, torch.randn(16), 1e-6
    zc = z - z.mean(-1, keepdim=True)
    rstd = torch.rsqrt((zc * zc).mean(-1, keepdim=True) + eps)
    y, zhat, r = _ln(z, w, b, eps)
    assert torch.equal(r, rstd) and torch.equal(zhat, zc * rstd) and torch.equal(y, zc * rstd * w + b)
    y, zhat, r = _ln(torch.full((2, 8), 3e30), w[:8], b[:8], eps)   # equal entries: LN = b, 1/sigma = eps^-1/2
    assert torch.equal(y, b[:8].expand(2, 8)) and torch.allclose(r, torch.full_like(r, eps ** -0.5))


@pytest.mark.parametrize("c", [1e19, 1e30])
@pytest.mark.parametrize("mode", ["parallel", "chunk", "recurrent"])
def test_mesa_cg_with_huge_queries_matches_fp64(mode, c):
    # CG squared its residuals: |q| > ~1e19 overflowed them and CG stopped at once with a wrong x (max
    # relative error 1.0 at c = 1e30 before); x is linear in q, so the rhs is scaled by a power of two
    q, k, v, b, g = _small()
    lam = torch.ones(2, 4)
    o, _ = linattn.mesa_net(q * c, k, v, b, g, lam, mode=mode)
    expected, _ = ref.mesa_net_ref(q * c, k, v, b, g, lam)
    assert torch.isfinite(o).all() and ref.rel_err(o, expected) < 1e-5


OVERFLOWING = {   # finite inputs whose scores, statistics or weights exceed float32 inside the computation
    # feature maps: Taylor-2's x x^T and the squared-Euclidean |x|^2 are features beyond float32; identity's
    # features are finite but q.k is not
    "linear_attention_taylor2": lambda q, k, v, b, g, m: linattn.linear_attention(q, k * 1e20, v, mode=m,
                                                                                  feature_map="taylor2"),
    "linear_attention_sum_sq_euclid": lambda q, k, v, b, g, m: linattn.linear_attention(
        q, k * 1e20, v, mode=m, feature_map="sum_sq_euclid"),
    "linear_attention_identity": lambda q, k, v, b, g, m: linattn.linear_attention(q * 1e20, k * 1e20, v, mode=m,
                                                                                   feature_map="identity"),
    "softmax_attention": lambda q, k, v, b, g, m: linattn.softmax_attention(q * 1e20, k * 1e20, v),
    "forgetting_attention": lambda q, k, v, b, g, m: linattn.forgetting_attention(q * 1e20, k * 1e20, v, g, mode=m),
    "deltaformer": lambda q, k, v, b, g, m: linattn.deltaformer(q, k * 1e20, v, b, mode=m),
    "path_attention": lambda q, k, v, b, g, m: linattn.path_attention(q * 1e20, k * 1e20, v, torch.ones_like(q), b,
                                                                      mode=m),
    "mesa_net": lambda q, k, v, b, g, m: linattn.mesa_net(q, k * 1e20, v, b, g, torch.ones(2, 4), mode=m),
    "mesa_net_exact": lambda q, k, v, b, g, m: linattn.mesa_net(q, k * 1e20, v, b, g, torch.ones(2, 4),
                                                                solver="exact", mode=m),
    "ttt": lambda q, k, v, b, g, m: linattn.ttt(q, k * 1e20, v, b, mini_batch=4, mode=m),
    "titans": lambda q, k, v, b, g, m: linattn.titans(q, k * 1e20, v, b, b, b, mini_batch=4, mode=m),
}


@pytest.mark.parametrize("name,mode", [(n, m) for n in sorted(OVERFLOWING) for m in ("parallel", "chunk", "recurrent")
                                       if not (n in ("ttt", "titans") and m == "parallel")])   # TTT: no parallel
def test_overflow_inside_an_operator_is_a_clear_error(name, mode):
    # before: NaN outputs, or (MesaNet's recurrent form, its H overflowing to inf) silently wrong finite ones
    with pytest.raises(LinattnError, match=r"overflowed torch.float32 .*\|k\| <= \d\.\d+e\+20"):
        OVERFLOWING[name](*_small(), mode)


@pytest.mark.parametrize("name", sorted(OVERFLOWING))
def test_non_finite_inputs_still_pass_through(name):
    # an inf in the inputs is the caller's: no overflow error for it
    q, k, v, b, g = _small()
    v = v.clone()
    v[0, 5, 1, 2] = float("inf")
    scaled = {"linear_attention_taylor2": lambda: linattn.linear_attention(q, k, v, feature_map="taylor2"),
              "linear_attention_sum_sq_euclid": lambda: linattn.linear_attention(q, k, v, feature_map="sum_sq_euclid"),
              "linear_attention_identity": lambda: linattn.linear_attention(q, k, v, feature_map="identity"),
              "softmax_attention": lambda: linattn.softmax_attention(q, k, v),
              "forgetting_attention": lambda: linattn.forgetting_attention(q, k, v, g, mode="chunk"),
              "deltaformer": lambda: linattn.deltaformer(q, k, v, b, mode="chunk"),
              "path_attention": lambda: linattn.path_attention(q, k, v, torch.ones_like(q), b, mode="chunk"),
              "mesa_net": lambda: linattn.mesa_net(q, k, v, b, g, torch.ones(2, 4)),
              "mesa_net_exact": lambda: linattn.mesa_net(q, k, v, b, g, torch.ones(2, 4), solver="exact"),
              "ttt": lambda: linattn.ttt(q, k, v, b, mini_batch=4, residual=False),
              "titans": lambda: linattn.titans(q, k, v, b, b, b, mini_batch=4, residual=False)}
    out = scaled[name]()   # no LinattnError: the inf comes back, wherever the operator's form spreads it
    o = out[0] if isinstance(out, tuple) else out
    assert not torch.isfinite(o).all()


def test_overflow_check_follows_the_checks_level():
    q, k, v, b, g = _small()
    previous = linattn.set_checks("shapes")
    try:
        o = linattn.softmax_attention(q * 1e20, k * 1e20, v)   # no host reads: the NaN comes back as it is
    finally:
        linattn.set_checks(previous)
    assert not torch.isfinite(o).all()
