"""The HTTP side: a Starlette app with OpenAI's routes, over an `Engine`.

    POST /v1/completions, /v1/chat/completions   JSON answers or server-sent events (stream: true)
    GET  /v1/models, /v1/models/{id}              the one model served
    GET  /health                                  200 {"status": "ok"} (no key needed: for load balancers)
    GET  /metrics                                 Prometheus text

Every error is OpenAI's JSON error body with the status: 400 bad field or malformed JSON, 401 missing or wrong
API key, 404 unknown model or route, 413 body too large, 429 queue full, 500 a generation that failed (only that
request). Generation runs on the engine's thread, so the event loop keeps answering while it works; a request
whose client disconnects is cancelled.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Delta, Engine, Failed, Finished, Job, QueueFull
from .metrics import Metrics
from .protocol import ApiError, GenerationRequest, Limits, parse_chat, parse_completion
from .settings import ServeSettings


@dataclass
class ServerState:
    """What the routes share: the engine, the tokenizer, the settings, the chat renderer, the metrics."""

    engine: Engine
    tokenizer: Any
    vocab_size: int
    settings: ServeSettings
    model_name: str
    render_chat: Callable[[List[Dict[str, str]]], str]
    metrics: Metrics
    created: int = 0


# ------------------------------------------------------------------------------------------------ request reading

def check_api_key(state: ServerState, request: Request) -> None:
    """401 unless the request carries the server's key (compared in constant time); nothing when none is set."""
    key = state.settings.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if not (scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())):
        raise ApiError(401, "missing or wrong API key: send the header `Authorization: Bearer KEY`",
                       code="invalid_api_key")


async def read_json(request: Request, limit: int) -> Dict[str, Any]:
    """The body as a JSON object: 413 past `limit` bytes (read no further), 400 when not a JSON object."""
    too_big = ApiError(413, f"the request body is larger than the server's limit of {limit} bytes "
                            f"(--max-request-bytes)", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_big
    try:
        data = json.loads(bytes(body))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:   # RecursionError: nesting too deep to parse
        raise ApiError(400, f"malformed JSON in the request body: {type(e).__name__}: {e}",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}",
                       code="invalid_json")
    return data


def check_model(state: ServerState, body: Dict[str, Any]) -> None:
    """404 when the body names a model this server does not serve (a missing model is this one)."""
    name = body.get("model")
    if isinstance(name, str) and name != state.model_name:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves {state.model_name!r} "
                            f"(GET /v1/models)", param="model", code="model_not_found")


# ------------------------------------------------------------------------------------------------ answer writing

def finite_or_none(x: float) -> Optional[float]:
    """JSON has no NaN or infinity: a log-probability of -inf (a token the model rules out) becomes None."""
    return x if math.isfinite(x) else None


