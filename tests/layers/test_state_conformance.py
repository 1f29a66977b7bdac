"""Recurrent states under serving schedules: for every registered mixer (new ones
join automatically) and a few hybrids, a random sequence run under many schedules gives the logits of
the one-shot forward: prefill split at arbitrary points, chunks of k tokens, one token at a time,
speculative steps (draft, accept m, crop the rest, continue), a snapshot restored into fresh caches
(prefix caching), and beam reorder. With the CPU fast decode path on (and the compiled CPU kernels,
the default) and off (LINATTN_CPU_KERNELS=0). Tolerance: max abs difference <= 1e-5 of the largest
logit (fp32; `TOL` lists per-mixer exceptions: none needed today). The table of which schedules are
bitwise is in docs/states.md.

Plus the cache's own contract: crop's meaning and its errors, the default cache records nothing, the
rollback window's memory, snapshots that share no tensor with the cache."""
import os
import shutil

import pytest
import torch

import linattn
import linattn.cpu.build as cpu_build
import linattn.cpu.linear as cpu_linear
from linattn.errors import LinattnError, UsageError
from linattn.layers.cache import Cache, CacheSnapshot, KVCache
from linattn.models import LanguageModel, LMConfig

pytestmark = pytest.mark.usefixtures("one_thread_module")   # tiny tensors: threads only contend

VOCAB, T, B = 64, 20, 2
REL_TOL = 1e-5
#: per-mixer relative tolerances where the forms cannot agree to REL_TOL (none needed today)
TOL = {}
#: hybrids: mixer lists and extra config (a memory lobe, MoE, Hyper-Link; a sliding window shorter
#: than the sequence, so its KV cache drops keys and a rollback must keep them)
HYBRIDS = {
    "hybrid:gated-deltanet+softmax+lobe+moe": dict(mixer=["gated-deltanet", "softmax"], memory_lobe="causal",
                                                   ffn="moe", n_experts=3, top_k=2),
    "hybrid:kda+fox+hyperlink": dict(mixer=["kda", "fox"], residual="hyperlink", ffn="none"),
    "hybrid:mamba2+swa4": dict(mixer=["mamba2", "swa"], window=4),
    "hybrid:fox+ttt-linear": dict(mixer=["fox", "ttt-linear"]),
}
CASES = linattn.mixers() + list(HYBRIDS)
HAVE_CC = shutil.which((os.environ.get("CC", "").split() or ["cc"])[0]) is not None


def _config(case: str) -> LMConfig:
    extra = HYBRIDS.get(case, {"mixer": case})
    return LMConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, **extra)


def _model(case: str, fast: bool) -> LanguageModel:
    torch.manual_seed(0)
    model = LanguageModel(_config(case)).eval()
    for m in model.modules():
        if hasattr(m, "fast_decode"):
            m.fast_decode = fast
        if isinstance(getattr(m, "kv_chunk", None), int):
            m.kv_chunk = 3    # the KV cache grows (and a window drops keys) within the sequence
    return model


