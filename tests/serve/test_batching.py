"""Continuous batching through the engine (issue 48, points 1 and 3): requests that join and leave a running batch
at every step get their solo run's tokens (greedy and seeded sampling) and logprobs within 1e-5; decode steps really
batch the rows; a long prompt is prefilled in chunks between decode steps; concurrent requests on one prefix and a
prefix cache under memory pressure still give every request its own cold result."""
import threading

import pytest
import torch

from linattn.generate import stream_tokens
from linattn.models import LanguageModel
from linattn.serve.engine import Delta, Engine, Job
from tests.helpers import tiny_model
from tests.serve.helpers import Events

pytestmark = pytest.mark.usefixtures("one_thread_module")
HYBRID = dict(mixer=["gated-deltanet", "softmax"])


def make(tok, **kw):
    torch.manual_seed(0)
    return LanguageModel(tiny_model(vocab=tok.vocab_size, max_seq_len=512, **kw)).eval()


def batch_sizes(model):
    """The batch size of every single-token forward the model runs (appended to the returned list)."""
    sizes = []
    model.register_forward_hook(lambda m, a, out: sizes.append(a[0].shape[0]) if a[0].shape[1] == 1 else None)
    return sizes


def solo(model, job):
    return list(stream_tokens(model, torch.tensor([job.prompt_ids]), job.max_tokens, temperature=job.temperature,
                              top_k=job.top_k, top_p=job.top_p, seed=job.seed))


def solo_logprobs(model, prompt, tokens):
    """log_softmax of the logits before each token, from a cold cache decoding token by token."""
    cache = model.new_cache()
    out = model(torch.tensor([prompt]), cache=cache).logits[0, -1]
    rows = []
    for t in tokens:
        rows.append(torch.log_softmax(out.double(), -1))
        out = model(torch.tensor([[t]]), cache=cache).logits[0, -1]
    return rows


def tokens_of(events, tok):
    return [e["token"] for d in events.items if isinstance(d, Delta) for e in d.logprobs]


@pytest.mark.parametrize("mixers", [HYBRID, dict(mixer=["fox", "gla"])], ids=["gdn+softmax", "fox+gla"])
@torch.no_grad()
def test_requests_joining_and_leaving_a_batch_get_their_solo_results(tok, mixers):
    model = make(tok, **mixers)
    sizes = batch_sizes(model)
    texts = ["def f(x):", "return", "x + 1\n    return x", "def", "f(x)", "    return x + 1\ndef f"]
    jobs = [Job(tok.encode(t), 6 + 3 * i, Events(), temperature=0 if i % 2 else 0.8, top_k=20 if i % 3 else None,
                seed=i, ignore_eos=True, top_logprobs=2) for i, t in enumerate(texts)]
    engine = Engine(model, tok, max_concurrent=4, prefill_chunk=4, prefix_every=4)
    n_batches = []
    model.register_forward_hook(lambda *a: n_batches.append(len(engine._batch.batches)))
    engine.start()
    try:
        for j in jobs[:3]:
            engine.submit(j)
        jobs[0].emit.wait()   # the others join while the first ones run and leave
        for j in jobs[3:]:
            engine.submit(j)
        for j in jobs:
            j.emit.wait()
    finally:
        engine.stop()
    if mixers is HYBRID:   # rows at any positions share one batch
        assert max(sizes) >= 3 and max(n_batches) == 1, "the decode steps never batched requests"
    else:                  # FoX's per-token states: rows at other positions decode as batches of their own
        assert max(n_batches) >= 2
    for j in jobs:
        got = tokens_of(j.emit, tok)
        assert got == solo(model, j), j.prompt_ids
        for entry, lp in zip((e for d in j.emit.items if isinstance(d, Delta) for e in d.logprobs),
                             solo_logprobs(model, j.prompt_ids, got)):
            assert abs(entry["logprob"] - float(lp[entry["token"]])) <= 1e-5
            assert [t for t, _ in entry["top"]] == lp.topk(2).indices.tolist()


