"""Decoding caches.

* `LayerCache`: the state of one module (a dict: recurrent state, conv states, KV cache, position
  offset). A layer called with `cache=LayerCache()` reads its state from it and writes the new
  one back, so prefill (many tokens) and decoding (one token at a time) just reuse the object.
* `KVCache`: the growing key/value store of softmax attention, preallocated in chunks so that
  appending a token is an in-place copy (optionally trimmed to a sliding window).
* `Cache`: the whole model's cache, one `LayerCache` per (block, module).

`nbytes()` counts every tensor held (for the KV cache: the allocated capacity). Linear mixers
hold a constant-size state, so their `nbytes()` does not depend on the number of tokens seen.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

import torch


def tensor_nbytes(obj: Any) -> int:
    """Bytes of every tensor inside obj (tensors, KVCache, LayerCache, tuples, lists, dicts)."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if hasattr(obj, "nbytes") and callable(obj.nbytes):
        return int(obj.nbytes())
    if isinstance(obj, dict):
        return sum(tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(tensor_nbytes(v) for v in obj)
    return 0


class LayerCache(dict):
    """The decoding state of one module. `offset` is the number of tokens it has consumed: an int,
    or an int64 tensor `[B]` when the rows of a batch have consumed different numbers of tokens
    (a left-padded batch: row b's tokens are then the last offset[b] of every stored sequence)."""

    @property
    def offset(self):
        o = self.get("offset", 0)
        if isinstance(o, torch.Tensor) and o.dim() == 1:
            return o
        return int(o)

    def nbytes(self) -> int:
        return sum(tensor_nbytes(v) for k, v in self.items() if k != "offset")

    def __repr__(self) -> str:
        keys = ", ".join(k for k in self if k != "offset")
        return f"LayerCache(offset={self.offset}, [{keys}], nbytes={self.nbytes()})"


class KVCache:
    """Keys and values `[B, T, H, D]` in preallocated buffers that grow in whole chunks of `chunk`
    tokens (by at least half their size, so appending is amortised O(1) per token).

    With `window=w` only the last w-1 tokens can ever be attended again, so older ones are
    dropped (amortised: once the buffer holds w-1+chunk tokens). `start` is the absolute
    position of the first stored token.
    """

    def __init__(self, chunk: int = 256, window: Optional[int] = None):
        self.chunk, self.window = int(chunk), window
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.length = 0
        self.start = 0

    def _grow(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = 0 if self.k is None else self.k.shape[1]
        if need <= cap:
            return
        # grow by at least half the current size (amortised O(1) copies per token), in whole chunks
        target = max(need, cap + cap // 2)
        new_cap = self.chunk * ((target + self.chunk - 1) // self.chunk)
        B, _, H, Dk = like_k.shape
        k = like_k.new_empty(B, new_cap, H, Dk)
        v = like_v.new_empty(B, new_cap, H, like_v.shape[-1])
        if self.length:
            k[:, : self.length] = self.k[:, : self.length]
            v[:, : self.length] = self.v[:, : self.length]
        self.k, self.v = k, v

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store new keys/values and return all stored ones (views) with their first position."""
        T = k.shape[1]
        if self.window is not None and self.length + T > self.window - 1 + self.chunk and self.length:
            keep = min(self.length, max(self.window - 1, 0))
            drop = self.length - keep
            if drop > 0:
                self.k[:, :keep] = self.k[:, drop: self.length].clone()
                self.v[:, :keep] = self.v[:, drop: self.length].clone()
                self.length, self.start = keep, self.start + drop
        self._grow(self.length + T, k, v)
        self.k[:, self.length: self.length + T] = k
        self.v[:, self.length: self.length + T] = v
        self.length += T
        return self.k[:, : self.length], self.v[:, : self.length], self.start

    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def __repr__(self) -> str:
        return f"KVCache(length={self.length}, start={self.start}, nbytes={self.nbytes()})"


class Cache:
    """A model's decoding cache: `layers[i]` maps a module name ("mixer", "lobe") to its LayerCache.

    `seen_tokens` counts the tokens consumed so far.
    """

    def __init__(self, n_layers: int):
        self.layers: List[Dict[str, LayerCache]] = [dict() for _ in range(n_layers)]
        self.seen_tokens = 0

    def layer(self, i: int, name: str) -> LayerCache:
        d = self.layers[i]
        if name not in d:
            d[name] = LayerCache()
        return d[name]

    def nbytes(self) -> int:
        return sum(c.nbytes() for d in self.layers for c in d.values())

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterable[Dict[str, LayerCache]]:
        return iter(self.layers)

    def __repr__(self) -> str:
        return f"Cache(n_layers={len(self.layers)}, seen_tokens={self.seen_tokens}, nbytes={self.nbytes()})"
