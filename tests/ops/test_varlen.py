"""Every operator's packed-sequence (cu_seqlens) loop is `ops._common.run_varlen` (issue 38), and run_varlen
joins what the forms return: tensors along T, tuples field by field, None kept, states along the sequences."""
import importlib
from typing import NamedTuple

import pytest
import torch

import linattn
from linattn.ops import _common

# the modules (linattn.ops re-exports functions under some of these names)
delta_core, deltaformer, forgetting, linear, mesa, path, softmax, ttt = (
    importlib.import_module(f"linattn.ops.{m}")
    for m in ("delta_core", "deltaformer", "forgetting", "linear", "mesa", "path", "softmax", "ttt"))

B, T, H, K, V = 1, 13, 2, 4, 4
CU = torch.tensor([0, 2, 9, 13])


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, d, generator=g, dtype=torch.float64) for d in (K, K, V))
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    gate = -torch.rand(B, T, H, generator=g, dtype=torch.float64)
    return q, k, v, beta, gate


CALLS = {
    linear: lambda q, k, v, b, g: linattn.linear_attention(q, k, v, cu_seqlens=CU, backend="torch"),
    delta_core: lambda q, k, v, b, g: linattn.delta_rule(q, k, v, b, cu_seqlens=CU, backend="torch"),
    mesa: lambda q, k, v, b, g: linattn.mesa_net(q, k, v, b, g, torch.ones(H, K, dtype=q.dtype), cu_seqlens=CU),
    deltaformer: lambda q, k, v, b, g: linattn.deltaformer(q, k, v, b, cu_seqlens=CU),
    forgetting: lambda q, k, v, b, g: linattn.forgetting_attention(q, k, v, g, cu_seqlens=CU),
    path: lambda q, k, v, b, g: linattn.path_attention(q, k, v, k, b, cu_seqlens=CU),
    ttt: lambda q, k, v, b, g: linattn.ttt(q, k, v, 0.1 * b, mini_batch=4, cu_seqlens=CU),
    softmax: lambda q, k, v, b, g: linattn.softmax_attention(q, k, v, cu_seqlens=CU),
}


@pytest.mark.parametrize("module", list(CALLS), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_packed_sequences_go_through_run_varlen(module, monkeypatch):
    seen = []

    def spy(offsets, fn, *args, **kwargs):
        seen.append(list(offsets))
        return _common.run_varlen(offsets, fn, *args, **kwargs)

    monkeypatch.setattr(module, "run_varlen", spy)
    CALLS[module](*_inputs())
    assert seen == [CU.tolist()]


class _Pair(NamedTuple):
    a: torch.Tensor
    b: object


def test_run_varlen_joins_parts():
    x = torch.arange(2 * 7 * 3).view(1, 2, 7, 3)   # T on dim 2, as in the forms' [B, H, T, D] layout

    def fn(i, s):
        return (x[:, :, s], None, _Pair(x[:, :, s, 0], None)), torch.full((1, 2), i)

    (o, none, pair), states = run = _common.run_varlen([0, 3, 4, 7], fn, dim=2)
    assert torch.equal(o, x) and none is None and isinstance(pair, _Pair)
    assert torch.equal(pair.a, x[..., 0]) and pair.b is None
    assert torch.equal(states, torch.tensor([[0, 0], [1, 1], [2, 2]]))
    assert run[1] is states
    assert _common.run_varlen([0, 7], lambda i, s: (x[:, :, s], 5), list, dim=2)[1] == [5]
    with pytest.raises(TypeError, match="cat_parts"):
        _common.cat_parts([1, 2], 0)
