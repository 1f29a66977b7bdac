"""The app in this process (httpx's ASGI transport, the official async openai client), for what a real model cannot
be made to do on demand: a generation that fails answers 500 (or an error event when streamed) and the server
goes on serving; and the `linattn serve` command's own errors."""
from __future__ import annotations

import asyncio
import hmac

import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("jinja2")

from linattn.cli import main as cli_main  # noqa: E402
from linattn.serve.app import ServerState, build_app  # noqa: E402
from linattn.serve.chat import load_renderer  # noqa: E402
from linattn.serve.engine import Engine  # noqa: E402
from linattn.serve.metrics import Metrics  # noqa: E402
from linattn.serve.server import build_state, is_loopback  # noqa: E402
from linattn.serve.settings import ServeSettings  # noqa: E402
from tests.helpers import save_tiny_run  # noqa: E402


class FailsOnPrompt13(torch.nn.Module):
    """Yields `tokens` (default 40, 41, ...); raises at the third token when the prompt starts with id 13."""

    def __init__(self, tokens=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.tokens = tokens

    def stream(self, input_ids, max_new_tokens, **kw):
        for i in range(max_new_tokens):
            if i == 2 and int(input_ids[0]) == 13:
                raise RuntimeError("boom")
            if self.tokens is not None and i == len(self.tokens):
                return
            yield 40 + i if self.tokens is None else self.tokens[i]


def app_state(tok, folder, tokens=None, **settings):
    metrics = Metrics()
    return ServerState(engine=Engine(FailsOnPrompt13(tokens), tok, metrics=metrics), tokenizer=tok,
                       vocab_size=tok.vocab_size, settings=ServeSettings(model="m", **settings), model_name="m",
                       render_chat=load_renderer(folder, None, ""), metrics=metrics)


def test_the_api_key_is_compared_in_constant_time(tok, tmp_path, monkeypatch):
    compared = []
    constant_time = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: compared.append((a, b)) or constant_time(a, b))
    state = app_state(tok, tmp_path, api_key="sekrit")

    async def scenario():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            assert (await http.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
            assert (await http.get("/v1/models", headers={"Authorization": "Bearer sekrit"})).status_code == 200
            assert (await http.get("/v1/models", headers={"Authorization": "Basic sekrit"})).status_code == 401
            assert (await http.get("/health")).status_code == 200

    asyncio.run(scenario())
    assert compared[:2] == [(b"wrong", b"sekrit"), (b"sekrit", b"sekrit")]


def test_multibyte_characters_split_across_tokens_stream_whole(byte_tok, tmp_path):
    text = "a日本語✓é!"
    tokens = byte_tok.encode(text)
    assert len(tokens) == len(text.encode("utf-8"))   # one token per byte: every non-ASCII character is split
    state = app_state(byte_tok, tmp_path, tokens=tokens)

    async def scenario():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            c = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
            stream = await c.completions.create(model="m", prompt=[1], max_tokens=100, stream=True)
            return [chunk.choices[0].text async for chunk in stream]

    state.engine.start()
    try:
        pieces = asyncio.run(scenario())
    finally:
        state.engine.stop()
    # whole characters only (the engine emits one per character, tests/serve/test_engine.py; events that queue up
    # behind each other are merged, so how many pieces arrive here depends on timing)
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)


def test_a_failing_generation_is_500_and_the_server_keeps_serving(tok, tmp_path):
    state = app_state(tok, tmp_path)
    metrics = state.metrics

    async def scenario():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            c = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
            with pytest.raises(openai.InternalServerError, match="boom"):
                await c.completions.create(model="m", prompt=[13, 1], max_tokens=5)
            stream = await c.completions.create(model="m", prompt=[13, 1], max_tokens=5, stream=True)
            with pytest.raises(openai.APIError, match="boom"):
                async for _ in stream:
                    pass
            ok = await c.completions.create(model="m", prompt=[14], max_tokens=5)
            assert ok.usage.completion_tokens == 5 and ok.choices[0].finish_reason == "length"

    state.engine.start()
    try:
        asyncio.run(scenario())
    finally:
        state.engine.stop()
    assert 'code="500"' in metrics.render({})


def test_import_linattn_does_not_import_the_web_stack():
    from tests.helpers import fresh_import_probe

    # a clean interpreter after linattn, linattn.serve, linattn.serve.settings, linattn.cli and cli.build_parser()
    mods = fresh_import_probe()["serve"]["modules"]
    assert "linattn.serve.settings" in mods and "linattn.cli" in mods
    assert sorted(m for m in ('starlette', 'uvicorn', 'fastapi', 'jinja2', 'openai', 'httpx') if m in mods) == []


def test_serve_command_errors(tmp_path, capsys):
    save_tiny_run(tmp_path / "run")
    bad_template = tmp_path / "t.jinja"
    bad_template.write_text("{% for %}")
    for argv, words in [(["--model", str(tmp_path / "missing")], "checkpoint not found"),
                        (["--model", str(tmp_path / "run"), "--chat-template", str(tmp_path / "none.jinja")],
                         "--chat-template: no such file"),
                        (["--model", str(tmp_path / "run"), "--chat-template", str(bad_template)], "does not compile"),
                        (["--model", str(tmp_path / "run"), "--max-queue", "-1"], "--max-queue"),
                        (["--model", str(tmp_path / "run"), "--drain-timeout", "nan"], "--drain-timeout"),
                        (["--model", str(tmp_path / "run"), "--port", "70000"], "--port must be in [0, 65535]"),
                        (["--model", str(tmp_path / "run"), "--api-key-file", str(tmp_path / "nokey")],
                         "--api-key-file: cannot read")]:
        assert cli_main(["serve", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "linattn serve" in err and words in err and "Traceback" not in err, err


def test_only_loopback_addresses_count_as_local():
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "192.168.1.2", "example.org"))


def test_the_served_name_is_the_run_folders(tmp_path):
    save_tiny_run(tmp_path / "myrun")
    for model in (tmp_path / "myrun", tmp_path / "myrun" / "step_00000001"):
        state = build_state(ServeSettings(model=str(model)))
        assert state.model_name == "myrun"
        state.engine.stop()
    assert build_state(ServeSettings(model=str(tmp_path / "myrun"), served_model_name="x")).model_name == "x"
