"""The generation engine: one worker thread that owns the model and advances every running request a token at a
time, in turn, through `linattn.generate.stream_tokens` (the code `linattn generate` runs, so a request's tokens
equal the command's for the same prompt, seed and settings).

One thread touches the model, so no two forwards race on it and the event loop stays free for new connections
and /health. Requests beyond `max_concurrent` wait in a queue; beyond `max_queue` more, `submit` refuses them
(`QueueFull`, HTTP 429). A request ends at its `max_tokens`, at the end-of-document token, at a stop string, when
cancelled (its client went away) or when its generation fails (only that request gets the error).

Events reach the request through its `emit(event)` callback, called from the worker thread:
`Delta(text, logprobs)`, then one `Finished(reason, usage)` or `Failed(message)`.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional

import torch

from ..errors import LinattnError
from ..generate import TextDecoder, stream_tokens
from ..logs import get_logger

log = get_logger("serve")


class QueueFull(LinattnError):
    """Every generation slot is busy and the waiting queue is full (HTTP 429)."""


@dataclass
class Delta:
    text: str
    logprobs: List[Dict[str, Any]]   # one entry per token this text completes (empty unless asked)


@dataclass
class Finished:
    reason: str                      # "stop" (end of document or a stop string) | "length"
    usage: Dict[str, int]


@dataclass
class Failed:
    message: str


@dataclass
class Job:
    """One generation request, as the engine runs it."""

    prompt_ids: List[int]
    max_tokens: int
    emit: Callable[[Any], None]
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    top_logprobs: Optional[int] = None   # None: no logprobs; k: the chosen token's and the k likeliest
    ignore_eos: bool = False
    stream_interval: float = 0.0        # seconds: text is emitted at most this often (the first at once)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating at the next step (the client went away); safe from any thread."""
        self.cancelled.set()


