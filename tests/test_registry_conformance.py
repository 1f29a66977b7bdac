"""Tests derived from the registries: a new operator (`register_op` with an `example` and a `reference`) or a new
feature map (`register_feature_map`) is tested here without being named.

Operators: every form against the fp64 reference (outputs and gradients; T = 13, not a multiple of the chunk 4, and
T = 1); causality (changing tokens t >= 7 leaves outputs before 7 as they were, and moves the later ones); and, for
the operators that carry a state, two calls with the state passed along equal one call, in every form (the softmax
side, whose decoding state is a KV cache kept by its *_step functions, is covered through its mixers' decoding).
Feature maps: linear_attention with the map, normalised and not, without a gate and with a scalar gate (and a
per-feature gate where the reference has per-feature features), in the three forms against `linear_attention_ref`
(outputs and gradients), causality, and a state carried across two calls.
Mixers: every registered mixer, `linear-<map>` ones included, is tested by the suites parametrised over
`linattn.mixers()` (tests/models/test_lm.py, tests/layers/test_common.py, tests/layers/test_state_conformance.py
for decoding, test_poison_causality.py::test_every_mixer_is_bitwise_causal).

Everything runs in fp64 at tiny sizes, so the tolerances are far below any real error.
"""
from __future__ import annotations

import pytest
import torch

from linattn.ops import feature_map_names, get_feature_map, linear_attention, op_names, op_spec
from linattn.ops.reference import diag_features, linear_attention_ref
from linattn.ops.registry import reference_of

pytestmark = pytest.mark.usefixtures("one_thread_module")

B, H, K, V, C, T, CUT = 2, 2, 4, 3, 4, 13, 7
DT = torch.float64
TOL = dict(rtol=1e-9, atol=1e-9)


# -- operators ---------------------------------------------------------------------------------------------------

def _example(name, T_len=T, seed=0):
    return op_spec(name).example(torch.Generator().manual_seed(seed), B, T_len, H, K, V, DT)


def _per_token(x, T_len):
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[:2] == (B, T_len)


