"""linattn.serve's pieces without a server: request checks (every field's 400), the stop-string matcher, the
UTF-8-safe decoder, the API key's sources, chat templates and the Prometheus text."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("starlette")
pytest.importorskip("jinja2")

from linattn.errors import UsageError  # noqa: E402
from linattn.generate import TextDecoder, prompt_ids  # noqa: E402
from linattn.serve.chat import ChatTemplate, ChatTemplateError, load_renderer  # noqa: E402
from linattn.serve.engine import StopMatcher  # noqa: E402
from linattn.serve.metrics import Metrics  # noqa: E402
from linattn.serve.protocol import ApiError, Limits, parse_chat, parse_completion  # noqa: E402
from linattn.serve.settings import API_KEY_ENV, read_api_key  # noqa: E402


def completion(tok, **body):
    return parse_completion({"prompt": "def", **body}, tok, tok.vocab_size, Limits(100, 50, 20))


def test_defaults_and_values(tok):
    r = completion(tok)
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed, r.stop, r.top_logprobs, r.stream) == \
        (16, 1.0, None, None, None, [], None, False)
    assert r.prompt_ids == prompt_ids(tok, "def")
    r = completion(tok, max_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=-4, stop="x", logprobs=2,
                   stream=True, stream_options={"include_usage": True})
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k, r.seed, r.stop, r.top_logprobs, r.include_usage) == \
        (7, 0.0, 0.5, 3, -4, ["x"], 2, True)
    assert completion(tok, top_k=-1).top_k is None and completion(tok, top_p=1).top_p is None
    assert completion(tok, prompt=[1, 2, 3]).prompt_ids == [1, 2, 3]
    assert completion(tok, prompt=["def"]).prompt_ids == prompt_ids(tok, "def")
    assert completion(tok, prompt="").prompt_ids == [tok.eos_id]   # as `linattn generate`: a document boundary
    assert completion(tok, stream_options={"include_usage": True}).include_usage is False   # only when streaming


@pytest.mark.parametrize("field,value,words", [
    ("max_tokens", "5", "expected an integer, got string"), ("max_tokens", 0, "[1,"), ("max_tokens", 51, "at most 50"),
    ("max_tokens", True, "got boolean"), ("max_tokens", 2.0, "got number"),
    ("temperature", "hot", "expected a number"), ("temperature", -0.1, "[0.0, 2.0]"),
    ("temperature", float("nan"), "finite"), ("top_p", 0, "(0, 1]"), ("top_p", 1.5, "[0.0, 1.0]"),
    ("top_k", -2, "[-1,"), ("top_k", 1.5, "integer"), ("seed", "1", "integer"), ("seed", 1 << 70, "integer in"),
    ("stop", 3, "string or an array"), ("stop", ["a", 1], "string or an array"), ("stop", ["a"] * 5, "at most 4"),
    ("stop", [""], "must not be empty"), ("logprobs", 21, "[0, 20]"), ("logprobs", True, "got boolean"),
    ("stream", "yes", "expected a boolean"), ("stream_options", [], "expected an object"),
    ("n", 2, "only n = 1"), ("best_of", 3, "best_of = 1"), ("presence_penalty", 0.5, "not supported"),
    ("frequency_penalty", "x", "expected a number"), ("logit_bias", {"1": 5}, "not supported"),
    ("echo", True, "not supported"), ("suffix", "x", "not supported"), ("tools", [{}], "not supported"),
    ("response_format", {"type": "json_object"}, "only"), ("model", 3, "expected a string"),
    ("prompt", None, "a prompt is required"), ("prompt", 5, "expected a string"), ("prompt", [], "non-empty"),
    ("prompt", ["a", "b"], "one prompt per request"), ("prompt", [1, 10 ** 6], "token ids must be in"),
    ("prompt", [-1], "token ids must be in"), ("prompt", "a\ud800b", "lone surrogate"),
    ("prompt", "x " * 200, "more than the server's limit of 100"),
])
def test_bad_fields_are_400_naming_the_field(tok, field, value, words):
    with pytest.raises(ApiError) as e:
        completion(tok, **{field: value})
    assert e.value.status == 400 and e.value.param == field and words in e.value.message, e.value.message
    assert e.value.body()["error"]["param"] == field and e.value.body()["error"]["type"] == "invalid_request_error"


def test_chat_messages_and_logprobs(tok):
    seen = []

    def render(messages):
        seen.append(messages)
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    r = parse_chat({"messages": [{"role": "system", "content": "s"},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}],
                    "logprobs": True, "top_logprobs": 3}, tok, render, Limits(100, 50, 20))
    assert seen[-1] == [{"role": "system", "content": "s"}, {"role": "user", "content": "ab"}]
    assert r.prompt_ids == tok.encode("system:s|user:ab") and r.top_logprobs == 3 and r.max_tokens == 20
    assert parse_chat({"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 4}, tok, render,
                      Limits(100, 50, 20)).max_tokens == 4
    assert parse_chat({"messages": [{"role": "user", "content": "a"}], "logprobs": True}, tok, render,
                      Limits(100, 50, 20)).top_logprobs == 0
    for body, param in [({"messages": "hi"}, "messages"), ({"messages": []}, "messages"),
                        ({"messages": [3]}, "messages[0]"), ({"messages": [{"role": "bot", "content": "x"}]},
                                                             "messages[0].role"),
                        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
                        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
                        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs")]:
        with pytest.raises(ApiError) as e:
            parse_chat(body, tok, render, Limits(100, 50, 20))
        assert e.value.status == 400 and e.value.param == param, (body, e.value.message)


def test_stop_matcher_never_emits_part_of_a_stop_string():
    m = StopMatcher(["END", "xyz"])
    assert m.push("abcE") == ("abc", False)      # "E" may start "END"
    assert m.push("N") == ("", False)
    assert m.push("Dtail") == ("", True)         # the stop string spans three pieces: nothing of it shown
    m = StopMatcher(["END"])
    assert m.push("aEN") == ("a", False) and m.push("X") == ("ENX", False)   # not a stop after all: all of it
    assert m.push("xE") == ("x", False) and m.flush() == "E"                  # the end releases what is held
    m = StopMatcher(["ab", "b"])
    assert m.push("cab") == ("c", True)                                       # the earliest stop wins
    assert StopMatcher([]).push("any") == ("any", False)


def test_decoder_holds_a_split_utf8_character_until_whole(byte_tok):
    text = "a日é✓"
    ids = byte_tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))   # one token per byte
    dec = TextDecoder(byte_tok)
    pieces = [dec.push(t) for t in ids]
    assert [p for p in pieces if p] == ["a", "日", "é", "✓"] and "".join(pieces) + dec.flush() == text
    dec = TextDecoder(byte_tok)   # a character cut off at the end shows as the replacement character
    assert "".join(dec.push(t) for t in ids[:2]) + dec.flush() == "a\ufffd"


def test_api_key_from_file_or_environment(tmp_path):
    f = tmp_path / "key"
    f.write_text("s3cret\nsecond line\n")
    assert read_api_key(str(f), {API_KEY_ENV: "env"}) == "s3cret"     # the file wins
    assert read_api_key(None, {API_KEY_ENV: " env "}) == "env"
    assert read_api_key(None, {}) is None
    f.write_text("\n")
    with pytest.raises(UsageError, match="empty"):
        read_api_key(str(f), {})
    with pytest.raises(UsageError, match="cannot read"):
        read_api_key(str(tmp_path / "missing"), {})
    with pytest.raises(UsageError, match=API_KEY_ENV):
        read_api_key(None, {API_KEY_ENV: "  "})


def test_chat_templates(tmp_path, tok):
    t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% endif %}", "t", eos_token="<|endoftext|>")
    assert t.render([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"
    refusing = ChatTemplate("{{ raise_exception('roles must alternate') }}", "t")
    with pytest.raises(ApiError, match="roles must alternate"):
        refusing.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}", "t")
    sandboxed = ChatTemplate("{{ messages.__class__.__mro__ }}", "t")   # the sandbox refuses Python internals
    with pytest.raises(ApiError, match="unsafe"):
        sandboxed.render([])
    step = tmp_path / "run" / "step_1"
    step.mkdir(parents=True)
    no_template = load_renderer(step, None, "")
    with pytest.raises(ApiError) as e:
        no_template([{"role": "user", "content": "x"}])
    assert "--chat-template" in e.value.message and "chat_template.jinja" in e.value.message
    (tmp_path / "run" / "tokenizer_config.json").write_text('{"chat_template": "[{{ messages[0].content }}]"}')
    assert load_renderer(step, None, "")([{"role": "user", "content": "x"}]) == "[x]"   # the run folder's
    (step / "chat_template.jinja").write_text("({{ messages[0].content }})")
    assert load_renderer(step, None, "")([{"role": "user", "content": "x"}]) == "(x)"   # the step folder's first
    own = tmp_path / "own.jinja"
    own.write_text("<{{ messages[0].content }}>{{ eos_token }}")
    assert load_renderer(step, str(own), "E")([{"role": "user", "content": "x"}]) == "<x>E"   # the flag wins


def test_metrics_exposition():
    m = Metrics()
    m.request("/v1/completions", 200)
    m.request("/v1/completions", 200)
    m.request("/v1/completions", 429)
    m.count("generation_tokens", 5)
    for s in (0.001, 0.2, 500.0):
        m.observe("request_latency_seconds", "/v1/completions", s)
    text = m.render({"requests_waiting": ("Queued.", 3)})
    assert 'linattn_serve_requests_total{endpoint="/v1/completions",code="200"} 2' in text
    assert 'linattn_serve_requests_total{endpoint="/v1/completions",code="429"} 1' in text
    assert "linattn_serve_generation_tokens_total 5" in text and "linattn_serve_requests_waiting 3" in text
    buckets = dict(re.findall(r'request_latency_seconds_bucket\{endpoint="/v1/completions",le="([^"]+)"\} (\d+)', text))
    assert (buckets["0.005"], buckets["0.25"], buckets["120.0"], buckets["+Inf"]) == ("1", "2", "2", "3")
    assert 'request_latency_seconds_count{endpoint="/v1/completions"} 3' in text
    for line in text.splitlines():   # every sample line: name{labels} value
        assert line.startswith("# ") or re.fullmatch(r"[a-z_]+(\{[^}]*\})? [0-9.e+-]+", line), line