@torch.no_grad()
def test_a_long_prompt_is_prefilled_between_decode_steps(tok):
    model = make(tok, **HYBRID)
    engine = Engine(model, tok, prefill_chunk=8, prefix_cache_bytes=0)
    engine.start()
    try:
        short = Job(tok.encode("def f"), 200, Events(), temperature=0, ignore_eos=True)
        engine.submit(short)
        while not short.emit.items:
            assert not short.emit.done.wait(0.01)
        long_prompt = [5 + i % 200 for i in range(160)]
        marks = []   # short's token count when the long request is submitted and when it emits its first text
        long_events = Events()
        first = threading.Event()

        def on_long(e):
            if not first.is_set():
                marks.append(len(short.emit.items))
                first.set()
            long_events(e)

        marks.append(len(short.emit.items))
        engine.submit(Job(long_prompt, 3, on_long, temperature=0, ignore_eos=True))
        long_events.wait()
        short.cancel()
    finally:
        engine.stop()
    # 160 tokens in chunks of 8: 20 steps, each of which also decoded a token of the short request (its text
    # events: one per token here, but for a token that ends inside a character)
    assert marks[1] - marks[0] >= 160 // 8 - 3


@torch.no_grad()
def test_concurrent_requests_on_one_prefix_and_a_cache_under_pressure(tok):
    model = make(tok, **HYBRID)
    base = tok.encode("def f(x):\n    return x + 1\n" * 3)
    engine = Engine(model, tok, max_concurrent=8, prefill_chunk=8, prefix_every=8)
    entry = None
    engine.start()
    try:
        same = [Job(base, 8, Events(), temperature=0, ignore_eos=True, top_logprobs=0) for _ in range(4)]
        longer = [Job(base + base[:k], 8, Events(), temperature=0, ignore_eos=True, top_logprobs=0)
                  for k in (1, 5, 9)]
        for j in same + longer:
            engine.submit(j)
        got = [tokens_of(j.emit.wait(), tok) for j in same + longer]
        stats = engine.prefix_cache.stats()
        assert stats["hits"] >= 1 and stats["hit_tokens"] >= len(base)
        assert len(set(engine.prefix_cache.keys())) == len(engine.prefix_cache)   # one entry per prefix
        entry = engine.prefix_cache.lookup(base)
    finally:
        engine.stop()   # the references run after: two threads must not run one model at once
    assert got == [solo(model, j) for j in same + longer]
    # a budget of about two prompts' states: every request still gets its cold result, evictions happen
    engine = Engine(model, tok, max_concurrent=3, prefill_chunk=8, prefix_every=8,
                    prefix_cache_bytes=2 * entry.nbytes + 1)
    engine.start()
    try:
        prompts = [base[:n] + [t] for n in (9, 17, 25) for t in (5, 6)] * 2
        jobs = [Job(p, 5, Events(), temperature=0, ignore_eos=True, top_logprobs=0) for p in prompts]
        for j in jobs:
            engine.submit(j)
        got = [tokens_of(j.emit.wait(), tok) for j in jobs]
        stats = engine.prefix_cache.stats()
        assert stats["evicted"] > 0 and stats["bytes"] <= stats["budget_bytes"]
    finally:
        engine.stop()
    assert got == [solo(model, j) for j in jobs]


@torch.no_grad()
def test_a_failing_request_leaves_the_batch_alone(tok):
    from linattn.serve.engine import Failed

    model = make(tok, **HYBRID)
    engine = Engine(model, tok, max_concurrent=4)
    engine.start()
    try:
        good = Job(tok.encode("def f"), 12, Events(), temperature=0, ignore_eos=True)
        bad_ids = Job([tok.vocab_size + 5], 4, Events(), temperature=0)   # an id the model does not have
        bad_setting = Job(tok.encode("x"), 4, Events(), temperature=-1.0)
        for j in (good, bad_ids, bad_setting):
            engine.submit(j)
        for j in (bad_ids, bad_setting):
            assert isinstance(j.emit.wait().end, Failed)
        assert "temperature" in bad_setting.emit.end.message
        assert good.emit.wait().end.reason == "length"
        assert engine.counts() == {"running": 0, "waiting": 0}
    finally:
        engine.stop()
    assert good.emit.text == tok.decode(solo(model, good))
