"""The one-token decoding step of LinearAttention with a log-space feature map (Hadamard Exp, FAVOR+;
layers/fast_decode_log.py): compiled (csrc/linear_log.c) and PyTorch, against the general path (the operator's
recurrent form) and an fp64 copy of the layer; prefill then decode, gates none / RetNet / scalar, RoPE (ELA's own
layer), grouped value heads, magnitudes a linear-space step would overflow at, the state's log-scale in the cache."""
import copy

import pytest
import torch

from linattn.cpu import available
from linattn.layers import LayerCache, fast_decode
from tests.helpers import perturbed_mixer


class FastCount:
    """Counts the calls in which the linear fast step produced the output."""

    def __init__(self, monkeypatch):
        self.n = 0
        inner = fast_decode.STEPS["linear"]

        def counted(layer, x, cache, lins):
            out = inner(layer, x, cache, lins)
            self.n += out is not None
            return out
        monkeypatch.setitem(fast_decode.STEPS, "linear", counted)


def _run(layer, x, prefill, fast):
    """Prefill `prefill` tokens (chunk form), then one token at a time; outputs [B, T, d] and the cache."""
    layer.fast_decode = fast
    cache, outs = LayerCache(), []
    with torch.no_grad():
        if prefill:
            outs.append(layer(x[:, :prefill], cache=cache))
        for t in range(prefill, x.shape[1]):
            outs.append(layer(x[:, t:t + 1], cache=cache))
    return torch.cat(outs, 1), cache


def assert_same_cache(a: LayerCache, b: LayerCache):
    assert set(a) == set(b)
    for key in a:
        va, vb = a[key], b[key]
        ta = [t for t in (va if isinstance(va, tuple) else (va,)) if isinstance(t, torch.Tensor)]
        tb = [t for t in (vb if isinstance(vb, tuple) else (vb,)) if isinstance(t, torch.Tensor)]
        assert len(ta) == len(tb), key
        for x, y in zip(ta, tb):
            assert x.dtype == y.dtype and x.shape == y.shape, key
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)

CASES = [("linear-hadamard_exp", {}), ("linear-favor+", {}), ("ela-hadamard_exp", {}),
         ("linear-hadamard_exp", {"gate": "retnet"}), ("linear-hadamard_exp", {"gate": "scalar", "output_gate": True}),
         ("linear-hadamard_exp", {"short_conv": True, "n_value_heads": 4})]


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-step"])
@pytest.mark.parametrize("name, kw", CASES, ids=[f"{n}-{'-'.join(map(str, k.values())) or 'plain'}" for n, k in CASES])
@pytest.mark.parametrize("prefill", [0, 5])
def test_log_step_equals_the_general_step(name, kw, prefill, compiled, monkeypatch):
    if compiled and not available("linear_log"):
        pytest.skip("no C compiler: the compiled CPU kernels cannot build")
    layer = perturbed_mixer(name, **kw)
    layer.compiled_decode = compiled
    x = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(1))
    count = FastCount(monkeypatch)
    ref, ref_cache = _run(layer, x, prefill, fast=False)
    assert count.n == 0
    got, cache = _run(layer, x, prefill, fast=True)
    assert count.n == x.shape[1] - prefill
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert_same_cache(cache, ref_cache)
    assert cache["state"].log_scale is not None
    layer64 = copy.deepcopy(layer).double()
    exact, _ = _run(layer64, x.double(), prefill, fast=True)
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch-step"])
def test_log_step_at_magnitudes_a_linear_space_step_overflows_at(compiled, monkeypatch):
    """q_d + k_d up to ~200 (e^200: fp32 overflows past e^88): the step keeps the values of the general path on the
    PyTorch forms (kernels switched off for the reference), finite."""
    if compiled and not available("linear_log"):
        pytest.skip("no C compiler")
    layer = perturbed_mixer("linear-hadamard_exp")
    layer.compiled_decode = compiled
    with torch.no_grad():
        layer.q_proj.weight.mul_(80.0)
        layer.k_proj.weight.mul_(80.0)
    x = torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        qmax = layer.q_proj(x).abs().max()
    assert qmax > 100
    monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    ref, ref_cache = _run(layer, x, 3, fast=False)
    monkeypatch.delenv("LINATTN_CPU_KERNELS")
    got, cache = _run(layer, x, 3, fast=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache["state"].log_scale, ref_cache["state"].log_scale)


def test_diagonal_gate_keeps_the_general_path():
    layer = perturbed_mixer("linear-hadamard_exp", gate="diagonal")
    assert layer.fast_step_kind() is None
    with torch.no_grad():
        c = LayerCache()
        layer(torch.randn(1, 2, 32), cache=c)
        layer(torch.randn(1, 1, 32), cache=c)
    assert c.fast is None