def _leaves(args, kwargs):
    return [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _out(r):
    return r[0] if isinstance(r, tuple) else r


def _call(name, form, args, kwargs, **extra):
    spec = op_spec(name)
    kw = dict(kwargs, **extra)
    if form is not None:
        kw["mode"] = form
    if spec.chunk_arg is not None:
        kw[spec.chunk_arg] = C
    return spec.fn(*args, **kw)


def _op_cases(need_state=False):
    return [(n, f) for n in op_names() for f in (op_spec(n).forms or (None,))
            if op_spec(n).example is not None and (op_spec(n).state or not need_state)]


def test_every_operator_brings_an_example_and_a_reference():
    """What makes the tests below cover an operator; one registered without them fails here, not silently."""
    missing = [n for n in op_names() if op_spec(n).example is None or op_spec(n).reference is None]
    assert not missing, f"operators without example= / reference= in register_op: {missing}"
    import linattn
    public = {"linear_attention", "delta_rule", "comba", "delta_product", "rwkv7", "softmax_attention", "mesa_net",
              "ttt", "titans", "forgetting_attention", "deltaformer", "path_attention"}
    assert public <= set(op_names()) and all(callable(getattr(linattn, n)) for n in op_names())


@pytest.mark.parametrize("T_len", [T, 1])
@pytest.mark.parametrize("name,form", _op_cases())
def test_op_form_matches_the_fp64_reference(name, form, T_len):
    args, kwargs = _example(name, T_len)
    for x in _leaves(args, kwargs):
        x.requires_grad_(True)
    o = _out(_call(name, form, args, kwargs))
    ref = _out(reference_of(name)(*args, **kwargs))
    assert o.shape == ref.shape and o.shape[:3] == (B, T_len, H) and o.dtype == DT
    torch.testing.assert_close(o, ref, **TOL)
    w = torch.randn(o.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    leaves = _leaves(args, kwargs)
    grads = torch.autograd.grad((o * w).sum(), leaves, allow_unused=True)
    ref_grads = torch.autograd.grad((ref * w).sum(), leaves, allow_unused=True)
    for i, (x, g, rg) in enumerate(zip(leaves, grads, ref_grads)):
        # an input one side never reads (beta of a single token) has no gradient there: zero
        g, rg = (torch.zeros_like(x) if d is None else d for d in (g, rg))
        torch.testing.assert_close(g, rg, **TOL, msg=lambda m: f"gradient of input {i}: {m}")


@pytest.mark.parametrize("name,form", _op_cases())
def test_op_is_causal(name, form):
    args, kwargs = _example(name)
    o = _out(_call(name, form, args, kwargs))
    noise = torch.Generator().manual_seed(2)

    def later_changed(x):
        if not _per_token(x, T):
            return x
        x = x.clone()
        x[:, CUT:] = x[:, CUT:] * (0.5 + torch.rand(x[:, CUT:].shape, generator=noise, dtype=DT))
        return x
    o2 = _out(_call(name, form, [later_changed(x) for x in args], {k: later_changed(x) for k, x in kwargs.items()}))
    torch.testing.assert_close(o2[:, :CUT], o[:, :CUT], rtol=0, atol=1e-12)
    assert (o2[:, CUT:] - o[:, CUT:]).abs().max() > 1e-6   # the change is visible where it may be


@pytest.mark.parametrize("name,form", _op_cases(need_state=True))
def test_op_state_carries_across_calls(name, form):
    """Split inside a chunk (5) and on a chunk boundary (8); an operator whose mini-batches start at each call
    (TTT, Titans) is split on its mini-batch boundaries only."""
    args, kwargs = _example(name)
    full = _out(_call(name, form, args, kwargs))

    def part(x, a, b):
        return x[:, a:b].contiguous() if _per_token(x, T) else x
    cuts = [c for c in (5, 8) if c % kwargs.get("mini_batch", 1) == 0]
    assert cuts
    for cut in cuts:
        first = {k: part(x, 0, cut) for k, x in kwargs.items()}
        o1, state = _call(name, form, [part(x, 0, cut) for x in args], first, output_final_state=True)
        second = {k: part(x, cut, T) for k, x in kwargs.items()}
        second["initial_state"] = state
        o2 = _out(_call(name, form, [part(x, cut, T) for x in args], second))
        torch.testing.assert_close(torch.cat([o1, o2], 1), full, **TOL, msg=lambda m: f"cut {cut}: {m}")


# -- feature maps --------------------------------------------------------------------------------------------

def _fmap(name):
    return get_feature_map(name, K, max_seq_len=64, seed=1)   # a short horizon, so cosFormer's weights vary


def _has_per_feature_reference(name):
    try:
        diag_features(name, torch.zeros(1, K, dtype=DT), _fmap(name))
        return True
    except KeyError:
        return False


GATES = ("none", "scalar", "diagonal")


def _map_cases():
    return [(n, g) for n in feature_map_names() for g in GATES if g != "diagonal" or _has_per_feature_reference(n)]


def test_maps_without_a_per_feature_reference_say_why():
    """The per-feature (diagonal) gate's reference needs phi = psi and no positions; the maps that lack one are
    exactly those, so no map drops out of the diagonal-gate test for another reason."""
    for name in feature_map_names():
        fm = _fmap(name)
        elementwise_ok = not fm.positional and type(fm).phi is type(fm).psi
        assert _has_per_feature_reference(name) or not elementwise_ok, name


def _map_inputs(name, normalize, gate, T_len=T, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (0.5 * torch.randn(B, T_len, H, K, generator=g, dtype=DT) for _ in range(2))
    if normalize:   # positive inputs: every kernel's weights are then positive and its normaliser far from 0
        q, k = q.abs(), k.abs()
    v = torch.randn(B, T_len, H, V, generator=g, dtype=DT)
    Kf = _fmap(name).feature_dim(K)
    lg = None if gate == "none" else -0.3 * torch.rand(B, T_len, H, *((Kf,) if gate == "diagonal" else ()),
                                                       generator=g, dtype=DT)
    return q, k, v, lg


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("name,gate", _map_cases())
def test_feature_map_forms_match_the_fp64_reference(name, gate, normalize):
    fm = _fmap(name)
    for T_len in (T, 1):
        q, k, v, lg = _map_inputs(name, normalize, gate, T_len)
        for x in (q, k, v):
            x.requires_grad_(True)
        ref = linear_attention_ref(q, k, v, name, normalize=normalize, log_gate=lg, fmap=fm)
        w = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=DT)
        ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
        for form in ("parallel", "chunk", "recurrent"):
            o, _ = linear_attention(q, k, v, feature_map=fm, normalize=normalize, g=lg, mode=form, chunk_size=C)
            torch.testing.assert_close(o, ref, **TOL, msg=lambda m: f"{form} T={T_len}: {m}")
            for x, gr, rg in zip("qkv", torch.autograd.grad((o * w).sum(), (q, k, v)), ref_grads):
                torch.testing.assert_close(gr, rg, **TOL, msg=lambda m: f"{form} T={T_len} d{x}: {m}")


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("name", feature_map_names())
def test_feature_map_is_causal_and_carries_its_state(name, form):
    fm = _fmap(name)
    q, k, v, lg = _map_inputs(name, True, "scalar")
    run = lambda q, k, v, lg, **kw: linear_attention(q, k, v, feature_map=fm, g=lg, mode=form,  # noqa: E731
                                                     chunk_size=C, **kw)
    o, _ = run(q, k, v, lg)
    q2, k2, v2 = (torch.cat([x[:, :CUT], 2 * x[:, CUT:]], 1) for x in (q, k, v))
    o2, _ = run(q2, k2, v2, lg)
    torch.testing.assert_close(o2[:, :CUT], o[:, :CUT], rtol=0, atol=1e-12)
    assert (o2[:, CUT:] - o[:, CUT:]).abs().max() > 1e-6
    a, S = run(*(x[:, :CUT] for x in (q, k, v, lg)), output_final_state=True)
    b, _ = run(*(x[:, CUT:] for x in (q, k, v, lg)), initial_state=S)
    torch.testing.assert_close(torch.cat([a, b], 1), o, **TOL)
