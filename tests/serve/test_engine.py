"""The serve engine on its own thread: a request's tokens equal `linattn.generate.stream_tokens`'s whatever else
runs beside it; logprobs are the model's; stop strings and split UTF-8 characters; a failing or cancelled request
leaves the others alone; the queue limit."""
from __future__ import annotations

import time

import pytest
import torch

from linattn.generate import stream_tokens
from linattn.models import LanguageModel
from linattn.serve.engine import Delta, Engine, Failed, Job, QueueFull
from tests.helpers import tiny_model
from tests.serve.helpers import WAIT_S, Events

pytestmark = pytest.mark.usefixtures("one_thread_module")


class Scripted(torch.nn.Module):
    """A 'model' whose stream yields fixed tokens, or raises at token `fail_at` for prompts starting with 13."""

    def __init__(self, tokens, fail_at=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.tokens, self.fail_at = tokens, fail_at

    def stream(self, input_ids, max_new_tokens, **kw):
        for i, t in enumerate(self.tokens[:max_new_tokens]):
            if i == self.fail_at and int(input_ids[0]) == 13:
                raise RuntimeError("boom")
            yield t


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    return LanguageModel(tiny_model(vocab=tok.vocab_size)).eval()


def running(engine):
    engine.start()
    return engine


def test_tokens_equal_stream_tokens_while_another_request_runs(model, tok):
    engine = running(Engine(model, tok, max_concurrent=2))
    try:
        jobs = [(Job(tok.encode(p), 12, Events(), temperature=0.9, top_k=20, top_p=0.9, seed=s, ignore_eos=True))
                for p, s in (("def f", 1), ("return x", 2))]
        for j in jobs:
            engine.submit(j)
        for j in jobs:
            j.emit.wait()
    finally:
        engine.stop()   # the references run after: two threads must not run one model at once
    for j in jobs:
        ev = j.emit
        want = list(stream_tokens(model, torch.tensor([j.prompt_ids]), 12, temperature=0.9, top_k=20, top_p=0.9,
                                  seed=j.seed))
        assert ev.text == tok.decode(want, skip_special_tokens=True)
        assert ev.end.reason == "length" and ev.end.usage == {
            "prompt_tokens": len(j.prompt_ids), "completion_tokens": 12, "total_tokens": len(j.prompt_ids) + 12}


def test_logprobs_are_the_models(model, tok):
    engine = running(Engine(model, tok))
    try:
        prompt = tok.encode("def f(x)")
        ev = Events()
        engine.submit(Job(prompt, 6, ev, temperature=0, top_logprobs=3, ignore_eos=True))
        entries = [e for d in ev.wait().items if isinstance(d, Delta) for e in d.logprobs]
        assert len(entries) == 6
        ids = list(prompt)
        with torch.no_grad():
            for e in entries:   # the reference: a whole forward over prompt + tokens so far, no cache
                lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
                assert e["token"] == int(lp.argmax())   # greedy
                assert e["logprob"] == pytest.approx(float(lp[e["token"]]), abs=1e-4)
                top = lp.topk(3)
                assert [t for t, _ in e["top"]] == top.indices.tolist()
                assert [v for _, v in e["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
                ids.append(e["token"])
    finally:
        engine.stop()


def test_stop_string_spanning_tokens_and_split_characters(byte_tok):
    text = "ab日é STOP✓ tail"
    engine = running(Engine(Scripted(byte_tok.encode(text)), byte_tok))
    try:
        ev = Events()
        engine.submit(Job([1], 100, ev, stop=["STOP"]))
        pieces = [e.text for e in ev.wait().items if isinstance(e, Delta)]
        assert "".join(pieces) == "ab日é " and ev.end.reason == "stop"
        assert all("\ufffd" not in p for p in pieces)   # each multi-byte character arrives whole
        assert "日" in pieces and "é" in pieces
        ev = Events()
        engine.submit(Job([1], 5, ev, stop=["b日"]))   # the last token allowed completes the stop string
        assert ev.wait().text == "a" and ev.end.reason == "stop"
        ev = Events()
        engine.submit(Job([1], 3, ev, stop=["zz"]))   # max_tokens in the middle of a character: shown as U+FFFD
        assert ev.wait().text == "ab\ufffd" and ev.end.reason == "length"
    finally:
        engine.stop()


def test_eos_ends_with_stop_unless_ignored(tok):
    eos = tok.eos_id
    engine = running(Engine(Scripted([5, 6, eos, 7, 8]), tok))
    try:
        ev = Events()
        engine.submit(Job([1], 10, ev))
        assert ev.wait().end.reason == "stop" and ev.end.usage["completion_tokens"] == 3
        ev = Events()
        engine.submit(Job([1], 10, ev, ignore_eos=True))
        assert ev.wait().end.reason == "length" and ev.end.usage["completion_tokens"] == 5
    finally:
        engine.stop()


def test_a_failing_request_leaves_the_others_alone(tok):
    engine = running(Engine(Scripted(list(range(40, 60)), fail_at=3), tok, max_concurrent=2))
    try:
        bad, good = Events(), Events()
        engine.submit(Job([13], 20, bad, ignore_eos=True))
        engine.submit(Job([14], 20, good, ignore_eos=True))
        assert isinstance(bad.wait().end, Failed) and "boom" in bad.end.message
        assert good.wait().end.reason == "length" and good.end.usage["completion_tokens"] == 20
        after = Events()
        engine.submit(Job([14], 4, after))   # the engine still serves
        assert after.wait().end.reason == "length"
    finally:
        engine.stop()


def test_cancel_stops_a_request_and_the_queue_limit(model, tok):
    engine = Engine(model, tok, max_concurrent=1, max_queue=1)   # not started: submissions stay queued
    first, second = Events(), Events()
    jobs = [Job(tok.encode("x"), 4000, first, ignore_eos=True), Job(tok.encode("y"), 3, second, ignore_eos=True)]
    for j in jobs:
        engine.submit(j)
    with pytest.raises(QueueFull, match="--max-queue 1"):
        engine.submit(Job([1], 1, Events()))
    assert engine.counts() == {"running": 0, "waiting": 2}
    engine.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while not any(isinstance(e, Delta) for e in list(first.items)):   # wait until the first generates
            assert time.monotonic() < deadline and not first.done.wait(0.01)
        jobs[0].cancel()
        assert second.wait().end.reason == "length"   # runs once the cancelled one leaves its slot
        assert not first.done.is_set() and engine.counts() == {"running": 0, "waiting": 0}
    finally:
        engine.stop()
    with pytest.raises(QueueFull, match="shutting down"):
        engine.submit(Job([1], 1, Events()))


def test_stream_interval_groups_text_after_the_first_piece(tok):
    tokens = tok.encode("def f(x):\n    return x + 1\n")
    engine = running(Engine(Scripted(tokens), tok))
    try:
        every, grouped = Events(), Events()
        engine.submit(Job([1], len(tokens), every))
        engine.submit(Job([1], len(tokens), grouped, stream_interval=3600.0))
        deltas = [e.text for e in grouped.wait().items if isinstance(e, Delta)]
        assert every.wait().text == grouped.text == tok.decode(tokens)
        assert len(deltas) == 2 and deltas[0] == tok.decode(tokens[:1])   # the first at once, the rest at the end
        assert len([e for e in every.items if isinstance(e, Delta)]) == len(tokens)
    finally:
        engine.stop()
