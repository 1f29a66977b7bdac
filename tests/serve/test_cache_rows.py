"""Row-level cache operations (issue 48, point 2): `Cache.snapshot_rows / insert_rows / remove_rows /
rows_mergeable`. For every registered mixer and the conformance suite's hybrids: requests prefilled alone (prompts of
different lengths) joined into one batch and decoded together give each request's solo logits (within the
conformance suite's tolerance); a row taken back out continues as its solo run; removing rows leaves the others
alone; a state of another model or mixer is refused."""
import pytest
import torch

from linattn.errors import LinattnError
from linattn.layers.cache import Cache
from linattn.models import LanguageModel, LMConfig
from tests.serve.helpers import CASES, HYBRIDS, PER_TOKEN, VOCAB, close, make_model, solo

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_rows_joined_into_a_batch_decode_as_alone(case):
    model = make_model(case)
    g = torch.Generator().manual_seed(1)
    lengths = (7, 3, 12)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    steps = torch.randint(0, VOCAB, (len(prompts), 4), generator=g)
    want = [solo(model, p, s.tolist())[0] for p, s in zip(prompts, steps)]
    same_position = model.new_cache()   # rows at one position merge for every mixer
    groups = []                         # (cache, [request]) as the engine builds them: joined where mergeable
    for i, p in enumerate(prompts):
        c = model.new_cache()
        model(p[None], cache=c)
        snap = c.snapshot_rows([0])
        if i == 0:
            same_position.insert_rows(snap)
            same_position.insert_rows(snap)
        for cache, members in groups:
            if cache.rows_mergeable(snap) is None:
                cache.insert_rows(snap)
                members.append(i)
                break
        else:
            cache = model.new_cache()
            cache.insert_rows(snap)
            groups.append((cache, [i]))
    mixers = HYBRIDS.get(case, {"mixer": [case]})["mixer"]
    # per-token states other than a KV cache join only rows at their position; all others share one batch
    assert len(groups) == (len(prompts) if PER_TOKEN & set(mixers) else 1)
    for j in range(steps.shape[1]):
        for cache, members in groups:
            logits = model(steps[members, j:j + 1], cache=cache).logits[:, -1]
            for r, i in enumerate(members):
                assert close(logits[r], want[i][j + 1]), (case, i, j)
        two = model(steps[[0, 0], j:j + 1], cache=same_position).logits[:, -1]
        assert close(two[0], want[0][j + 1]) and close(two[1], want[0][j + 1])
    # a row taken out continues alone as its solo run; removing rows leaves the others
    cache, members = groups[0]
    i = members[-1]
    alone = model.new_cache()
    alone.insert_rows(cache.snapshot_rows([len(members) - 1]))
    cont = [model(torch.tensor([[5]]), cache=c).logits[0, -1] for c in (alone,)]
    ref_cache = solo(model, prompts[i], steps[i].tolist())[1]
    assert close(cont[0], model(torch.tensor([[5]]), cache=ref_cache).logits[0, -1])
    if len(members) > 1:   # the longest row leaves: the others go on as alone, no KV padding is kept for it
        longest = max(range(len(members)), key=lambda r: len(prompts[members[r]]))
        cache.remove_rows([longest])
        rest = [i for r, i in enumerate(members) if r != longest]
        assert cache.n_rows == len(rest)
        logits = model(torch.tensor([[9]] * len(rest)), cache=cache).logits[:, -1]
        for r, i in enumerate(rest):
            ref_cache = solo(model, prompts[i], steps[i].tolist())[1]
            assert close(logits[r], model(torch.tensor([[9]]), cache=ref_cache).logits[0, -1]), (case, i)
        for d in cache.layers:
            kv = d["mixer"].get("kv")
            if kv is not None and kv.window is None:
                assert kv.length == int(torch.as_tensor(d["mixer"].offset).max())


@torch.no_grad()
def test_a_state_of_another_model_or_mixer_is_refused():
    a, b = make_model("gated-deltanet"), make_model("gla")
    wide = LanguageModel(LMConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=2, mixer="gated-deltanet"))
    batch = a.new_cache()
    model_ids = torch.tensor([[1, 2, 3]])
    c = a.new_cache()
    a(model_ids, cache=c)
    batch.insert_rows(c.snapshot_rows([0]))
    for other in (b, wide, LanguageModel(LMConfig(vocab_size=VOCAB, d_model=32, n_layers=3, n_heads=2,
                                                  mixer="gated-deltanet"))):
        oc = other.new_cache()
        other(model_ids, cache=oc)
        snap = oc.snapshot()
        assert batch.rows_mergeable(snap) is not None
        with pytest.raises(LinattnError, match="cannot insert these rows"):
            batch.insert_rows(snap)
    assert batch.n_rows == 1   # a refused insert changes nothing


def test_bad_rows_are_refused():
    model = make_model("gla")
    c = model.new_cache()
    model(torch.tensor([[1, 2]]), cache=c)
    for rows in ([], [1], [-1], [[0]]):
        with pytest.raises(LinattnError, match="rows"):
            c.snapshot_rows(rows)
    with pytest.raises(LinattnError, match="CacheSnapshot"):
        Cache(2).insert_rows(c)
    c.remove_rows([0])
    assert c.n_rows == 0 and c.nbytes() == 0
