"""A generation request as the engine runs it (`Job`), the events it emits (`Delta`, `Finished`, `Failed`), and the
per-request output side shared by both schedulers: token ids in, text out through the tokenizer, stop strings,
logprobs, the stream interval (`Output`)."""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from ..generate import TextDecoder


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


def logprob_entry(logits: Optional[torch.Tensor], token: int, k: int) -> Dict[str, Any]:
    """{token, logprob, top: [(token, logprob)] * k} under the distribution of `logits` `[V]` (before temperature
    and filtering); NaN and no top list when the logits are unknown."""
    if not isinstance(logits, torch.Tensor):
        return {"token": token, "logprob": float("nan"), "top": []}
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(min(k, lp.numel())) if k > 0 else None
    return {"token": token, "logprob": float(lp[token]),
            "top": [] if top is None else [(int(i), float(v)) for v, i in zip(top.values, top.indices)]}


class Output:
    """A running job's output side: `accept(token, logits)` takes each generated token (True once the job is over:
    max_tokens, end of document, a stop string) and emits what text it completes."""

    def __init__(self, job: Job, tokenizer):
        self.job = job
        self.eos_id = tokenizer.eos_id
        self.decoder = TextDecoder(tokenizer, skip_special_tokens=True)
        self.stopper = StopMatcher(job.stop)
        self.logprobs: List[Dict[str, Any]] = []
        self.pending = ""          # text not emitted yet (within the job's stream_interval)
        self.last_emit = -math.inf
        self.finished = False      # set before Finished is emitted: the engine stops counting the job running

    def usage(self) -> Dict[str, int]:
        p, c = len(self.job.prompt_ids), len(self.decoder.tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def accept(self, token: int, logits: Optional[torch.Tensor] = None) -> bool:
        """Emit what `token` completes (logits `[V]`: the step's, for logprobs); True when the job is over."""
        if self.job.top_logprobs is not None:
            self.logprobs.append(logprob_entry(logits, token, self.job.top_logprobs))
        text, stopped = self.stopper.push(self.decoder.push(token))
        if stopped:
            return self.finish("stop", text)
        if token == self.eos_id and not self.job.ignore_eos:
            return self.finish("stop", text)
        if len(self.decoder.tokens) >= self.job.max_tokens:
            text2, stopped = self.stopper.push(self.decoder.flush())
            return self.finish("stop" if stopped else "length", text + text2 + ("" if stopped else
                                                                                 self.stopper.flush()))
        self.pending += text
        if self.pending and time.perf_counter() - self.last_emit >= self.job.stream_interval:
            self._emit_pending()
        return False

    def _emit_pending(self) -> None:
        self.job.emit(Delta(self.pending, self.logprobs))
        self.pending, self.logprobs = "", []
        self.last_emit = time.perf_counter()

    def finish(self, reason: str, text: str = "") -> bool:
        """Emit what is held back, then Finished; returns True (the job is over)."""
        self.finished = True
        self.pending += text
        if self.pending or self.logprobs:
            self._emit_pending()
        self.job.emit(Finished(reason, self.usage()))
        return True
