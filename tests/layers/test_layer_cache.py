"""`LayerCache`'s declared fields and its deprecated dict form, and the one walk over states (torch's pytree).

* A third-party mixer written as CONTRIBUTING showed it before the fields (`cache.get("state")`,
  `cache["state"] = ...`, plus an entry of its own name) still decodes exactly (token by token == one
  forward), survives every Cache operation (snapshot, restore, crop, reorder, rows), and warns once.
* Every registered mixer writes the fields, not the dict form: no DeprecationWarning anywhere in decoding.
* The dict names map to the fields ("conv_q" is conv["q"], "conv" is conv["in"]), others to `extra`.
* `map_state` / `flatten_state` see a LayerCache as a node, a per-row int tuple as one leaf."""
import warnings
from typing import NamedTuple

import pytest
import torch

import linattn
import linattn.layers.cache as cache_mod
from linattn.layers.base import AttentionBase
from linattn.layers.cache import Cache, KVCache, LayerCache, flatten_state, map_state, tensor_nbytes
from linattn.models import LanguageModel, LMConfig
from linattn.models.registry import register_mixer, unregister_mixer
from linattn.ops import delta_rule

pytestmark = pytest.mark.usefixtures("one_thread_module")


class DictStyleMixer(AttentionBase):
    """CONTRIBUTING's custom mixer of the dict form, plus an entry under its own name (a step counter per row)."""

    def _mix(self, q, k, v, x, cache, cu_seqlens=None):
        beta = torch.sigmoid(x[..., : self.n_heads])
        o, state = delta_rule(q, k, v, beta, qk_l2norm=True, mode=self._mode(cache, x.shape[1]),
                              initial_state=cache.get("state") if cache is not None else None,
                              output_final_state=cache is not None, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache["state"] = state
            steps = cache.get("steps")
            cache["steps"] = (steps if steps is not None else x.new_zeros(x.shape[0])) + x.shape[1]
        return o


@pytest.fixture
def dict_style_mixer(monkeypatch):
    monkeypatch.setattr(cache_mod, "_dict_access_warned", False)
    register_mixer("test-dict-style", DictStyleMixer, {}, "a third-party mixer of the dict form")
    yield "test-dict-style"
    unregister_mixer("test-dict-style")


def _model(mixer, seed=0):
    torch.manual_seed(seed)
    return LanguageModel(LMConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, mixer=mixer)).eval()


