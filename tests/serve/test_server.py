"""`linattn serve` as users run it: a subprocess on a free loopback port, a tiny checkpoint made here, the official
`openai` client. Completions and chat, whole and streamed, equal `linattn generate`'s text for the same prompt,
seed and settings; every error status; disconnects cancel; /health answers while requests generate; SIGTERM
drains in-flight requests and exits 0. Every server is stopped by its fixture (SIGTERM, then SIGKILL)."""
from __future__ import annotations

import json
import re
import signal
import time
from contextlib import redirect_stdout
from io import StringIO

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from linattn.cli import main as cli_main  # noqa: E402
from linattn.serve.settings import API_KEY_ENV  # noqa: E402
from tests.helpers import save_tiny_run  # noqa: E402
from tests.serve.helpers import KEY, WAIT_S, Server  # noqa: E402

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
LIMITS = ["--max-concurrent", "2", "--max-queue", "2", "--max-request-bytes", "20000", "--max-prompt-tokens", "200",
          "--max-tokens-limit", "100000", "--threads", "1", "--log-level", "warning"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    save_tiny_run(tmp / "tiny", "def f(x):\n    return x + 1\n héllo wörld ✓\n" * 30, vocab=300)
    (tmp / "chat.jinja").write_text(TEMPLATE)
    return tmp


@pytest.fixture(scope="module")
def server(run_dir):
    s = Server(["--model", str(run_dir / "tiny"), "--chat-template", str(run_dir / "chat.jinja"), *LIMITS],
               env={API_KEY_ENV: KEY})
    yield s
    assert s.stop() == 0


def generate_json(run_dir, prompt, *flags):
    """`linattn generate --json` in this process (one thread, as the server runs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = StringIO()
        with redirect_stdout(out):
            assert cli_main(["generate", "--checkpoint", str(run_dir / "tiny"), "--prompt", prompt, "--json",
                             "--stop-at-eos", *flags]) == 0
        return json.loads(out.getvalue())
    finally:
        torch.set_num_threads(n)


SAMPLING = dict(temperature=0.9, top_p=0.9, seed=3, max_tokens=16)
FLAGS = ["--temperature", "0.9", "--top-p", "0.9", "--top-k", "20", "--seed", "3", "--max-new-tokens", "16"]


def test_models_health_and_loopback_default(server):
    assert server.url.startswith("http://127.0.0.1:")   # no --host: loopback only
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"] == [server.name]
    assert server.client().models.retrieve("tiny").id == "tiny"
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}   # no key needed


def test_completion_equals_linattn_generate(server, run_dir):
    c = server.client()
    for prompt in ("héllo wörld", ""):   # non-ASCII; empty (generation starts at a document boundary)
        want = generate_json(run_dir, prompt, *FLAGS)
        r = c.completions.create(model="tiny", prompt=prompt, extra_body={"top_k": 20}, **SAMPLING)
        assert r.choices[0].text == want["text"]
        assert r.usage.completion_tokens == want["tokens"] and r.usage.prompt_tokens == want["prompt_tokens"]
        assert r.choices[0].finish_reason == ("length" if want["tokens"] == 16 else "stop")
        assert r.id.startswith("cmpl-") and r.model == "tiny" and r.created > 0
        chunks = list(c.completions.create(model="tiny", prompt=prompt, extra_body={"top_k": 20}, stream=True,
                                           stream_options={"include_usage": True}, **SAMPLING))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want["text"]
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want["tokens"]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == r.choices[0].finish_reason


def test_chat_equals_linattn_generate_on_the_templated_prompt(server, run_dir):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def f"}]
    prompt = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages) + "<|assistant|>"
    want = generate_json(run_dir, prompt, *FLAGS)
    c = server.client()
    r = c.chat.completions.create(model="tiny", messages=messages, extra_body={"top_k": 20}, **SAMPLING)
    assert r.choices[0].message.content == want["text"] and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == want["prompt_tokens"] and r.id.startswith("chatcmpl-")
    chunks = list(c.chat.completions.create(model="tiny", messages=messages, extra_body={"top_k": 20}, stream=True,
                                            **SAMPLING))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want["text"]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage is None


def test_logprobs_and_stop(server):
    c = server.client()
    r = c.completions.create(model="tiny", prompt="def", max_tokens=5, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):   # greedy: the chosen token is the likeliest
        assert chosen == pytest.approx(max(top.values()))
    r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    full = c.completions.create(model="tiny", prompt="def", max_tokens=30, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    stop = full[5:8]   # a stop string from the middle of the greedy text
    cut = c.completions.create(model="tiny", prompt="def", max_tokens=30, temperature=0, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="tiny", prompt="def", max_tokens=30, temperature=0, stop=stop, stream=True,
                                    extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in streamed) == cut.choices[0].text


def error_of(call):
    with pytest.raises(openai.APIStatusError) as e:
        call()
    return e.value.status_code, e.value.body


def test_error_statuses_in_openai_format(server):
    c = server.client()
    status, body = error_of(lambda: c.completions.create(model="other", prompt="x", max_tokens=1))
    assert status == 404 and body["param"] == "model" and "tiny" in body["message"]
    status, body = error_of(lambda: server.client(key="wrong").completions.create(model="tiny", prompt="x"))
    assert status == 401 and body["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401            # no key at all
    assert httpx.get(server.url + "/metrics").status_code == 401
    for extra, param in [({"max_tokens": "5"}, "max_tokens"), ({"temperature": -1}, "temperature"),
                         ({"max_tokens": 100001}, "max_tokens"), ({"n": 2}, "n"), ({"stop": 5}, "stop"),
                         ({"logprobs": True}, "logprobs"), ({"seed": 1.5}, "seed"), ({"prompt": "x " * 300}, "prompt"),
                         ({"prompt": {"a": 1}}, "prompt"), ({"top_k": "3"}, "top_k")]:
        status, body = error_of(lambda: c.completions.create(model="tiny", prompt="x", extra_body=extra))
        assert status == 400 and body["param"] == param, (extra, body)
    status, body = error_of(lambda: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": 3}]))
    assert status == 400 and body["param"] == "messages[0].content"
    status, body = error_of(lambda: c.completions.create(model="tiny", prompt="x" * 30000))
    assert status == 413 and "20000" in body["message"]
    headers = {"Authorization": f"Bearer {KEY}"}
    for raw in (b"{bad json", b"[1, 2]", b"\xff\xfe", b"[" * 15000, b'{"prompt": NaN}', b'{"prompt": "\\ud800"}',
                b'{"prompt": "x", "temperature": Infinity}'):
        r = httpx.post(server.url + "/v1/completions", content=raw, headers=headers)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", raw
    r = httpx.post(server.url + "/v1/completions", content=b" " * 30000, headers=headers)   # no Content-Length trust
    assert r.status_code == 413
    r = httpx.get(server.url + "/v1/nothing", headers=headers)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(server.url + "/v1/completions", headers=headers).status_code == 405


def metrics(server):
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {k: float(v) for k, v in re.findall(r"^(linattn_serve_[a-z_]+(?:\{[^}]*\})?) (\S+)$", text, re.M)}


def wait_for(predicate, what):
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_metrics_count_requests_tokens_and_latency(server):
    before = metrics(server)
    r = server.client().completions.create(model="tiny", prompt="def f", max_tokens=5, extra_body={"ignore_eos": True})
    after = metrics(server)

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)

    assert grew("linattn_serve_generation_tokens_total") == 5
    assert grew("linattn_serve_prompt_tokens_total") == r.usage.prompt_tokens
    assert grew('linattn_serve_requests_total{endpoint="/v1/completions",code="200"}') == 1
    assert grew('linattn_serve_request_latency_seconds_count{endpoint="/v1/completions"}') == 1
    assert grew('linattn_serve_time_to_first_token_seconds_count{endpoint="/v1/completions"}') == 1


def test_queue_limit_health_under_load_and_disconnect_cancels(server):
    c = server.client()
    before = metrics(server)["linattn_serve_cancelled_total"]
    long = dict(model="tiny", prompt="def", max_tokens=100000, stream=True, extra_body={"ignore_eos": True})
    streams = [c.completions.create(**long) for _ in range(2)]   # the two generation slots
    try:
        for s in streams:
            next(iter(s))                                          # each is generating
        streams += [c.completions.create(**long) for _ in range(2)]   # the queue's two places
        wait_for(lambda: metrics(server)["linattn_serve_requests_waiting"] == 2, "two requests queued")
        status, body = error_of(lambda: c.completions.create(**long))
        assert status == 429 and "--max-queue 2" in body["message"]
        status, _ = error_of(lambda: c.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                                      "content": "x"}]))
        assert status == 429
        # the event loop answers while both slots generate
        assert httpx.get(server.url + "/health", timeout=WAIT_S).status_code == 200
        assert c.models.list().data[0].id == "tiny"
        m = metrics(server)
        assert m["linattn_serve_requests_running"] == 2
        assert m['linattn_serve_requests_total{endpoint="/v1/completions",code="429"}'] >= 1
    finally:
        for s in streams:
            s.close()   # the client goes away
    wait_for(lambda: metrics(server)["linattn_serve_requests_running"] == 0
             and metrics(server)["linattn_serve_requests_waiting"] == 0, "the closed requests were cancelled")
    assert metrics(server)["linattn_serve_cancelled_total"] - before == 4
    # a non-streaming request whose client times out is cancelled too
    with pytest.raises(openai.APITimeoutError):
        server.client().with_options(timeout=1.0).completions.create(model="tiny", prompt="x", max_tokens=100000,
                                                                     extra_body={"ignore_eos": True})
    wait_for(lambda: metrics(server)["linattn_serve_cancelled_total"] - before == 5, "the timed-out request cancelled")
    assert c.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens <= 2   # still serves


def test_sigterm_drains_in_flight_requests_and_exits_0(run_dir, tmp_path):
    """A finite stream in flight at SIGTERM runs to its end; one that would outlast --drain-timeout is cut there;
    the server then exits 0 and takes no new connection. (The key comes from --api-key-file, not the environment.)"""
    key_file = tmp_path / "key"
    key_file.write_text("file-key\n")
    s = Server(["--model", str(run_dir / "tiny"), "--api-key-file", str(key_file), "--served-model-name", "m",
                *LIMITS, "--drain-timeout", "3"], env={API_KEY_ENV: "ignored"})
    try:
        c = s.client(key="file-key")
        status, body = error_of(lambda: c.chat.completions.create(model="m", messages=[{"role": "user",
                                                                                       "content": "x"}]))
        assert status == 400 and "--chat-template" in body["message"] and "chat_template.jinja" in body["message"]
        endless = c.completions.create(model="m", prompt="x", max_tokens=100000, stream=True,
                                       extra_body={"ignore_eos": True})
        next(iter(endless))
        stream = c.completions.create(model="m", prompt="def", max_tokens=100, stream=True,
                                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)
        s.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)   # the in-flight request runs to its end
        assert rest[-1].usage.completion_tokens == 100
        assert [ch.choices[0].finish_reason for ch in [first, *rest] if ch.choices][-1] == "length"
        assert s.proc.wait(WAIT_S) == 0   # after cutting the endless one at --drain-timeout
        endless.close()
        with pytest.raises(openai.APIConnectionError):
            c.models.list()
    finally:
        s.stop()
