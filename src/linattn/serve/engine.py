"""The generation engine: one worker thread that owns the model and advances every running request.

For a linattn `LanguageModel` it runs continuous batching (`batching.BatchScheduler`): requests join and leave at
every step, every generating request decodes in one batched forward, prompts are prefilled in chunks between decode
steps, and prompt states are kept in an exact prefix cache (`prefix_cache.PrefixCache`). Any other causal LM (a model
family with its own cache) is stepped a token at a time in turn through `linattn.generate.stream_tokens` (the code
`linattn generate` runs).

One thread touches the model, so no two forwards race on it and the event loop stays free for new connections
and /health. Requests beyond `max_concurrent` wait in a queue; beyond `max_queue` more, `submit` refuses them
(`QueueFull`, HTTP 429). A request ends at its `max_tokens`, at the end-of-document token, at a stop string, when
cancelled (its client went away) or when its generation fails (only that request gets the error).

Events reach the request through its `emit(event)` callback, called from the worker thread:
`Delta(text, logprobs)`, then one `Finished(reason, usage)` or `Failed(message)`.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from ..errors import LinattnError
from ..generate import stream_tokens
from ..logs import get_logger
from .batching import BatchScheduler, supports_batching
from .jobs import Delta, Failed, Finished, Job, Output, StopMatcher, logprob_entry
from .prefix_cache import PrefixCache

__all__ = ["Delta", "Engine", "Failed", "Finished", "Job", "QueueFull", "StopMatcher"]

log = get_logger("serve")


class QueueFull(LinattnError):
    """Every generation slot is busy and the waiting queue is full (HTTP 429)."""


class _TurnRunning:
    """A job of the turn-by-turn engine: its token stream and its output side."""

    def __init__(self, job: Job, engine: "Engine"):
        self.job, self.engine = job, engine
        ids = torch.tensor([job.prompt_ids], dtype=torch.long, device=engine.device)
        self.out = Output(job, engine.tokenizer)
        self.tokens = stream_tokens(engine.model, ids, job.max_tokens, temperature=job.temperature,
                                    top_k=job.top_k, top_p=job.top_p, seed=job.seed,
                                    eos_id=None if job.ignore_eos else self.out.eos_id)

    def step(self) -> bool:
        """Generate one token and emit what it completes; True when the job is over."""
        try:
            token = next(self.tokens)
        except StopIteration:  # max_tokens 0 or the model's own end
            return self.out.finish("length")
        done = self.out.accept(token, self.engine.last_logits() if self.job.top_logprobs is not None else None)
        if done:
            self.tokens.close()
        return done


class Engine:
    """Runs jobs on one worker thread, `max_concurrent` at a time, `max_queue` more waiting.

    Args:
        model: A causal LM of a registered family (its `stream()` generates).
        tokenizer: Its tokenizer (encode, decode, eos_id).
        max_concurrent: Jobs generating at once.
        max_queue: Jobs waiting for a slot before `submit` raises QueueFull.
        metrics: A `linattn.serve.metrics.Metrics` to count tokens and cancellations (None: none).
        prefix_cache_bytes: The prefix cache's memory budget (0: no prefix caching).
        prefix_every: Keep a prompt's state every this many tokens (and at its end).
        prefill_chunk: The most prompt tokens prefilled between two decode steps.
        batching: Continuous batching (None: whenever the model supports it; False: turn by turn).
    """

    def __init__(self, model, tokenizer, max_concurrent: int = 8, max_queue: int = 64, metrics=None,
                 prefix_cache_bytes: int = 1 << 30, prefix_every: int = 256, prefill_chunk: int = 256,
                 batching: Optional[bool] = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(iter(model.parameters())).device
        self.max_concurrent = max_concurrent
        self.max_queue = max_queue
        self.metrics = metrics
        self._cond = threading.Condition()
        self._waiting: Deque[Job] = deque()
        self._running: List[_TurnRunning] = []
        self._stopping = False
        self.prefix_cache: Optional[PrefixCache] = None
        self._batch: Optional[BatchScheduler] = None
        self._hook = None
        if batching is not False and supports_batching(model):
            self.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_every) if prefix_cache_bytes else None
            self._batch = BatchScheduler(model, tokenizer, self.prefix_cache, prefill_chunk, self._count, self._fail)
        else:   # the logits each step sampled from (for logprobs): the model's output as it leaves forward
            self._last_output: Any = None
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
            running = self._active()
            if len(self._waiting) + running >= self.max_concurrent + self.max_queue:
                raise QueueFull(f"the server is busy: {running} requests generating and "
                                f"{len(self._waiting)} waiting (--max-concurrent {self.max_concurrent}, "
                                f"--max-queue {self.max_queue}); retry later")
            self._waiting.append(job)
            self._cond.notify()

    def counts(self) -> Dict[str, int]:
        """{"running": jobs generating, "waiting": jobs queued}."""
        with self._cond:
            return {"running": self._active(), "waiting": len(self._waiting)}

    def gauges(self) -> Dict[str, Tuple[str, float]]:
        """The engine's gauges for /metrics: name -> (help, value)."""
        out: Dict[str, Tuple[str, float]] = {}
        if self._batch is not None:
            out["decode_batches"] = ("Batches decoded each step (rows that cannot share one form their own).",
                                     len(self._batch.batches))
        if self.prefix_cache is not None:
            s = self.prefix_cache.stats()
            out["prefix_cache_entries"] = ("Prompt states kept in the prefix cache.", s["entries"])
            out["prefix_cache_bytes"] = ("Bytes the prefix cache's states hold.", s["bytes"])
            out["prefix_cache_budget_bytes"] = ("The prefix cache's memory budget (--prefix-cache-mb).",
                                                s["budget_bytes"])
            for k in ("hits", "misses", "evicted"):
                out[f"prefix_cache_{k}"] = (f"Prefix cache {k} since the start.", s[k])
        return out

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is left, end the worker thread, remove the logits hook."""
        with self._cond:
            self._stopping = True
            for job in [*self._waiting, *self._jobs()]:
                job.cancel()
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._hook is not None:
            self._hook.remove()

    def _active(self) -> int:
        return self._batch.active() if self._batch is not None else len(self._running)

    def _jobs(self) -> List[Job]:
        return self._batch.jobs() if self._batch is not None else [r.job for r in self._running]

    # -- the worker thread ------------------------------------------------------------------------------------
    def _keep_logits(self, module, args, output) -> None:
        self._last_output = output   # a reference only: last_logits reads it when a request asks

    def last_logits(self) -> Optional[torch.Tensor]:
        """The last position's logits `[V]` of the model's latest forward (turn-by-turn engine), or None."""
        out = self._last_output
        logits = out[0] if isinstance(out, tuple) and out else getattr(out, "logits", None)
        return logits[0, -1] if isinstance(logits, torch.Tensor) else None

    def logprob_entry(self, token: int, k: int) -> Dict[str, Any]:
        """{token, logprob, top} of `token` under the latest forward's distribution (`jobs.logprob_entry`)."""
        return logprob_entry(self.last_logits(), token, k)

    def _admit(self) -> bool:
        """Move waiting jobs into free slots; wait while there is nothing to do. False: stop the worker."""
        with self._cond:
            while not self._active() and not self._waiting and not self._stopping:
                self._cond.wait()
            if self._stopping:   # stop() cancelled every job: the running ones end in _work, then the thread
                self._count("cancelled", len(self._waiting))
                self._waiting.clear()
                return bool(self._active())
            while self._waiting and self._active() < self.max_concurrent:
                job = self._waiting.popleft()
                if job.cancelled.is_set():
                    self._count("cancelled")
                    continue
                try:
                    if self._batch is not None:
                        self._batch.add(job)
                    else:
                        self._running.append(_TurnRunning(job, self))
                except Exception as e:  # a bad prompt or setting for this model: only this request fails
                    self._fail(job, e)
            return True

    def _work(self) -> None:
        while self._admit():
            if self._batch is not None:
                self._batch.step()
                continue
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

    def _step(self, r: _TurnRunning) -> bool:
        try:
            before = len(r.out.decoder.tokens)
            done = r.step()
            self._count("generation_tokens", len(r.out.decoder.tokens) - before)
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
