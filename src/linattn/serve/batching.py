"""Continuous batching: the scheduler the engine runs for a linattn `LanguageModel`.

Each `step()` of the engine's worker thread:

1. drops the requests whose client went away (their rows leave the batch at once);
2. runs one prefill chunk (at most `prefill_chunk` tokens) of the oldest request still reading its prompt, so a long
   prompt never stalls the requests already generating for more than one chunk; before its first chunk the request
   takes the longest cached prefix of its prompt from the `PrefixCache` and prefills only the rest, and at each
   `boundaries` point it leaves a snapshot there;
3. decodes one token for every generating request, all rows of a batch in one forward through the model's public
   `model(ids, cache=...)`.

A request that finished its prompt joins a running batch with `Cache.insert_rows`: recurrent states are stacked,
per-row offsets keep each row at its own position, and softmax KV caches of different lengths are left-padded to a
common length and masked (exact: no recomputation). States that hold one entry per token without a KV cache (FoX,
DeltaFormer, PaTH) join only rows at the same position (`Cache.rows_mergeable`); other rows form their own batch,
decoded in the same step. A finished request's row leaves with `Cache.remove_rows`.

What a request gets does not depend on the batch around it up to the kernels' rounding: a batched matmul may sum in
another order than a single row's, so logits agree with the request's solo run to ~1e-6 relative (tested: within
1e-5 of the largest logit, and greedy tokens identical), not bitwise. Sampling uses the request's own generator
(its seed), exactly as `linattn generate`.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from ..generate import check_sampling
from ..layers.cache import Cache, CacheSnapshot
from ..models.generation import make_generator, sample_next
from .jobs import Job, Output
from .prefix_cache import PrefixCache


def supports_batching(model) -> bool:
    """Whether the model's decoding state is a linattn `Cache` whose rows can be batched (a causal LM)."""
    new_cache = getattr(model, "new_cache", None)
    if new_cache is None or not getattr(model, "is_causal", False):
        return False
    try:
        return type(new_cache()) is Cache
    except Exception:  # noqa: BLE001  (a model family with another cache: the turn-by-turn engine)
        return False