def _garbage(ids: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """n rejected draft tokens: anything but the true continuation (what a wrong rollback would keep)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (ids.shape[0], n), generator=g)


# -- schedules: each returns the logits of every position of ids, computed with a cache ------------------
def split_prefill(model, ids):
    cache, out = model.new_cache(), []
    for a, b in ((0, 7), (7, 8), (8, 13), (13, T)):
        out.append(model(ids[:, a:b], cache=cache).logits)
    return torch.cat(out, 1)


def chunks_of_5(model, ids):
    cache = model.new_cache()
    return torch.cat([model(ids[:, a:a + 5], cache=cache).logits for a in range(0, T, 5)], 1)


def one_token_at_a_time(model, ids):
    cache = model.new_cache()
    return torch.cat([model(ids[:, t:t + 1], cache=cache).logits for t in range(T)], 1)


def speculative(model, ids, k=3):
    """Prefill, then rounds of: a draft of d <= k tokens whose first m are the true ones (m = 0 included),
    verified in one call; crop back to the accepted prefix (positive and negative crop), continue."""
    cache = model.new_cache(rollback=k)
    out, pos = [model(ids[:, :6], cache=cache).logits], 6
    accepts = [2, 0, 3, 1, 3, 0, 2]
    for r in range(64):
        if pos >= T:
            break
        d = min(k, T - pos)
        m = min(accepts[r % len(accepts)], d)
        draft = torch.cat([ids[:, pos:pos + m], _garbage(ids, d - m, r)], 1)
        logits = model(draft, cache=cache).logits
        assert cache.seen_tokens == pos + d
        cache.crop(pos + m) if r % 2 else cache.crop(-(d - m) if d > m else pos + m)
        assert cache.seen_tokens == pos + m
        out.append(logits[:, :m])
        pos += m
    return torch.cat(out, 1)


def prefix_snapshot(model, ids, P=9):
    """A prefix run once, its snapshot restored into two fresh caches (and into the original one after it
    decoded other tokens): every continuation gives the one-shot logits."""
    a = model.new_cache()
    head = model(ids[:, :P], cache=a).logits
    snap = a.snapshot()
    model(_garbage(ids, 4, 1), cache=a)           # mutates a's states (KV buffers in place) after the snapshot
    tails = []
    for cache in (model.new_cache(), model.new_cache(rollback=2), a):
        cache.restore(snap)
        tails.append(torch.cat([model(ids[:, P:P + 3], cache=cache).logits,
                                model(ids[:, P + 3:], cache=cache).logits], 1))
    # the original cache restored: the same computation from equal states as the fresh one
    torch.testing.assert_close(tails[2], tails[0], rtol=0, atol=0)
    # the rollback cache runs its last tokens one at a time: the one-shot tolerance
    torch.testing.assert_close(tails[1], tails[0], rtol=0, atol=REL_TOL * tails[0].abs().max().item())
    return torch.cat([head, tails[0]], 1)


def beam_reorder(model, ids, P=8):
    """Prefill both rows, keep rows [1, 1] (beam search's index_select), continue: the logits of the
    reordered sequences (the test compares against the one-shot forward of ids[[1, 1]])."""
    cache = model.new_cache(rollback=2)
    head = model(ids[:, :P], cache=cache).logits
    idx = torch.tensor([1, 1])
    cache.reorder(idx)
    ids = ids[idx]
    tail = torch.cat([model(ids[:, P:P + 1], cache=cache).logits, model(ids[:, P + 1:], cache=cache).logits], 1)
    return torch.cat([head[idx], tail], 1)


SCHEDULES = [split_prefill, chunks_of_5, one_token_at_a_time, speculative, prefix_snapshot, beam_reorder]


def _run_schedules(case, fast, monkeypatch):
    if not fast:
        monkeypatch.setenv("LINATTN_CPU_KERNELS", "0")
    model = _model(case, fast)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    results = {}
    with torch.no_grad():
        ref = model(ids).logits
        # the test can fail: another first half moves the second half's logits far beyond the tolerance
        other = torch.cat([_garbage(ids, T // 2, 2), ids[:, T // 2:]], 1)
        moved = (model(other).logits - ref)[:, T // 2:].abs().max() / ref.abs().max()
        assert moved > 100 * TOL.get(case, REL_TOL), f"{case}: the logits hardly depend on earlier tokens ({moved:.1e})"
        for sched in SCHEDULES:
            want = ref[[1, 1]] if sched is beam_reorder else ref
            got = sched(model, ids)
            assert got.shape == want.shape, sched.__name__
            results[sched.__name__] = ((got - want).abs().max() / want.abs().max()).item()
    return results


@pytest.mark.parametrize("fast", [True, False], ids=["fast+kernels", "general-no-kernels"])
@pytest.mark.parametrize("case", CASES)
def test_every_schedule_gives_the_one_shot_logits(case, fast, monkeypatch):
    tol = TOL.get(case, REL_TOL)
    results = _run_schedules(case, fast, monkeypatch)
    bad = {k: v for k, v in results.items() if not v <= tol}
    assert not bad, f"{case}: relative max differences above {tol}: {bad}"


@pytest.mark.skipif(not HAVE_CC or not cpu_build.enabled(),
                    reason="no C compiler, or LINATTN_CPU_KERNELS=0: no compiled CPU kernels")
def test_the_two_variants_do_and_do_not_run_the_compiled_kernels(monkeypatch):
    """The grid's 'fast+kernels' runs really go through a compiled kernel, 'general-no-kernels' never does."""
    calls = []
    for name in ("_fwd", "_forward"):   # (the op, and its body called directly where no graph is kept)
        fn = getattr(cpu_linear, name)
        monkeypatch.setattr(cpu_linear, name, lambda *a, fn=fn, **k: (calls.append(1), fn(*a, **k))[1])
    _run_schedules("linear-elu+1", True, monkeypatch)
    assert calls
    calls.clear()
    _run_schedules("linear-elu+1", False, monkeypatch)
    assert not calls


# -- the cache's contract ------------------------------------------------------------------------------
def _small(mixer="gated-deltanet", **kw):
    torch.manual_seed(0)
    return LanguageModel(LMConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, mixer=mixer, **kw)).eval()


def test_default_cache_records_nothing_and_cannot_crop():
    model = _small()
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        cache = model.new_cache()
        model(ids, cache=cache)
        model(ids[:, :1], cache=cache)
    assert cache.rollback == 0 and cache.history_nbytes() == 0 and cache._history == []
    cache.crop(13)      # keeping every token (or more) changes nothing, as DynamicCache.crop
    cache.crop(100)
    assert cache.seen_tokens == 13
    with pytest.raises(UsageError, match=r"rollback=0.*new_cache\(rollback=k\)"):
        cache.crop(12)


def test_crop_meaning_and_errors():
    model = _small(mixer=["gated-deltanet", "softmax"])
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        ref = model(ids).logits
        cache = model.new_cache(rollback=3)
        model(ids[:, :10], cache=cache)
        cache.crop(-2)                       # negative: remove that many
        assert cache.seen_tokens == 8
        got = model(ids[:, 8:], cache=cache).logits
    torch.testing.assert_close(got, ref[:, 8:], rtol=0, atol=1e-5 * ref.abs().max().item())
    assert cache.seen_tokens == 12
    with pytest.raises(UsageError, match=r"go back 4 tokens.*rollback=3.*back to 9"):
        cache.crop(8)                        # beyond the window
    with pytest.raises(UsageError, match="more tokens than the cache holds"):
        cache.crop(-13)
    with pytest.raises(LinattnError, match="crop takes an int"):
        cache.crop(2.0)
    cache.crop(9)                            # the window's oldest position still works
    assert cache.seen_tokens == 9
    with pytest.raises(LinattnError, match="rollback must be an int >= 0"):
        model.new_cache(rollback=-1)


def test_crop_to_zero_within_the_window_is_an_empty_cache():
    model = _small(mixer="softmax")
    ids = torch.randint(0, VOCAB, (1, 6))
    with torch.no_grad():
        ref = model(ids).logits
        cache = model.new_cache(rollback=4)
        model(_garbage(ids, 3, 0), cache=cache)
        cache.crop(0)
        got = model(ids, cache=cache).logits
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5 * ref.abs().max().item())


