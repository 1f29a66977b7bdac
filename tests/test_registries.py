"""The registries themselves: the mixer listing stays what it was when the registrations moved into the layer
modules (order, names, classes, defaults, descriptions), and registering / unregistering behaves."""
from __future__ import annotations

import json

import pytest
import torch

import linattn
from linattn.errors import ConfigError, LinattnError, LinattnTypeError
from linattn.feature_maps import FeatureMap, ReLU, unregister_feature_map
from linattn.layers import LinearAttention
from linattn.models.registry import build_mixer, mixer_spec, mixers, register_mixer, unregister_mixer
from tests.helpers import FIXTURES

LISTING = FIXTURES / "registry" / "mixers.json"


def mixer_listing():
    """Every registered mixer as plain data (defaults by repr, so a float 1.0 and an int 1 differ)."""
    out = []
    for name in mixers():
        s = mixer_spec(name)
        out.append({"name": name, "cls": f"{s.cls.__module__}.{s.cls.__qualname__}",
                    "defaults": {k: repr(v) for k, v in s.defaults.items()}, "description": s.description,
                    "rope": s.rope_default, "short_conv": s.short_conv_default})
    return out


def test_mixer_listing_is_unchanged():
    """tests/fixtures/registry/mixers.json was written from the registry before the registrations moved out of
    models/registry.py; a deliberate change (a new mixer) updates that file in the same commit."""
    expected = json.loads(LISTING.read_text(encoding="utf-8"))
    got = mixer_listing()
    assert [m["name"] for m in got] == [m["name"] for m in expected]
    for g, e in zip(got, expected):
        assert g == e, g["name"]


@pytest.mark.parametrize("name", ["softmax", "linear-elu+1", "mamba2", "rwkv7"])
def test_mixer_spec_names_its_class(name):
    assert mixer_spec(name).cls.__name__ in {"SoftmaxAttention", "LinearAttention", "Mamba2Block", "RWKV7"}


# -- feature maps -----------------------------------------------------------------------------------------------

class _Cube(FeatureMap):
    """A map only this test registers: phi = relu(x)^3."""
    name = "test-cube"

    def phi(self, x, pos=None):
        return torch.relu(x) ** 3

    psi = phi


@pytest.fixture
def cube_map():
    linattn.register_feature_map("test-cube", _Cube)
    try:
        yield _Cube
    finally:
        unregister_feature_map("test-cube")
        unregister_mixer("linear-test-cube")


def test_a_registered_feature_map_reaches_the_operator_the_layer_and_a_mixer(cube_map):
    """register_feature_map from any module (here a test's): linear_attention, LinearAttention and linear-<name>
    take the name, and the mixer has the defaults of the other linear-<map> mixers."""
    assert "test-cube" in linattn.feature_map_names() and "test-cube" in linattn.feature_maps.FEATURE_MAP_NAMES
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 7, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    o, _ = linattn.linear_attention(q, k, v, feature_map="test-cube", mode="chunk", chunk_size=4)
    o_obj, _ = linattn.linear_attention(q, k, v, feature_map=_Cube(), mode="chunk", chunk_size=4)
    assert torch.equal(o, o_obj)
    assert isinstance(LinearAttention(16, 2, feature_map="test-cube").feature_map, _Cube)
    spec = mixer_spec("linear-test-cube")
    assert spec.cls is LinearAttention and spec.defaults == mixer_spec("linear-relu").defaults | {
        "feature_map": "test-cube"}
    layer = build_mixer("linear-test-cube", 16, 2)
    assert layer(torch.randn(1, 5, 16)).shape == (1, 5, 16)


def test_register_feature_map_checks_its_arguments():
    with pytest.raises(ConfigError, match="already registered"):
        linattn.register_feature_map("relu", ReLU)
    with pytest.raises(ConfigError, match="cls.name"):
        linattn.register_feature_map("other-name", _Cube)
    with pytest.raises(LinattnTypeError, match="FeatureMap subclass"):
        linattn.register_feature_map("test-cube", lambda x: x)
    with pytest.raises(LinattnError, match="unknown feature_map 'nope'.*relu2"):
        linattn.get_feature_map("nope", 4)
    assert "test-cube" not in linattn.feature_map_names()


def test_the_layer_builds_a_named_map_from_its_information():
    """FeatureMap.build(head_dim, max_seq_len=, seed=): cosFormer's horizon is the layer's max_seq_len and FAVOR+'s
    draw its feature_seed (no name branches in the layer)."""
    assert LinearAttention(16, 2, feature_map="cosformer", max_seq_len=77).feature_map.max_len == 77
    assert LinearAttention(16, 2, feature_map="cosformer").feature_map.max_len == 2048   # the layer's default
    assert linattn.get_feature_map("cosformer", 8).max_len == 4096                      # CosFormer's own default
    a, b, c = (LinearAttention(16, 2, feature_map="favor+", feature_seed=s).feature_map for s in (1, 1, 2))
    assert isinstance(a, linattn.FAVORPlus) and a.dim == 8
    assert torch.equal(a.projection, b.projection) and not torch.equal(a.projection, c.projection)
    assert torch.equal(a.projection, linattn.FAVORPlus(8, seed=1).projection)


def test_feature_maps_module_moved_beside_the_operators():
    from linattn import feature_maps as old
    from linattn.ops import feature_maps as new
    for name in old.__all__:
        assert getattr(old, name) is getattr(new, name) or name == "FEATURE_MAP_NAMES", name
    assert old.FEATURE_MAP_NAMES == new.feature_map_names()


# -- bench ops ---------------------------------------------------------------------------------------------------

def test_every_bench_op_runs_at_a_tiny_size():
    """Each registered `bench ops` row builds its inputs, runs every form forward and backward, reports a chunk size
    for its chunk form and a positive flop count: a new BenchOp is exercised here without being named."""
    from linattn.bench import ops as bench
    spec = dict(B=1, T=12, H=2, K=8, V=8, chunk_size=8, seed=0)
    assert "mamba2_ssd" in bench.OP_BY_KEY and "rwkv7" in bench.OP_BY_KEY
    for op in bench.OPS:
        if op.family == "peer" and bench.peer_unavailable(64, op.key):
            continue
        T = 64 if op.family == "peer" else spec["T"]
        for mode in op.modes:
            for ps in ("fwd", "fwdbwd"):
                bench.build_case(op.key, mode, ps, **dict(spec, T=T))()
            C = bench.case_chunk_size(op.key, mode, "fwd", **dict(spec, T=T))
            assert (C is None) == (mode != "chunk" or op.chunk is None), (op.key, mode, C)
            assert bench.flops(op.key, mode, "fwdbwd", 1, T, 2, 8, 8, C or 0) == 3 * bench.flops(
                op.key, mode, "fwd", 1, T, 2, 8, 8, C or 0) > 0, op.key


def test_register_mixer_before_keeps_a_family_together():
    register_mixer("test-before", LinearAttention, {}, "a test mixer", before="gla")
    try:
        names = mixers()
        assert names.index("test-before") == names.index("gla") - 1
        with pytest.raises(ConfigError, match="before="):
            register_mixer("test-before-2", LinearAttention, before="no-such-mixer")
        assert "test-before-2" not in mixers()
    finally:
        unregister_mixer("test-before")