class _Request:
    """A job in the scheduler: its output side, its sampling generator, its cache while it reads its prompt."""

    def __init__(self, job: Job, tokenizer, device):
        check_sampling(job.temperature, job.top_k, job.top_p, job.max_tokens)
        self.job = job
        self.out = Output(job, tokenizer)
        self.generator = make_generator(job.seed, device)
        self.cache: Optional[Cache] = None    # None: not started; the request's own cache until it joins a batch
        self.pos = 0                          # prompt tokens consumed
        self.logits: Optional[torch.Tensor] = None
        self.last = 0                         # the token the next decode step feeds

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from logits `[V]`, as `linattn.generate.stream_tokens` samples it."""
        j = self.job
        return int(sample_next(logits[None], j.temperature, j.top_k or None, j.top_p, self.generator)[0])


class _Batch:
    """Requests decoding together: their rows of one `Cache`, in order."""

    def __init__(self, cache: Cache, rows: List[_Request]):
        self.cache, self.rows = cache, rows


class BatchScheduler:
    """Admits, prefills, decodes and retires requests a step at a time (module docstring).

    Args:
        model: A causal linattn `LanguageModel` (`supports_batching`).
        tokenizer: Its tokenizer.
        prefix_cache: Where prompt states are kept and found (None: no prefix caching).
        prefill_chunk: The most prompt tokens one step prefills.
        count: `count(name, n)` for the server's counters.
        fail: `fail(job, exception)` tells a request it failed.
    """

    def __init__(self, model, tokenizer, prefix_cache: Optional[PrefixCache], prefill_chunk: int,
                 count: Callable[[str, int], None], fail: Callable[[Job, BaseException], None]):
        self.model, self.tokenizer = model, tokenizer
        self.device = next(iter(model.parameters())).device
        self.n_layers = len(model.new_cache())   # new_cache also rebuilds fused weights once, here
        self.prefix_cache, self.prefill_chunk = prefix_cache, prefill_chunk
        self.count, self.fail = count, fail
        self.prefilling: List[_Request] = []
        self.batches: List[_Batch] = []

    def add(self, job: Job) -> None:
        """Start a job (raises for bad sampling settings: the engine fails that request)."""
        self.prefilling.append(_Request(job, self.tokenizer, self.device))

    def jobs(self) -> List[Job]:
        return [r.job for r in self.prefilling] + [r.job for b in self.batches for r in b.rows]

    def active(self) -> int:
        """Requests generating (a finished one no longer counts, even before its row leaves the batch)."""
        return sum(not r.out.finished for r in [*self.prefilling, *(r for b in self.batches for r in b.rows)])

    def step(self) -> None:
        """One round: drop cancelled requests, one prefill chunk, one decode step of every batch."""
        self._drop_cancelled()
        if self.prefilling:
            self._prefill_chunk(self.prefilling[0])
        for batch in list(self.batches):
            self._decode(batch)

    # -- cancellation and retirement ------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        gone = [r for r in self.prefilling if r.job.cancelled.is_set()]
        self.prefilling = [r for r in self.prefilling if r not in gone]
        n = len(gone)
        for batch in list(self.batches):
            rows = [b for b, r in enumerate(batch.rows) if r.job.cancelled.is_set()]
            self._retire(batch, rows)
            n += len(rows)
        if n:
            self.count("cancelled", n)

    def _retire(self, batch: _Batch, rows: List[int]) -> None:
        if not rows:
            return
        if len(rows) == len(batch.rows):
            self.batches.remove(batch)
            return
        batch.cache.remove_rows(rows)
        batch.rows = [r for b, r in enumerate(batch.rows) if b not in set(rows)]

    # -- prefill --------------------------------------------------------------------------------
    def _prefill_chunk(self, r: _Request) -> None:
        try:
            with torch.no_grad():
                self._advance_prompt(r)
        except Exception as e:  # noqa: BLE001  (a bad prompt fails its request only)
            self.prefilling.remove(r)
            self.fail(r.job, e)
            return
        if r.pos == len(r.job.prompt_ids):
            self.prefilling.remove(r)
            try:
                self._first_token(r)
            except Exception as e:  # noqa: BLE001  (its state could not join a batch: this request fails)
                self.fail(r.job, e)

    def _advance_prompt(self, r: _Request) -> None:
        ids, pc = r.job.prompt_ids, self.prefix_cache
        if r.cache is None:
            r.cache = Cache(self.n_layers)
            hit = pc.lookup(ids) if pc is not None else None
            if hit is not None:
                r.cache.restore(hit.snapshot)
                r.pos, r.logits = hit.n_tokens, hit.logits
                self.count("prefix_cache_hit_tokens", hit.n_tokens)
            if not ids:
                raise ValueError("the prompt holds no tokens")
        if r.pos == len(ids):
            return
        end = min(len(ids), r.pos + self.prefill_chunk)
        if pc is not None:   # stop at the next point where a state is kept
            end = min([end] + [b for b in pc.boundaries(len(ids)) if b > r.pos])
        x = torch.tensor([ids[r.pos:end]], dtype=torch.long, device=self.device)
        r.logits = self.model(x, cache=r.cache, logits_to_keep=1).logits[0, -1]
        self.count("prefill_tokens", end - r.pos)
        r.pos = end
        if pc is not None and end in pc.boundaries(len(ids)):
            pc.insert(ids[:end], r.cache.snapshot(), r.logits)

    def _first_token(self, r: _Request) -> None:
        if r.job.max_tokens == 0:
            r.out.finish("length")
            return
        if self._emit(r, r.logits):
            return
        cache, r.cache = r.cache, None
        snap = CacheSnapshot(cache.layers, cache.seen_tokens)   # the request's own state: insert_rows copies it
        for batch in self.batches:
            if batch.cache.rows_mergeable(snap) is None:
                batch.cache.insert_rows(snap)
                batch.rows.append(r)
                return
        self.batches.append(_Batch(cache, [r]))

    # -- decode ---------------------------------------------------------------------------------
    def _decode(self, batch: _Batch) -> None:
        ids = torch.tensor([[r.last] for r in batch.rows], dtype=torch.long, device=self.device)
        try:
            with torch.no_grad():
                logits = self.model(ids, cache=batch.cache, logits_to_keep=1).logits[:, -1]
        except Exception as e:  # noqa: BLE001  (the rows of this batch cannot be told apart: all fail)
            self._fail_batch(batch, e)
            return
        over = [b for b, r in enumerate(batch.rows) if self._emit(r, logits[b])]
        try:
            self._retire(batch, over)
        except Exception as e:  # noqa: BLE001  (a batch whose rows could not be removed cannot go on)
            self._fail_batch(batch, e)

    def _fail_batch(self, batch: _Batch, e: BaseException) -> None:
        self.batches.remove(batch)
        for r in batch.rows:
            if not r.out.finished:
                self.fail(r.job, e)

    def _emit(self, r: _Request, logits: torch.Tensor) -> bool:
        """Sample r's next token and hand it to its output; True when r is over (finished or failed)."""
        try:
            r.last = r.sample(logits)
            self.count("generation_tokens", 1)
            return r.out.accept(r.last, logits)
        except Exception as e:  # noqa: BLE001  (its client is gone, or a bad sampling state)
            self.fail(r.job, e)
            return True