def test_rollback_window_memory_is_bounded():
    """A recurrent layer's records: at most k + 1 copies of its state, whatever the length."""
    model = _small()
    with torch.no_grad():
        for n in (8, 30):
            cache = model.new_cache(rollback=3)
            model(torch.randint(0, VOCAB, (1, n)), cache=cache)
            model(torch.randint(0, VOCAB, (1, 1)), cache=cache)
            assert len(cache._history) == 4
            assert cache.history_nbytes() == 4 * cache.nbytes()


def test_sliding_window_keeps_keys_for_a_rollback():
    """swa with window 4 and a 3-token KV growth: without the extra keys a rollback would lose them."""
    model = _small(mixer="swa", window=4)
    for m in model.modules():
        if hasattr(m, "kv_chunk"):
            m.kv_chunk = 3
    ids = torch.randint(0, VOCAB, (1, 16))
    with torch.no_grad():
        ref = model(ids).logits
        cache = model.new_cache(rollback=3)
        out = [model(ids[:, :10], cache=cache).logits]
        model(_garbage(ids, 3, 0), cache=cache)
        kv = cache.layers[0]["mixer"]["kv"]
        assert isinstance(kv, KVCache) and kv.keep_extra == 3
        cache.crop(10)
        out.append(model(ids[:, 10:], cache=cache).logits)
    torch.testing.assert_close(torch.cat(out, 1), ref, rtol=0, atol=1e-5 * ref.abs().max().item())
    kv = KVCache(chunk=2, window=3)
    kv.append(torch.zeros(1, 6, 1, 2), torch.zeros(1, 6, 1, 2))
    kv.append(torch.zeros(1, 3, 1, 2), torch.zeros(1, 3, 1, 2))     # drops: keeps the window's last 2 only
    kv.truncate(6)                      # positions 4 and 5: the window of position 6 is still there
    with pytest.raises(LinattnError, match="cannot cut the KV cache back to position 5"):
        kv.truncate(5)                  # needs position 3, dropped