@torch.no_grad()
def test_a_dict_style_mixer_still_decodes_and_warns_once(dict_style_mixer):
    model = _model(dict_style_mixer)
    ids = torch.randint(0, 32, (2, 9))
    full = model(ids).logits
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cache = model.new_cache(rollback=2)
        parts = [model(ids[:, :5], cache=cache).logits] + [model(ids[:, t:t + 1], cache=cache).logits
                                                            for t in range(5, 9)]
    deprecations = [w for w in seen if issubclass(w.category, DeprecationWarning)]
    assert len(deprecations) == 1 and "cache.state" in str(deprecations[0].message)
    assert deprecations[0].filename == __file__   # points at the mixer's line, not at linattn
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
    lc = cache.layers[0]["mixer"]
    assert set(lc.extra) == {"steps"} and lc.extra["steps"].tolist() == [9.0, 9.0]
    assert isinstance(lc.state, torch.Tensor) and lc.state.shape == (2, 2, 8, 8)
    # the extra entry is state like any other: counted, copied, rolled back, reordered, split and merged by rows
    assert lc.nbytes() == tensor_nbytes(lc.state) + tensor_nbytes(lc.extra["steps"]) + tensor_nbytes(lc.conv)
    snap = cache.snapshot()
    cache.crop(8)
    assert cache.layers[0]["mixer"].extra["steps"].tolist() == [8.0, 8.0]
    cache.restore(snap)
    assert cache.layers[0]["mixer"].extra["steps"] is not snap.layers[0]["mixer"].extra["steps"]
    cache.reorder(torch.tensor([1, 0]))
    row = cache.snapshot_rows([1])
    cache.remove_rows([1])
    cache.insert_rows(row)
    assert cache.n_rows == 2 and cache.layers[1]["mixer"].extra["steps"].tolist() == [9.0, 9.0]
    nxt = torch.randint(0, 32, (2, 1))
    ref = model.new_cache()
    model(ids, cache=ref)
    # the rows are now (1, 0) of the original batch: each continues from its own state
    torch.testing.assert_close(model(nxt, cache=cache).logits, model(nxt.flip(0), cache=ref).logits.flip(0),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", linattn.mixers())
@torch.no_grad()
def test_the_library_mixers_write_fields_not_the_dict_form(mixer, monkeypatch):
    monkeypatch.setattr(cache_mod, "_dict_access_warned", False)
    model = _model(mixer)
    ids = torch.randint(0, 32, (1, 6))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        cache = model.new_cache(rollback=1)
        model(ids[:, :4], cache=cache)
        model(ids[:, 4:5], cache=cache)
        model(ids[:, 5:6], cache=cache)
        cache.crop(-1)
        cache.snapshot()
        cache.reorder(torch.tensor([0]))
    lc = cache.layers[0]["mixer"]
    assert not lc.extra and lc.offset == 5
    assert lc.state is not None or isinstance(lc.kv, KVCache)
    assert set(lc.conv) <= {"q", "k", "v", "w", "in"}


def test_the_dict_names_map_to_the_fields(monkeypatch):
    monkeypatch.setattr(cache_mod, "_dict_access_warned", False)
    lc = LayerCache(state=torch.ones(2, 3), conv={"q": torch.zeros(2, 4, 3), "in": torch.zeros(2, 5, 3)})
    with pytest.warns(DeprecationWarning) as seen:
        assert lc["conv_q"] is lc.conv["q"] and lc["conv"] is lc.conv["in"] and lc["state"] is lc.state
    assert seen[0].filename == __file__
    lc["shift"] = torch.ones(2, 7)
    lc["offset"] = 4
    lc["mine"] = (1, 2)
    assert lc.shift.shape == (2, 7) and lc.offset == 4 and lc.extra == {"mine": (1, 2)}
    assert set(lc) == {"state", "shift", "conv_q", "conv", "offset", "mine"} and "kv" not in lc
    assert lc.get("kv") is None and lc.get("conv_v", 3) == 3
    del lc["conv_q"], lc["mine"], lc["shift"]
    assert set(lc.conv) == {"in"} and not lc.extra and lc.shift is None
    with pytest.raises(KeyError):
        lc["kv"]
    old = LayerCache({"state": torch.zeros(1), "conv_k": torch.zeros(1, 2, 3), "offset": 2})
    assert old.conv.keys() == {"k"} and old.offset == 2


def test_one_walk_over_states():
    """A LayerCache is a pytree node: a map rebuilds it (fields, offset; a new, empty fast slot); a tuple of
    per-row ints is one leaf; KVCache a leaf."""
    kv = KVCache(chunk=4)
    kv.append(torch.ones(2, 3, 1, 2), torch.ones(2, 3, 1, 2))
    lc = LayerCache(state=(torch.ones(2, 2), (5, 6), None), conv={"q": torch.ones(2, 3, 1)}, kv=kv,
                    offset=torch.tensor([3, 4]))
    lc.fast = object()
    leaves, _ = flatten_state(lc)
    # (a None inside a state is a leaf; a field that holds nothing is no node)
    assert [type(x).__name__ for x in leaves] == ["Tensor", "tuple", "NoneType", "Tensor", "KVCache", "Tensor"]
    out = map_state(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, lc)
    assert isinstance(out, LayerCache) and out.fast is None and out.kv is kv
    assert out.state[0].sum() == 8 and out.state[1] == (5, 6) and out.offset.tolist() == [6, 8]
    assert tensor_nbytes([lc, {"x": torch.zeros(3)}]) == lc.nbytes() + 12
    assert lc.nbytes() == 4 * (4 + 6) + kv.nbytes()   # the offset is not counted
    cache = Cache(1)
    cache.layers[0]["mixer"] = lc
    cache.reorder(torch.tensor([1]))
    assert cache.layers[0]["mixer"] is lc and lc.state[1] == (6,) and lc.offset.tolist() == [4] and lc.fast is None


@torch.no_grad()
def test_a_dict_style_mixer_through_the_transformers_cache(dict_style_mixer):
    """Its own entry ("steps", in `extra`) travels through transformers' cache layers like the declared fields."""
    pytest.importorskip("transformers")
    from linattn.hf import LinattnForCausalLM

    hf = LinattnForCausalLM.from_linattn(_model(dict_style_mixer)).eval()
    ids = torch.randint(0, 32, (2, 7))
    full = hf(ids).logits
    out = hf(ids[:, :5], use_cache=True)
    pkv = out.cache if "cache" in out else out.past_key_values
    for t in (5, 6):
        out = hf(ids[:, t:t + 1], cache=pkv, use_cache=True)
        torch.testing.assert_close(out.logits[:, -1], full[:, t], rtol=1e-5, atol=1e-5)


class _PairState(NamedTuple):
    kv: torch.Tensor
    z: torch.Tensor


def _trees():
    """LayerCaches of every field kind: a tensor state; a NamedTuple state holding a per-row int tuple and None; conv
    windows; a token shift; a KV cache; `extra` entries that are trees; an int and a per-row offset."""
    kv = KVCache(chunk=4)
    kv.append(torch.randn(2, 3, 1, 2, dtype=torch.float64), torch.randn(2, 3, 1, 2, dtype=torch.float64))
    return [
        LayerCache(state=torch.randn(2, 3), conv={"q": torch.randn(2, 4, 2), "k": torch.randn(2, 4, 2)}, offset=5),
        LayerCache(state=_PairState(torch.randn(2, 2, 2), torch.randn(2, 2)), shift=torch.randn(2, 4),
                   offset=torch.tensor([1, 2])),
        LayerCache(state=(torch.randn(2, 1), (3, 4), None), kv=kv, extra={"steps": (1, 2), "aux": [torch.ones(2)]}),
        LayerCache(),
    ]


def test_the_walk_agrees_with_torchs_tree_map():
    """`map_state` answers leaves and LayerCaches itself (speed): the result, leaf by leaf and field by field, is
    torch's `tree_map` over the registered node, for one tree and for several."""
    import torch.utils._pytree as pytree

    def tag(x, *rest):
        return ("leaf", type(x).__name__, *(type(r).__name__ for r in rest))

    for lc in _trees():
        ours, theirs = map_state(tag, lc), pytree.tree_map(tag, lc, is_leaf=cache_mod.per_row_ints)
        assert flatten_state(ours) == flatten_state(theirs)
        assert flatten_state(map_state(tag, lc, lc)) == flatten_state(
            pytree.tree_map(tag, lc, lc, is_leaf=cache_mod.per_row_ints))
        assert map_state(tag, lc).fast is None and map_state(tag, lc) is not lc
        assert cache_mod._state_leaves(lc) == [x for x in flatten_state(lc.state_fields())[0]]
        assert lc.nbytes() == sum(t.numel() * t.element_size() if isinstance(t, torch.Tensor) else
                                  t.nbytes() if isinstance(t, KVCache) else 0 for t in cache_mod._state_leaves(lc))
    for leaf in (torch.ones(2), None, 3, (1, 2), KVCache()):
        assert map_state(tag, leaf) == tag(leaf)
        assert flatten_state(leaf) == pytree.tree_flatten(leaf, is_leaf=cache_mod.per_row_ints)


def test_the_layout_tells_structures_apart():
    """The layout restore compares sees the fields held, the conv streams, a field's tree structure and the leaves'
    kinds, ranks and dtypes: each change below is a different layout, the same states are the same."""
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    base = cache_mod._layout(LayerCache(state=a, conv={"q": b}))
    assert base == cache_mod._layout(LayerCache(state=b.clone(), conv={"q": a.clone()}, offset=7))
    others = [LayerCache(state=(a,), conv={"q": b}), LayerCache(state=a, conv={"k": b}),
              LayerCache(state=a, shift=b), LayerCache(state=a.double(), conv={"q": b}),
              LayerCache(state=a[0], conv={"q": b}), LayerCache(state=a, conv={"q": b}, extra={"x": b}),
              LayerCache(state=(a, (1, 2)), conv={"q": b})]
    layouts = [cache_mod._layout(lc) for lc in others]
    assert base not in layouts and len(set(map(repr, layouts))) == len(layouts)
    assert cache_mod._layout(LayerCache()) == () and cache_mod._layout(LayerCache(offset=3, extra={})) == ()


def test_a_snapshot_layout_is_the_layout_of_its_states():
    """`CacheSnapshot.layout` (computed when first read) is `layers_layout` of its states."""
    cache = Cache(2)
    for i, lc in enumerate(_trees()[:2]):
        cache.layers[i]["mixer"] = lc
    snap = cache.snapshot()
    assert snap.layout == cache_mod.layers_layout(cache.layers) == cache_mod.layers_layout(snap.layers)
    assert snap.batch == 2
