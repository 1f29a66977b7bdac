"""Cache snapshots record their layout; restore and reorder validate (issue 49.7)."""
from __future__ import annotations

import pytest
import torch

from linattn import LanguageModel, LMConfig
from linattn.errors import LinattnError


def _lm(mixer, d_model=32, vocab=64, seed=0):
    torch.manual_seed(seed)
    return LanguageModel(LMConfig(vocab_size=vocab, d_model=d_model, n_layers=2, n_heads=2, mixer=mixer)).eval()


def _prefilled(model, batch=2, T=6, seed=1):
    torch.manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, T))
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, cache=cache)
    return cache


def test_another_models_snapshot_is_refused_by_a_fresh_cache():
    """Before: a Gated DeltaNet snapshot restored into a softmax model's cache decoded silently wrong."""
    snap = _prefilled(_lm("gated-deltanet")).snapshot()
    for other in (_lm("softmax"), _lm("gated-deltanet", d_model=48)):
        with pytest.raises(LinattnError, match=r"another model: its (mixer|d_model) is"):
            other.new_cache().restore(snap)
    fp64 = _lm("gated-deltanet").double()
    with pytest.raises(LinattnError, match="another model"):
        fp64.new_cache().restore(snap)


def test_own_snapshot_restores_into_a_fresh_cache_and_decodes_the_same():
    model = _lm("gated-deltanet")
    cache = _prefilled(model)
    snap = cache.snapshot()
    assert snap.batch == 2 and snap.model_layout == model.new_cache().model_layout
    nxt = torch.randint(0, 64, (2, 1))
    with torch.no_grad():
        want = model(nxt, cache=cache).logits
        fresh = model.new_cache()
        fresh.restore(snap)
        assert torch.equal(model(nxt, cache=fresh).logits, want)
        same = _lm("gated-deltanet", seed=3).new_cache()  # other weights, same layout: allowed (the layout agrees)
        same.restore(snap)


def test_another_batch_size_is_refused_by_a_cache_holding_states():
    model = _lm("gated-deltanet")
    snap = _prefilled(model, batch=2).snapshot()
    with pytest.raises(LinattnError, match="2 batch rows, this cache 3"):
        _prefilled(model, batch=3).restore(snap)
    _prefilled(model, batch=2, seed=4).restore(snap)  # the same batch: fine


def test_entries_of_another_kind_are_refused_without_a_model_layout():
    """A Cache made directly (no model_layout) still compares the entries it holds."""
    from linattn.layers.cache import Cache

    gdn, soft = _prefilled(_lm("gated-deltanet")), _prefilled(_lm("softmax"))
    for c in (gdn, soft):
        c.model_layout = None
    target = Cache(2)
    target.layers = soft.layers
    with pytest.raises(LinattnError, match="layer 0 .*another model"):
        target.restore(gdn.snapshot())


@pytest.mark.parametrize("index", [torch.tensor([0, 2]), torch.tensor([-1]), torch.tensor([5, 0])])
def test_reorder_refuses_rows_the_cache_lacks(index):
    """Before: an out-of-range row raised torch's raw IndexError from deep inside."""
    cache = _prefilled(_lm("gated-deltanet"), batch=2)
    before = cache.snapshot()
    with pytest.raises(LinattnError, match=r"rows \[.*\] the cache does not have: it holds rows 0\.\.1"):
        cache.reorder(index)
    after = cache.snapshot()
    assert all(torch.equal(a, b) for a, b in zip(_tensors(before), _tensors(after)))  # nothing half-reordered


def _tensors(snap):
    return [v for d in snap.layers for lc in d.values() for v in lc.values() if isinstance(v, torch.Tensor)]


def test_reorder_with_valid_rows_still_works():
    model = _lm("gated-deltanet")
    cache = _prefilled(model, batch=2)
    rows = _tensors(cache.snapshot())
    cache.reorder(torch.tensor([1, 1, 0], dtype=torch.int32))
    got = _tensors(cache.snapshot())
    assert all(torch.equal(g, r[[1, 1, 0]]) for g, r in zip(got, rows) if r.dim() and r.shape[0] == 2)
    with pytest.raises(LinattnError, match="1-D int64"):
        cache.reorder(torch.tensor([0.0]))
