"""The OpenAI API's request fields, checked: `parse_completion` and `parse_chat` turn a JSON body into a
`GenerationRequest` or raise `ApiError` (status, message naming the field, OpenAI's error body).

Accepted beyond OpenAI's fields (as vLLM does): `top_k` (0 or -1 = off) and `ignore_eos`. Fields the server cannot
honour (n > 1, best_of > 1, echo, suffix, penalties, logit_bias, tools, a non-text response_format) are refused
with 400 rather than ignored; fields it has no use for (user, metadata, ...) are ignored.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..errors import LinattnError

MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error"}


class ApiError(LinattnError):
    """An HTTP error in OpenAI's format: {"error": {"message", "type", "param", "code"}}.

    Args:
        status: The HTTP status code.
        message: What is wrong, naming the field.
        param: The request field at fault (None: none).
        code: A short machine-readable code (None: none).
    """

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": _ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """The request limits the server enforces (from `ServeSettings`)."""

    max_prompt_tokens: int = 8192
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256


@dataclass
class GenerationRequest:
    """A checked request: what the engine runs and how the answer is written."""

    kind: str                                  # "completion" | "chat"
    prompt_ids: List[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    top_logprobs: Optional[int] = None         # None: no logprobs
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    model: Optional[str] = None


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code="invalid_value")


def _type_name(v: Any) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                     list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: Dict, name: str, default: float, low: float, high: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not (_is_int(v) or isinstance(v, float)):
        raise bad(name, f"expected a number, got {_type_name(v)}")
    if not (math.isfinite(v) and low <= v <= high):
        raise bad(name, f"must be a finite number in [{low}, {high}], got {v!r}")
    return float(v)


def _int(body: Dict, name: str, default: Optional[int], low: int, high: int) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(name, f"expected an integer, got {_type_name(v)}")
    if not low <= v <= high:
        raise bad(name, f"must be an integer in [{low}, {high}], got {v}")
    return v


def _bool(body: Dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"expected a boolean, got {_type_name(v)}")
    return v


def _stop(body: Dict) -> List[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", f"expected a string or an array of strings, got {_type_name(v)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    if any(s == "" for s in stops):
        raise bad("stop", "a stop string must not be empty")
    return stops


def _refuse_unsupported(body: Dict) -> None:
    """400 for fields whose effect the server cannot give (better than silently answering something else)."""
    if _int(body, "n", 1, 1, 1 << 31) != 1:
        raise bad("n", "only n = 1 is supported (send n requests instead)")
    if _int(body, "best_of", 1, 1, 1 << 31) != 1:
        raise bad("best_of", "only best_of = 1 is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise bad(name, "penalties are not supported (only 0)")
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias", "logit_bias is not supported")
    if _bool(body, "echo"):
        raise bad("echo", "echo is not supported")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "suffix is not supported")
    if body.get("tools") not in (None, []) or body.get("functions") not in (None, []):
        raise bad("tools", "tool calling is not supported")
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("response_format", "only {\"type\": \"text\"} is supported")


def _sampling(body: Dict, kind: str, prompt_ids: List[int], limits: Limits, default_max: int) -> GenerationRequest:
    _refuse_unsupported(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"expected a string, got {_type_name(model)}")
    max_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, max_name, None, 1, 1 << 62)
    if max_tokens is not None and max_tokens > limits.max_tokens_limit:
        raise bad(max_name, f"must be at most {limits.max_tokens_limit} (the server's --max-tokens-limit), "
                            f"got {max_tokens}")
    top_k = _int(body, "top_k", None, -1, 1 << 31)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0.0:
        raise bad("top_p", "must be in (0, 1], got 0")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", f"expected an object, got {_type_name(options)}")
    include_usage = _bool(options or {}, "include_usage")
    if len(prompt_ids) > limits.max_prompt_tokens:
        param = "messages" if kind == "chat" else "prompt"
        raise bad(param, f"the prompt has {len(prompt_ids)} tokens, more than the server's limit of "
                         f"{limits.max_prompt_tokens} (--max-prompt-tokens)")
    return GenerationRequest(
        kind=kind, prompt_ids=prompt_ids, max_tokens=min(default_max, limits.max_tokens_limit)
        if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=None if top_p >= 1.0 else top_p,
        top_k=top_k if top_k and top_k > 0 else None, seed=_int(body, "seed", None, -(1 << 63), (1 << 63) - 1),
        stop=_stop(body), stream=stream, include_usage=stream and include_usage,
        ignore_eos=_bool(body, "ignore_eos"), model=model)


def encode_prompt(tokenizer, text: str, param: str) -> List[int]:
    """`linattn generate`'s prompt ids of `text`; 400 naming `param` for text that is not Unicode (JSON's
    escapes can carry a lone surrogate, which no encoder takes)."""
    from ..generate import prompt_ids

    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(param, "the text is not valid Unicode (it holds a lone surrogate such as \\ud800)") from None
    return prompt_ids(tokenizer, text)


def _prompt_ids(body: Dict, tokenizer, vocab_size: int) -> List[int]:
    """The prompt as token ids: a string, an array of token ids, or an array holding one of those."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        return encode_prompt(tokenizer, p, "prompt")
    if isinstance(p, list) and p and all(_is_int(t) for t in p):
        out_of_range = [t for t in p if not 0 <= t < vocab_size]
        if out_of_range:
            raise bad("prompt", f"token ids must be in [0, {vocab_size}), got {out_of_range[0]}")
        return list(p)
    if p is None:
        raise bad("prompt", "a prompt is required (a string or an array of token ids)")
    if isinstance(p, list) and len(p) != 1 and p and all(isinstance(x, (str, list)) for x in p):
        raise bad("prompt", f"one prompt per request is supported, got {len(p)}")
    raise bad("prompt", f"expected a string or a non-empty array of token ids, got {_type_name(p)}")


def parse_completion(body: Dict, tokenizer, vocab_size: int, limits: Limits) -> GenerationRequest:
    """A `/v1/completions` body, checked (`logprobs` is an int: the alternatives per token)."""
    ids = _prompt_ids(body, tokenizer, vocab_size)
    req = _sampling(body, "completion", ids, limits, default_max=16)
    req.top_logprobs = _int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    return req


def check_messages(messages: Any) -> List[Dict[str, str]]:
    """The chat messages as [{"role", "content": str}] (text parts of a content array joined)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "expected a non-empty array of messages" if isinstance(messages, list)
                  else f"expected an array of messages, got {_type_name(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"expected an object, got {_type_name(m)}")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"expected one of {', '.join(CHAT_ROLES)}, got {role!r}")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise bad(f"{where}.content", "only text parts ({\"type\": \"text\", \"text\": ...}) are supported")
            content = "".join(p["text"] for p in content)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content", f"expected a string or an array of text parts, got {_type_name(content)}")
        out.append({"role": role, "content": content})
    return out


def parse_chat(body: Dict, tokenizer, render, limits: Limits) -> GenerationRequest:
    """A `/v1/chat/completions` body, checked; `render(messages) -> str` applies the chat template (it raises
    ApiError when there is none or the template refuses the messages). `logprobs` is a bool, `top_logprobs`
    the alternatives per token."""
    messages = check_messages(body.get("messages"))
    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad("top_logprobs", "needs logprobs: true")
    _refuse_unsupported(body)   # before rendering: a refused field is named even without a chat template
    req = _sampling(body, "chat", encode_prompt(tokenizer, render(messages), "messages"), limits,
                    limits.default_max_tokens)
    req.top_logprobs = (top or 0) if want_logprobs else None
    return req
