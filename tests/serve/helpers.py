"""What several serve test modules share: the engine-side event collector, the server in a child process, and the
models of every mixer family that the cache-row and prefix-cache tests run."""
from __future__ import annotations

import os
import threading

import torch

import linattn
from linattn.models import LanguageModel, LMConfig
from linattn.serve.engine import Delta, Failed, Finished
from linattn.serve.process import ServerProcess
from linattn.serve.settings import API_KEY_ENV
from tests.helpers import ROOT

KEY = "test-key-123"
START_S, WAIT_S = 120, 60     # generous: a loaded 2-core machine; only a hang reaches them


class Events:
    """A job's events, collected from the engine's thread."""

    def __init__(self):
        self.items = []
        self.done = threading.Event()

    def __call__(self, event):
        self.items.append(event)
        if isinstance(event, (Finished, Failed)):
            self.done.set()

    def wait(self):
        assert self.done.wait(WAIT_S), "the engine never finished the job"
        return self

    @property
    def text(self):
        return "".join(e.text for e in self.items if isinstance(e, Delta))

    @property
    def end(self):
        return self.items[-1]


class Server(ServerProcess):
    """The server in a child process (linattn.serve.process) with this checkout's src first on its path and no
    API key but the one a test sets; `client()` is the official openai client for it."""

    def __init__(self, args, env=None):
        paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        base = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        super().__init__(args, env={**base, **(env or {}), "PYTHONPATH": os.pathsep.join(paths)},
                         start_timeout=START_S)

    def client(self, key=KEY):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=WAIT_S)


VOCAB, REL_TOL = 64, 1e-5
HYBRIDS = {
    "hybrid:gated-deltanet+softmax": dict(mixer=["gated-deltanet", "softmax"]),
    "hybrid:mamba2+swa4": dict(mixer=["mamba2", "swa"], window=4),
    "hybrid:kda+fox": dict(mixer=["kda", "fox"]),
    "hybrid:ttt-linear+softmax": dict(mixer=["ttt-linear", "softmax"]),
}
CASES = linattn.mixers() + list(HYBRIDS)
PER_TOKEN = {"fox", "deltaformer", "path"}


def make_model(case, seed=0):
    torch.manual_seed(seed)
    extra = HYBRIDS.get(case, {"mixer": case})
    model = LanguageModel(LMConfig(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=2, **extra)).eval()
    for m in model.modules():
        if isinstance(getattr(m, "kv_chunk", None), int):
            m.kv_chunk = 3   # KV caches grow (and a window drops keys) inside the test's lengths
    return model


def close(a, b):
    return (a - b).abs().max().item() <= REL_TOL * max(b.abs().max().item(), 1.0)


def solo(model, ids, steps):
    """Logits after the prompt and after each of `steps` forced tokens, one request alone; and its cache."""
    cache = model.new_cache()
    out = [model(ids[None], cache=cache).logits[0, -1]]
    for t in steps:
        out.append(model(torch.tensor([[t]]), cache=cache).logits[0, -1])
    return out, cache