class StopMatcher:
    """Cuts text at the first stop string, across pieces: text that could be the start of a stop string is held
    back until it is known not to be one, so no part of a stop string is ever emitted."""

    def __init__(self, stops: List[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, piece: str):
        """(text that is safe to emit, True once a stop string has been seen)."""
        buf = self.pending + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[:min(hits)], True
        keep = max((k for s in self.stops for k in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:k])), default=0)
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class _Running:
    """A job being generated: its token stream, decoder, stop matcher and counts."""

    def __init__(self, job: Job, engine: "Engine"):
        self.job = job
        self.engine = engine
        tok = engine.tokenizer
        self.eos_id = tok.eos_id
        ids = torch.tensor([job.prompt_ids], dtype=torch.long, device=engine.device)
        self.tokens = stream_tokens(engine.model, ids, job.max_tokens, temperature=job.temperature,
                                    top_k=job.top_k, top_p=job.top_p, seed=job.seed,
                                    eos_id=None if job.ignore_eos else self.eos_id)
        self.decoder = TextDecoder(tok, skip_special_tokens=True)
        self.stopper = StopMatcher(job.stop)
        self.logprobs: List[Dict[str, Any]] = []
        self.pending = ""          # text not emitted yet (within the job's stream_interval)
        self.last_emit = -math.inf

    def usage(self) -> Dict[str, int]:
        p, c = len(self.job.prompt_ids), len(self.decoder.tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def step(self) -> bool:
        """Generate one token and emit what it completes; True when the job is over."""
        try:
            token = next(self.tokens)
        except StopIteration:  # max_tokens 0 or the model's own end
            return self._finish("length")
        if self.job.top_logprobs is not None:
            self.logprobs.append(self.engine.logprob_entry(token, self.job.top_logprobs))
        text, stopped = self.stopper.push(self.decoder.push(token))
        if stopped:
            return self._finish("stop", text)
        if token == self.eos_id and not self.job.ignore_eos:
            return self._finish("stop", text)
        if len(self.decoder.tokens) >= self.job.max_tokens:
            text2, stopped = self.stopper.push(self.decoder.flush())
            return self._finish("stop" if stopped else "length", text + text2 + ("" if stopped else
                                                                                   self.stopper.flush()))
        self.pending += text
        if self.pending and time.perf_counter() - self.last_emit >= self.job.stream_interval:
            self._emit_pending()
        return False

    def _emit_pending(self) -> None:
        self.job.emit(Delta(self.pending, self.logprobs))
        self.pending, self.logprobs = "", []
        self.last_emit = time.perf_counter()

    def _finish(self, reason: str, text: str = "") -> bool:
        self.tokens.close()
        self.pending += text
        if self.pending or self.logprobs:
            self._emit_pending()
        self.job.emit(Finished(reason, self.usage()))
        return True


class Engine:
    """Runs jobs on one worker thread, `max_concurrent` at a time in turn, `max_queue` more waiting.

    Args:
        model: A causal LM of a registered family (its `stream()` generates).
        tokenizer: Its tokenizer (encode, decode, eos_id).
        max_concurrent: Jobs generating at once.
        max_queue: Jobs waiting for a slot before `submit` raises QueueFull.
        metrics: A `linattn.serve.metrics.Metrics` to count tokens and cancellations (None: none).
    """

    def __init__(self, model, tokenizer, max_concurrent: int = 8, max_queue: int = 64, metrics=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(iter(model.parameters())).device
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.metrics = metrics
        self._cond = threading.Condition()
        self._waiting: Deque[Job] = deque()
        self._running: List[_Running] = []
        self._stopping = False
        self._last_output: Any = None
        # the logits each step sampled from (for logprobs): the model's output as it leaves forward
        self._hook = model.register_forward_hook(self._keep_logits)
        self._thread = threading.Thread(target=self._work, name="linattn-serve-engine", daemon=True)

    # -- the request side (event loop thread) -----------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; raises QueueFull when the slots and the queue are all taken."""
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            if len(self._waiting) + len(self._running) >= self.max_concurrent + self.max_queue:
                raise QueueFull(f"the server is busy: {len(self._running)} requests generating and "
                                f"{len(self._waiting)} waiting (--max-concurrent {self.max_concurrent}, "
                                f"--max-queue {self.max_queue}); retry later")
            self._waiting.append(job)
            self._cond.notify()

    def counts(self) -> Dict[str, int]:
        """{"running": jobs generating, "waiting": jobs queued}."""
        with self._cond:
            return {"running": len(self._running), "waiting": len(self._waiting)}

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is left, end the worker thread, remove the logits hook."""
        with self._cond:
            self._stopping = True
            for job in self._waiting:
                job.cancel()
            for r in self._running:
                r.job.cancel()
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._hook.remove()

    # -- the worker thread ------------------------------------------------------------------------------------
    def _keep_logits(self, module, args, output) -> None:
        self._last_output = output   # a reference only: logprob_entry reads it when a request asks

    def logprob_entry(self, token: int, k: int) -> Dict[str, Any]:
        """{token, logprob, top: [(token, logprob)] * k} under the model's distribution (before temperature and
        filtering) of the step that produced `token`."""
        out = self._last_output
        logits = out[0] if isinstance(out, tuple) and out else getattr(out, "logits", None)
        if not isinstance(logits, torch.Tensor):
            return {"token": token, "logprob": float("nan"), "top": []}
        lp = torch.log_softmax(logits[0, -1].float(), dim=-1)
        top = lp.topk(min(k, lp.numel())) if k > 0 else None
        return {"token": token, "logprob": float(lp[token]),
                "top": [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices)]}

    def _admit(self) -> bool:
        """Move waiting jobs into free slots; wait while there is nothing to do. False: stop the worker."""
        with self._cond:
            while not self._running and not self._waiting and not self._stopping:
                self._cond.wait()
            if self._stopping:   # stop() cancelled every job: the running ones end in _work, then the thread
                self._count("cancelled", len(self._waiting))
                self._waiting.clear()
                return bool(self._running)
            while self._waiting and len(self._running) < self.max_concurrent:
                job = self._waiting.popleft()
                if job.cancelled.is_set():
                    self._count("cancelled")
                    continue
                try:
                    self._running.append(_Running(job, self))
                except Exception as e:  # a bad prompt for this model: only this request fails
                    self._fail(job, e)
            return True

    def _work(self) -> None:
        while self._admit():
            for r in list(self._running):
                if r.job.cancelled.is_set():
                    r.tokens.close()
                    self._count("cancelled")
                    done = True
                else:
                    done = self._step(r)
                if done:
                    with self._cond:
                        self._running.remove(r)

    def _step(self, r: _Running) -> bool:
        try:
            before = len(r.decoder.tokens)
            done = r.step()
            self._count("generation_tokens", len(r.decoder.tokens) - before)
            return done
        except Exception as e:  # noqa: BLE001  (a failing request must not take the others down)
            r.tokens.close()
            self._fail(r.job, e)
            return True

    def _fail(self, job: Job, e: BaseException) -> None:
        log.error("a request failed: %s: %s", type(e).__name__, e)
        try:
            job.emit(Failed(f"generation failed: {type(e).__name__}: {e}"))
        except Exception:  # noqa: BLE001  (its client is gone)
            pass

    def _count(self, what: str, n: int = 1) -> None:
        if self.metrics is not None and n:
            self.metrics.count(what, n)