@pytest.mark.parametrize("mixer", ["gated-deltanet", "linear-elu+1", "softmax", "path", "ttt-mlp"])
def test_snapshot_shares_no_tensor_with_the_cache(mixer):
    model = _small(mixer=mixer)
    ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        cache = model.new_cache()
        model(ids, cache=cache)
        snap = cache.snapshot()
        assert isinstance(snap, CacheSnapshot) and snap.seen_tokens == 7 and snap.nbytes() > 0
        frozen = [[(k, _leaves(v)) for lc in d.values() for k, v in lc.items()] for d in snap.layers]
        frozen = [[(k, [t.clone() for t in ts]) for k, ts in d] for d in frozen]
        live = {t.untyped_storage().data_ptr() for d in cache.layers for lc in d.values() for v in lc.values()
                for t in _leaves(v)}
        mine = {t.untyped_storage().data_ptr() for d in snap.layers for lc in d.values() for v in lc.values()
                for t in _leaves(v)}
        assert not (live & mine)
        for _ in range(3):
            model(torch.randint(0, VOCAB, (1, 1)), cache=cache)
        fresh = model.new_cache()
        fresh.restore(snap)
        model(ids[:, :2], cache=fresh)   # restoring copies again: decoding the restored cache leaves snap alone
    now = [[(k, _leaves(v)) for lc in d.values() for k, v in lc.items()] for d in snap.layers]
    for d0, d1 in zip(frozen, now):
        for (k0, t0), (k1, t1) in zip(d0, d1):
            assert k0 == k1 and all(torch.equal(a, b) for a, b in zip(t0, t1))


def _leaves(v):
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, KVCache):
        return [] if v.k is None else [v.k, v.v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _leaves(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _leaves(x)]
    return []


def test_reorder_selects_every_per_row_entry():
    """Tensors along dim 0, per-row int tuples (TTT's mini-batch position) by row, 0-d tensors and ints kept."""
    cache = Cache(1)
    lc = cache.layer(0, "mixer")
    lc["state"] = (torch.arange(3.0)[:, None], (7, 8, 9), None)
    lc["offset"] = 5
    lc["scalar"] = torch.tensor(2.0)
    cache.reorder(torch.tensor([2, 0, 0]))
    lc = cache.layers[0]["mixer"]
    assert lc["state"][0].flatten().tolist() == [2.0, 0.0, 0.0] and lc["state"][1] == (9, 7, 7)
    assert lc["offset"] == 5 and lc["scalar"].item() == 2.0


def test_caches_that_keep_more_than_their_layers_refuse_state_operations():
    """TLinFormer's cache (token ids, window bookkeeping besides its layers) is not covered: a clear refusal."""
    from linattn.models.tlinformer import TLinFormerCache
    cache = TLinFormerCache(2)
    cache.seen_tokens = 3
    for op, call in [("snapshot", cache.snapshot), ("crop", lambda: cache.crop(1)),
                     ("reorder", lambda: cache.reorder(torch.tensor([0]))),
                     ("restore", lambda: cache.restore(Cache(2).snapshot()))]:
        with pytest.raises(UsageError, match=f"TLinFormerCache does not support {op}"):
            call()


def test_restore_and_reorder_check_their_arguments():
    model = _small()
    cache = model.new_cache()
    with pytest.raises(LinattnError, match="restore takes a CacheSnapshot"):
        cache.restore({})
    with pytest.raises(LinattnError, match="holds 3 layers, this cache 2"):
        cache.restore(Cache(3).snapshot())
    with pytest.raises(LinattnError, match="index must be a 1-D int64 tensor"):
        cache.reorder(torch.tensor([0.0]))
