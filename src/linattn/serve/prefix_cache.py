"""Exact prefix caching: the decoding state after a prompt's first n tokens, for any n the server chose to keep,
found again by the token ids themselves.

A recurrent state can be copied at any token (`Cache.snapshot`), so the engine keeps one at the end of every prompt
and every `every` tokens of long ones, not only at block boundaries. The snapshots live in a tree keyed by token id
(a trie): a lookup walks the new prompt's ids down the tree and returns the deepest snapshot on the way, so a hit is
always the state of exactly those tokens (no hashing, so no collision can hand out another prefix's state). Each
entry also keeps the logits of its last position, so a prompt equal to a cached one needs no forward at all.

Memory: the entries' bytes (the snapshots' tensors and logits) stay under `budget_bytes`; inserting past it evicts
the least recently used entries (a lookup that hits counts as a use). One thread (the engine's) uses the cache;
`stats()` may be read from any thread.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import LinattnError
from ..layers.cache import CacheSnapshot


class PrefixEntry:
    """A cached state: `snapshot` after `n_tokens` prompt tokens, and the logits `[V]` of the last of them."""

    def __init__(self, snapshot: CacheSnapshot, logits: torch.Tensor, n_tokens: int):
        self.snapshot, self.logits, self.n_tokens = snapshot, logits, n_tokens
        self.nbytes = snapshot.nbytes() + logits.numel() * logits.element_size()


class _Node:
    __slots__ = ("parent", "token", "children", "entry")

    def __init__(self, parent: Optional["_Node"], token: int):
        self.parent, self.token = parent, token
        self.children: Dict[int, _Node] = {}
        self.entry: Optional[PrefixEntry] = None


class PrefixCache:
    """A token-keyed tree of decoding-state snapshots under a memory budget (LRU eviction).

    Args:
        budget_bytes: The most bytes the entries may hold (0: keep nothing).
        every: Besides each prompt's end, keep a state every this many tokens of a prompt (the engine asks
            `boundaries`).
    """

    def __init__(self, budget_bytes: int, every: int = 256):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise LinattnError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise LinattnError(f"every must be an int >= 1 (tokens between kept states), got {every!r}")
        self.budget_bytes, self.every = budget_bytes, every
        self._root = _Node(None, -1)
        self._lru: "OrderedDict[int, _Node]" = OrderedDict()   # id(node) -> node, least recently used first
        self.nbytes = 0
        self.counts = {"hits": 0, "misses": 0, "hit_tokens": 0, "inserted": 0, "evicted": 0}

    def boundaries(self, n_prompt: int) -> List[int]:
        """The prompt lengths at which the engine keeps a state: every `every` tokens and the prompt's end."""
        return [*range(self.every, n_prompt, self.every), n_prompt] if n_prompt else []

    def lookup(self, ids: Sequence[int]) -> Optional[PrefixEntry]:
        """The entry of the longest cached prefix of `ids` (all of them at most), or None."""
        node, best = self._root, None
        for t in ids:
            node = node.children.get(int(t))
            if node is None:
                break
            if node.entry is not None:
                best = node
        if best is None:
            self.counts["misses"] += 1
            return None
        self._lru.move_to_end(id(best))
        self.counts["hits"] += 1
        self.counts["hit_tokens"] += best.entry.n_tokens
        return best.entry

    def insert(self, ids: Sequence[int], snapshot: CacheSnapshot, logits: torch.Tensor) -> bool:
        """Keep `snapshot` (the state after exactly `ids`) and the last position's `logits`; False when it does
        not fit the budget. An entry already kept for these ids stays (it is the same state) and is refreshed.

        Args:
            ids: The tokens the state has consumed.
            snapshot: Their state (owned by the cache from now on: pass a copy).
            logits: The logits `[V]` after the last of them.
        """
        if not ids:
            raise LinattnError("a prefix cache entry needs at least one token")
        node = self._root
        for t in ids:
            node = node.children.get(int(t)) or node.children.setdefault(int(t), _Node(node, int(t)))
        if node.entry is not None:
            self._lru.move_to_end(id(node))
            return True
        entry = PrefixEntry(snapshot, logits.detach().reshape(-1).clone(), len(ids))
        if entry.nbytes > self.budget_bytes:
            self._prune(node)
            return False
        while self.nbytes + entry.nbytes > self.budget_bytes:
            self._evict_oldest()
        node.entry = entry
        self._lru[id(node)] = node
        self.nbytes += entry.nbytes
        self.counts["inserted"] += 1
        return True

    def _evict_oldest(self) -> None:
        _, node = self._lru.popitem(last=False)
        self.nbytes -= node.entry.nbytes
        node.entry = None
        self.counts["evicted"] += 1
        self._prune(node)

    def _prune(self, node: _Node) -> None:
        """Remove `node` and its ancestors while they hold no entry and lead nowhere."""
        while node.parent is not None and node.entry is None and not node.children:
            del node.parent.children[node.token]
            node = node.parent

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> Dict[str, int]:
        """Counts (hits, misses, hit_tokens, inserted, evicted) and the present entries and bytes."""
        return {**self.counts, "entries": len(self._lru), "bytes": self.nbytes, "budget_bytes": self.budget_bytes}

    def keys(self) -> List[Tuple[int, ...]]:
        """The token ids of every entry (tests and debugging)."""
        out = []
        for node in self._lru.values():
            ids = []
            n = node
            while n.parent is not None:
                ids.append(n.token)
                n = n.parent
            out.append(tuple(reversed(ids)))
        return out
