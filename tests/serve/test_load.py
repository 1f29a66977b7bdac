"""The bounded load test (issue 48, point 4): `linattn serve` on loopback with a tiny hybrid checkpoint (gated
DeltaNet + softmax, so batches mix recurrent states with KV caches of different lengths), 8 concurrent clients for a
few seconds, prompts that share long prefixes (prefix cache hits) and differ in length, greedy and seeded sampling.
Every output must equal its request's solo output (nothing lost, nothing crossed) and no request may fail."""
from __future__ import annotations

import json
import random
import urllib.request

import pytest
import torch

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from linattn.bench.serve import check_outputs, run_clients, solo_text  # noqa: E402
from linattn.checkpoint import save_checkpoint  # noqa: E402
from linattn.data.tokenizer import train_tokenizer  # noqa: E402
from linattn.models import LanguageModel  # noqa: E402
from tests.helpers import tiny_model  # noqa: E402
from tests.serve.helpers import Server  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_module")   # the solo references: threads only contend
CLIENTS, DURATION_S = 8, 4.0


@pytest.fixture(scope="module")
def hybrid_run(tmp_path_factory):
    tok = train_tokenizer(["def f(x):\n    return x + 1\n héllo wörld\n" * 30], vocab_size=300)
    torch.manual_seed(0)
    cfg = tiny_model(vocab=tok.vocab_size, mixer=["gated-deltanet", "softmax"], max_seq_len=512)
    model = LanguageModel(cfg).eval()
    run = tmp_path_factory.mktemp("load") / "hybrid"
    save_checkpoint(run, 1, model, model_config=cfg.to_dict(), tokenizer=tok)
    return run, model, tok


def _body(client: int, i: int):
    rng = random.Random(client * 1000 + i)
    shared = [(7 * k) % 250 + 5 for k in range(40)]   # every prompt starts with some of these 40 tokens
    prompt = shared[:rng.choice((8, 16, 24, 40))] + [rng.randrange(5, 255) for _ in range(rng.randrange(1, 12))]
    body = {"prompt": prompt, "max_tokens": rng.randrange(1, 24), "ignore_eos": True}
    if rng.random() < 0.5:
        body.update(temperature=0)
    else:
        body.update(temperature=0.8, seed=rng.randrange(1000))
    return body


def test_eight_clients_get_their_solo_outputs(hybrid_run):
    run, model, tok = hybrid_run
    with Server(["--model", str(run), "--max-concurrent", str(CLIENTS), "--threads", "1", "--prefix-every", "8",
                 "--prefill-chunk", "16", "--log-level", "warning"]) as server:
        result = run_clients(server.url, _body, CLIENTS, DURATION_S)
        with urllib.request.urlopen(server.url + "/metrics", timeout=60) as r:
            metrics = r.read().decode()
    records = result["records"]
    with torch.no_grad():
        summary = check_outputs(records, lambda body: solo_text(model, tok, body))
    assert summary["errors"] == 0, summary["first_errors"]
    assert summary["lost"] == 0 and summary["crossed"] == 0, json.dumps(summary)
    assert len({r["client"] for r in records}) == CLIENTS and len(records) >= 2 * CLIENTS
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line and not line.startswith("#")}
    assert values["linattn_serve_prefix_cache_hits"] > 0
    assert values["linattn_serve_generation_tokens_total"] == sum(r["completion_tokens"] for r in records)