class Answer:
    """Writes one request's answer (completion or chat, whole or in chunks) in OpenAI's shapes."""

    def __init__(self, state: ServerState, req: GenerationRequest):
        self.state = state
        self.req = req
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.offset = 0   # characters of text so far (the completion logprobs' text_offset)

    def _token(self, token: int) -> str:
        return self.state.tokenizer.decode([token])

    def logprobs(self, entries: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        if self.req.top_logprobs is None:
            return None
        if self.chat:
            def item(t, lp):
                s = self._token(t)
                return {"token": s, "logprob": finite_or_none(lp), "bytes": list(s.encode("utf-8"))}
            return {"content": [{**item(e["token"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
                                for e in entries]}
        tokens = [self._token(e["token"]) for e in entries]
        offsets = []
        for s in tokens:
            offsets.append(self.offset)
            self.offset += len(s)
        return {"tokens": tokens, "token_logprobs": [finite_or_none(e["logprob"]) for e in entries],
                "top_logprobs": [{self._token(t): finite_or_none(lp) for t, lp in e["top"]} for e in entries],
                "text_offset": offsets}

    def _envelope(self, choices: List[Dict[str, Any]], chunk: bool) -> Dict[str, Any]:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.state.model_name,
                "choices": choices}

    def whole(self, text: str, entries: List[Dict[str, Any]], finished: Finished) -> Dict[str, Any]:
        choice = {"index": 0, "logprobs": self.logprobs(entries), "finish_reason": finished.reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return {**self._envelope([choice], chunk=False), "usage": finished.usage}

    def chunk(self, text: Optional[str], entries: List[Dict[str, Any]], reason: Optional[str] = None,
              role: bool = False) -> Dict[str, Any]:
        choice: Dict[str, Any] = {"index": 0, "logprobs": self.logprobs(entries) if entries else None,
                                  "finish_reason": reason}
        if self.chat:
            delta: Dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        out = self._envelope([choice], chunk=True)
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Dict[str, int]) -> Dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": usage}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


# ------------------------------------------------------------------------------------------------ generation

DISCONNECTED = object()


async def _wait_disconnect(request: Request, queue: asyncio.Queue) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait(DISCONNECTED)
            return


def _start(state: ServerState, req: GenerationRequest) -> tuple:
    """Submit the request's job; (job, its event queue). 429 when the engine is full."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def emit(event):   # called on the engine's thread
        loop.call_soon_threadsafe(queue.put_nowait, event)

    job = Job(prompt_ids=req.prompt_ids, max_tokens=req.max_tokens, emit=emit, temperature=req.temperature,
              top_k=req.top_k, top_p=req.top_p, seed=req.seed, stop=req.stop, top_logprobs=req.top_logprobs,
              ignore_eos=req.ignore_eos, stream_interval=state.settings.stream_interval if req.stream else 0.0)
    try:
        state.engine.submit(job)
    except QueueFull as e:
        raise ApiError(429, str(e), code="queue_full") from None
    state.metrics.count("prompt_tokens", len(req.prompt_ids))
    return job, queue


async def _whole(state: ServerState, request: Request, req: GenerationRequest, endpoint: str, t0: float) -> Response:
    job, queue = _start(state, req)
    watcher = asyncio.ensure_future(_wait_disconnect(request, queue))
    texts: List[str] = []
    entries: List[Dict[str, Any]] = []
    try:
        while True:
            event = await queue.get()
            if event is DISCONNECTED:
                job.cancel()
                return Response(status_code=499)   # nobody reads it; nginx's "client closed request"
            if isinstance(event, Delta):
                if not texts:
                    state.metrics.observe("time_to_first_token_seconds", endpoint, time.perf_counter() - t0)
                texts.append(event.text)
                entries.extend(event.logprobs)
            elif isinstance(event, Failed):
                raise ApiError(500, event.message, code="generation_failed")
            else:
                body = Answer(state, req).whole("".join(texts), entries, event)
                state.metrics.request(endpoint, 200)
                state.metrics.observe("request_latency_seconds", endpoint, time.perf_counter() - t0)
                return JSONResponse(body)
    finally:
        job.cancel()   # no-op once finished; stops the generation when this coroutine is abandoned
        watcher.cancel()


def _drain(event: Any, queue: asyncio.Queue) -> List[Any]:
    """`event` and those queued behind it, consecutive text deltas merged into one (one server-sent event for
    all of them when the engine runs ahead of the event loop: fewer wake-ups and writes, the same text)."""
    events = [event]
    while not queue.empty():
        more = queue.get_nowait()
        if isinstance(more, Delta) and isinstance(events[-1], Delta):
            events[-1] = Delta(events[-1].text + more.text, events[-1].logprobs + more.logprobs)
        else:
            events.append(more)
    return events


async def _stream(state: ServerState, job: Job, queue: asyncio.Queue, answer: Answer, endpoint: str,
                  t0: float) -> AsyncIterator[bytes]:
    first = True
    try:
        if answer.chat:
            yield _sse(answer.chunk("", [], role=True))
        end = None
        while end is None:
            for event in _drain(await queue.get(), queue):
                if isinstance(event, Delta):
                    if first:
                        state.metrics.observe("time_to_first_token_seconds", endpoint, time.perf_counter() - t0)
                        first = False
                    yield _sse(answer.chunk(event.text, event.logprobs))
                else:
                    end = event
                    break
        if isinstance(end, Failed):
            yield _sse(ApiError(500, end.message, code="generation_failed").body())
        else:
            yield _sse(answer.chunk(None if answer.chat else "", [], reason=end.reason))
            if answer.req.include_usage:
                yield _sse(answer.usage_chunk(end.usage))
        yield b"data: [DONE]\n\n"
        state.metrics.observe("request_latency_seconds", endpoint, time.perf_counter() - t0)
    finally:
        job.cancel()   # the client went away (Starlette cancels this generator) or the answer is complete


async def _generate(state: ServerState, request: Request, kind: str) -> Response:
    t0 = time.perf_counter()
    endpoint = request.url.path
    check_api_key(state, request)
    body = await read_json(request, state.settings.max_request_bytes)
    check_model(state, body)
    s = state.settings
    limits = Limits(s.max_prompt_tokens, s.max_tokens_limit, s.default_max_tokens)
    req = (parse_chat(body, state.tokenizer, state.render_chat, limits) if kind == "chat"
           else parse_completion(body, state.tokenizer, state.vocab_size, limits))
    if not req.stream:
        return await _whole(state, request, req, endpoint, t0)
    job, queue = _start(state, req)
    state.metrics.request(endpoint, 200)
    return StreamingResponse(_stream(state, job, queue, Answer(state, req), endpoint, t0),
                             media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ------------------------------------------------------------------------------------------------ the app

def build_app(state: ServerState) -> Starlette:
    """The Starlette app over `state` (its lifespan starts and stops the engine)."""

    async def completions(request: Request) -> Response:
        return await _generate(state, request, "completion")

    async def chat(request: Request) -> Response:
        return await _generate(state, request, "chat")

    def model_card() -> Dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "linattn"}

    async def models(request: Request) -> Response:
        check_api_key(state, request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        check_api_key(state, request)
        check_model(state, {"model": request.path_params["name"]})
        return JSONResponse(model_card())

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        check_api_key(state, request)
        counts = state.engine.counts()
        text = state.metrics.render({"requests_running": ("Requests generating now.", counts["running"]),
                                     "requests_waiting": ("Requests queued for a generation slot.",
                                                          counts["waiting"]),
                                     **state.engine.gauges()})
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def api_error(request: Request, e: ApiError) -> Response:
        state.metrics.request(request.url.path, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    async def http_error(request: Request, e: HTTPException) -> Response:
        return await api_error(request, ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                                 code="not_found" if e.status_code == 404 else None))

    async def server_error(request: Request, e: Exception) -> Response:
        return await api_error(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()

    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]),
              Route("/v1/models/{name:path}", model, methods=["GET"]),
              Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics, methods=["GET"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: server_error})
