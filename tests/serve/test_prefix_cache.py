"""Exact prefix caching (issue 48, point 3). The tree itself: the longest cached prefix and never another prompt's,
LRU eviction under the budget. Through the scheduler, for every registered mixer and hybrids: a prompt that hits at
any boundary (a state every 4 tokens here) gets the logits of a cold prefill within the conformance suite's tolerance
and decodes on as the cold run; adversarial prompts that share long prefixes only ever get their own prefix's
state."""
import pytest
import torch

from linattn.errors import LinattnError
from linattn.layers.cache import Cache
from linattn.serve.batching import BatchScheduler
from linattn.serve.jobs import Job
from linattn.serve.prefix_cache import PrefixCache
from tests.serve.helpers import CASES, REL_TOL, VOCAB, close, make_model

pytestmark = pytest.mark.usefixtures("one_thread_module")


class _Tok:
    eos_id = 0

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{i}>" for i in ids)


def _snap(n_bytes):
    c = Cache(1)
    c.layer(0, "mixer")["state"] = torch.zeros(n_bytes // 4)
    return c.snapshot()


def test_the_tree_finds_the_longest_own_prefix_only():
    pc = PrefixCache(1 << 20, every=4)
    assert pc.boundaries(9) == [4, 8, 9] and pc.boundaries(8) == [4, 8] and pc.boundaries(3) == [3]
    for ids, tag in (((1, 2, 3, 4), 1.0), ((1, 2, 3, 4, 5, 6), 2.0), ((1, 2, 9), 3.0)):
        pc.insert(list(ids), _snap(16), torch.full((3,), tag))
    assert pc.lookup([1, 2, 3, 4, 5, 6, 7]).logits[0] == 2.0
    assert pc.lookup([1, 2, 3, 4, 5]).logits[0] == 1.0        # (1..6) is not a prefix of it
    assert pc.lookup([1, 2, 3, 4, 6, 6]).logits[0] == 1.0     # differs at the last token of the longer entry
    assert pc.lookup([1, 2, 9]).n_tokens == 3
    assert pc.lookup([1, 2, 3]) is None and pc.lookup([2, 2, 3, 4]) is None and pc.lookup([]) is None
    assert pc.stats()["hits"] == 4 and pc.stats()["misses"] == 3
    with pytest.raises(LinattnError, match="at least one token"):
        pc.insert([], _snap(16), torch.zeros(1))
    for bad in (dict(budget_bytes=-1), dict(budget_bytes=1, every=0)):
        with pytest.raises(LinattnError):
            PrefixCache(**{"budget_bytes": 1, **bad})


def test_lru_eviction_keeps_the_budget_and_the_recently_used():
    one = _snap(400).nbytes() + 4 * 3
    pc = PrefixCache(3 * one, every=4)
    for i in range(3):
        pc.insert([7, i], _snap(400), torch.zeros(3))
    assert pc.lookup([7, 0, 5]) is not None            # [7, 0] is now the most recently used
    pc.insert([7, 3], _snap(400), torch.zeros(3))      # evicts [7, 1], the least recently used
    assert sorted(pc.keys()) == [(7, 0), (7, 2), (7, 3)] and pc.nbytes == 3 * one <= pc.budget_bytes
    assert pc.stats()["evicted"] == 1
    assert not pc.insert([8, 8, 8], _snap(4000), torch.zeros(3))   # larger than the whole budget: not kept
    assert pc.lookup([8, 8, 8]) is None and 8 not in pc._root.children   # and its path pruned
    for i in range(4, 10):
        pc.insert([7, i], _snap(400), torch.zeros(3))
    assert len(pc) == 3 and pc.nbytes <= pc.budget_bytes and pc.stats()["evicted"] == 7


def _prefill(sched, ids):
    """Run a prompt through the scheduler's prefill; (its last logits, its cache, prefix tokens it got)."""
    job = Job(list(ids), 1, lambda e: None, temperature=0, ignore_eos=True)
    sched.add(job)
    r = sched.prefilling[-1]
    before = sched.prefix_cache.counts["hit_tokens"]
    while r.pos < len(ids) or r.cache is None:
        sched._advance_prompt(r)
    sched.prefilling.remove(r)
    return r.logits, r.cache, sched.prefix_cache.counts["hit_tokens"] - before


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_a_hit_continues_as_a_cold_run(case):
    model = make_model(case)
    sched = BatchScheduler(model, _Tok(), PrefixCache(1 << 24, every=4), prefill_chunk=3,
                           count=lambda *a: None, fail=lambda job, e: (_ for _ in ()).throw(e))
    g = torch.Generator().manual_seed(2)
    base = torch.randint(1, VOCAB, (10,), generator=g).tolist()
    other = (base[7] % (VOCAB - 1)) + 1
    # (prompt, the prefix it must hit): a boundary inside, the prompt end, a state-to-state extension, and prompts
    # that share 7 or 9 tokens with a cached one but differ after (they must get the 4- or 8-token state)
    prompts = [(base, 0), (base + [3, 4, 5], 10), (base, 10), (base[:7] + [other, 1, 2], 4),
               (base[:9] + [base[9] % (VOCAB - 1) + 1], 8), (base[:6], 4)]
    for ids, hit in prompts:
        logits, cache, got = _prefill(sched, ids)
        assert got == hit, (case, ids)
        cold = model.new_cache()
        want = model(torch.tensor([ids]), cache=cold).logits[0, -1]
        assert close(logits, want), (case, ids)
        for t in (5, 9):   # decoding on from the hit's state gives the cold run's logits
            a = model(torch.tensor([[t]]), cache=cache).logits[0, -1]
            b = model(torch.tensor([[t]]), cache=cold).logits[0, -1]
            assert (a - b).abs().max().item() <= REL_TOL * max(b.abs().max().item(), 1.0), (case, ids, t)
    # the kept states were never changed by the decoding that followed their hits
    logits, _, got = _prefill(sched, base)
    assert got == 10 and close(logits, model(torch.tensor([base])).logits[0, -1])
