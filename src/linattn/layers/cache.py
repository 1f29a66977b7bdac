"""Decoding caches.

* `LayerCache`: the state of one module, in declared fields (recurrent state, convolution windows, token
  shift, keys/values, position offset). A layer called with `cache=LayerCache()` reads its state from it and
  writes the new one back, so prefill (many tokens) and decoding (one token at a time) just reuse the object.
* `KVCache`: the growing key/value store of softmax attention, preallocated in chunks so that
  appending a token is an in-place copy (optionally trimmed to a sliding window).
* `Cache`: the whole model's cache, one `LayerCache` per (block, module).

Every operation over states (copy, record, reorder, row selection and merging, sizes, the transformers
bridge of linattn.hf) is one walk with torch's pytree utilities (`map_state`, `flatten_state`): `LayerCache`
is a registered node, tensors, `KVCache` and tuples of per-row Python ints (`per_row_ints`) are leaves. The walk
answers a leaf (fn(leaf)) and a LayerCache (its fields by name, each value walked) before torch's flatten, which
builds a TreeSpec per node: the per-token operations (record, reorder, row merges, sizes) then cost what copying
the tensors costs; only a field that is itself a tree (a NamedTuple state, `extra`) goes through torch's walk.

`nbytes()` counts every tensor held (for the KV cache: the allocated capacity). Linear mixers
hold a constant-size state, so their `nbytes()` does not depend on the number of tokens seen.

Serving schedules (docs/states.md):

* `Cache(n, rollback=k)` (`LanguageModel.new_cache(rollback=k)`) can go back up to k tokens:
  the model records every layer's state after each of the last k tokens (`record`), and
  `crop(n)` keeps the first n tokens (transformers' `DynamicCache.crop` meaning: a negative n
  removes that many). A recorded state is a copy of the state tensors (recurrent states, conv
  windows, the per-token caches of FoX / DeltaFormer / PaTH), except for a `KVCache`, which is
  recorded as its length and cut back by truncation. Memory: up to k + 1 copies of the layers'
  states besides the live one (`history_nbytes()`), and a sliding-window KV cache keeps k tokens
  more than its window needs. A default cache (rollback 0) records nothing.
* `snapshot()` / `restore(snap)`: a deep copy of every layer's state (prefix caching); neither
  shares a tensor with the cache, so later decoding never changes a snapshot.
* `reorder(index)`: every state's batch rows (and the recorded ones) through index_select
  (beam search).
"""
from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ..errors import LinattnError, LinattnTypeError, UsageError


def per_row_ints(value: Any) -> bool:
    """A plain tuple / list of Python ints: one int per batch row (TTT's position in its mini-batch), one leaf."""
    return isinstance(value, (tuple, list)) and not hasattr(value, "_fields") and bool(value) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value)


def _is_leaf(value: Any) -> bool:
    """Whether the walk sees `value` as a leaf (no pytree node), told by its type alone where it can be: tensors,
    KV caches, numbers, strings, None and per-row int tuples."""
    return value is None or isinstance(value, (torch.Tensor, KVCache, int, float, str)) or per_row_ints(value)


def map_state(fn: Callable[..., Any], tree: Any, *rests: Any) -> Any:
    """`tree` (and `rests`, of the same structure) with every leaf replaced by fn(leaf, *rest_leaves): torch's
    `tree_map` with a tuple of per-row ints as one leaf (None is a leaf too).

    Decoding calls it per layer and token, so the cases that need no structure are answered before torch's
    flatten (which builds a TreeSpec per node): a leaf is fn(leaf); a LayerCache maps its fields by name, each
    value through this same walk."""
    if type(tree) is torch.Tensor or _is_leaf(tree):
        return fn(tree, *rests)
    if type(tree) is LayerCache:
        return _map_layer_cache(fn, tree, *rests)
    return pytree.tree_map(fn, tree, *rests, is_leaf=per_row_ints)


def _map_layer_cache(fn: Callable[..., Any], lc: "LayerCache", *others: "LayerCache") -> "LayerCache":
    """`map_state` of a LayerCache: a new one (without the fast path's view) of its mapped fields and offset."""
    return _rebuild(LayerCache.__new__(LayerCache), _map_fields(fn, lc, *others),
                    fn(lc._offset, *[o._offset for o in others]))


def flatten_state(tree: Any) -> Tuple[List[Any], pytree.TreeSpec]:
    """(leaves, structure) of a state, as `map_state` sees it; `pytree.tree_unflatten` rebuilds it."""
    if type(tree) is torch.Tensor or _is_leaf(tree):
        return [tree], _LEAF_SPEC
    return pytree.tree_flatten(tree, is_leaf=per_row_ints)


_LEAF_SPEC = pytree.tree_flatten(0)[1]   # torch's structure of a leaf


def tensor_nbytes(obj: Any) -> int:
    """Bytes of every tensor inside obj (tensors, KVCache, LayerCache, tuples, lists, dicts).

    Args:
        obj: What to measure.

    Returns:
        The total size in bytes.
    """
    leaves = [obj] if _is_leaf(obj) or isinstance(obj, LayerCache) else \
        pytree.tree_leaves(obj, is_leaf=lambda v: per_row_ints(v) or isinstance(v, LayerCache))
    return sum(map(_leaf_nbytes, leaves))


def _leaf_nbytes(leaf: Any) -> int:
    """Bytes of a tensor, or what an object with an `nbytes()` method (KVCache, LayerCache) reports; else 0."""
    if type(leaf) is torch.Tensor or isinstance(leaf, torch.Tensor):
        return leaf.numel() * leaf.element_size()
    return int(leaf.nbytes()) if callable(getattr(leaf, "nbytes", None)) else 0


@dataclass
class FastDecodeState:
    """What the single-token fast path (layers/fast_decode.py) keeps beside a cache's entries so that the next
    step finds its buffers whole: `window` the q | k | v conv windows as one `[B, C, K - 1]`, valid while
    conv["q"/"k"/"v"] are still the views `conv_views` of it; `linear_state` the linear-attention state [kv | z] as
    one `[B, HV, K, V + 1]`, valid while the cache's `state` is still `linear_of`. Never counted or copied as
    state: a cache whose entries were replaced simply rebuilds it."""

    conv_views: Optional[Tuple[torch.Tensor, ...]] = None
    window: Optional[torch.Tensor] = None
    linear_of: Any = None
    linear_state: Optional[torch.Tensor] = None


# the state fields of a LayerCache, in the order the walks see them (`offset` and `fast` aside)
STATE_FIELDS = ("state", "conv", "shift", "kv", "extra")
_dict_access_warned = False
_MIXINS_FILE = MutableMapping.get.__code__.co_filename   # (collections.abc's, frozen or not)


def _warn_dict_access() -> None:
    global _dict_access_warned
    if not _dict_access_warned:
        _dict_access_warned = True
        level, frame = 2, sys._getframe(1)   # point at the first caller outside this module and the Mapping mixins
        while frame is not None and frame.f_code.co_filename in (__file__, _MIXINS_FILE):
            level, frame = level + 1, frame.f_back
        warnings.warn("reading or writing a LayerCache as a dict (cache['state']) is deprecated: use its fields "
                      "(cache.state, cache.conv['q'], cache.shift, cache.kv, cache.offset; docs/states.md)",
                      DeprecationWarning, stacklevel=level)


def _holds(value: Any) -> bool:
    """Whether a field holds state (neither None nor an empty dict)."""
    return value is not None and not (isinstance(value, dict) and not value)


def _conv_name(key: str) -> Optional[str]:
    """The `conv` window a dict-style entry name means ("conv_q" -> "q", "conv" -> "in"), None for other names."""
    return "in" if key == "conv" else key[5:] if key.startswith("conv_") else None


class LayerCache(MutableMapping):
    """The decoding state of one module (docs/states.md lists each mixer's):

    * `state`: the recurrent state (a tensor, or a NamedTuple / tuple of them), None before the first call;
    * `conv`: the short convolutions' windows `[B, C, w - 1]` by the stream they convolve: "q", "k", "v"; "w"
      (PaTH's Householder directions); "in" (one convolution over the mixed input: Mamba2's x|B|C, RWKV-7's r|k|v);
    * `shift`: the last input token `[B, d_model]` (RWKV-7's token shift), or None;
    * `kv`: softmax attention's keys and values (a `KVCache`), or None;
    * `offset`: the tokens consumed: an int, or an int64 tensor `[B]` when the rows of a batch have consumed
      different numbers of tokens (a left-padded batch: row b's tokens are then the last offset[b] of every
      stored sequence);
    * `extra`: entries under other names (what a mixer writes through dict access);
    * `fast`: the decoding fast path's own view of the entries (`FastDecodeState`), None until it runs; never state.

    Dict access (`cache["state"]`, `cache.get("conv_q")`, ...) still works, with a `DeprecationWarning` (once):
    the names of the dict form map to the fields ("conv_q" is conv["q"], "conv" is conv["in"]), others to `extra`.

    Args:
        entries: A dict of the dict form (deprecated), mapped to the fields.
        state: The recurrent state.
        conv: The convolution windows by stream.
        shift: The token shift.
        kv: The keys and values.
        offset: The tokens consumed.
        extra: Entries under other names.
    """

    def __init__(self, entries: Optional[Dict[str, Any]] = None, *, state: Any = None,
                 conv: Optional[Dict[str, torch.Tensor]] = None, shift: Optional[torch.Tensor] = None,
                 kv: Any = None, offset: Any = 0, extra: Optional[Dict[str, Any]] = None):
        self.state, self.conv, self.shift, self.kv = state, dict(conv or {}), shift, kv
        self.offset = offset
        self.extra: Dict[str, Any] = dict(extra or {})
        self.fast: Optional[FastDecodeState] = None
        if entries:
            _warn_dict_access()
            for k, v in entries.items():
                self._set_entry(k, v)

    @property
    def offset(self):
        o = self._offset
        if isinstance(o, torch.Tensor) and o.dim() == 1:
            return o
        return int(o)

    @offset.setter
    def offset(self, value) -> None:
        self._offset = value

    def state_fields(self) -> Dict[str, Any]:
        """The fields that hold state, by name in `STATE_FIELDS` order (None and empty ones, and the offset, left
        out): what sizes, layouts and row merges walk."""
        return {n: v for n, v in zip(STATE_FIELDS, (self.state, self.conv, self.shift, self.kv, self.extra))
                if _holds(v)}

    def nbytes(self) -> int:
        total = 0
        for leaf in _state_leaves(self):   # (a loop: sizes are read per token by schedulers)
            total += leaf.nbytes if type(leaf) is torch.Tensor else _leaf_nbytes(leaf)
        return total

    def __repr__(self) -> str:
        held = [n for n in ("state", "shift", "kv") if getattr(self, n) is not None]
        held += [f"conv[{', '.join(self.conv)}]"] if self.conv else []
        held += [f"extra[{', '.join(self.extra)}]"] if self.extra else []
        return f"LayerCache(offset={self.offset}, [{', '.join(held)}], nbytes={self.nbytes()})"

    # -- the deprecated dict form ------------------------------------------------------------------------------
    def _entries(self) -> Dict[str, Any]:
        """The fields under their dict-form names (those that hold something)."""
        out = {k: getattr(self, k) for k in ("state", "shift", "kv") if getattr(self, k) is not None}
        out.update(("conv" if n == "in" else f"conv_{n}", t) for n, t in self.conv.items())
        out["offset"] = self._offset
        out.update(self.extra)
        return out

    def _set_entry(self, key: str, value: Any) -> None:
        conv = _conv_name(key)
        if key in ("state", "shift", "kv", "offset"):
            setattr(self, key, value)
        elif conv is not None:
            self.conv[conv] = value
        else:
            self.extra[key] = value

    def __getitem__(self, key: str) -> Any:
        _warn_dict_access()
        return self._entries()[key]

    def __setitem__(self, key: str, value: Any) -> None:
        _warn_dict_access()
        self._set_entry(key, value)

    def __delitem__(self, key: str) -> None:
        _warn_dict_access()
        conv = _conv_name(key)
        if key not in self._entries():
            raise KeyError(key)
        if key in ("state", "shift", "kv"):
            setattr(self, key, None)
        elif key == "offset":
            self._offset = 0
        elif conv is not None:
            del self.conv[conv]
        else:
            del self.extra[key]

    def __iter__(self):
        return iter(self._entries())

    def __len__(self) -> int:
        return len(self._entries())

    def __eq__(self, other: Any) -> bool:
        return self is other

    __hash__ = object.__hash__


def _flatten_layer_cache(lc: LayerCache):
    held = lc.state_fields()   # (the fields that hold nothing are no nodes: every walk is shorter)
    return [*held.values(), lc._offset], tuple(held)


def _unflatten_layer_cache(children, names) -> LayerCache:
    return LayerCache(**dict(zip(names, children)), offset=children[-1])


def _slots(lc: LayerCache) -> List[Tuple[str, Any]]:
    """(name, value) of what a LayerCache holds, `state_fields` order, its conv windows one by one ("conv.q"): the
    units the walks compare (the offset aside)."""
    out = [("state", lc.state)] if lc.state is not None and _holds(lc.state) else []
    out += [("conv." + s, w) for s, w in lc.conv.items()]
    return out + [(n, v) for n, v in (("shift", lc.shift), ("kv", lc.kv), ("extra", lc.extra))
                  if v is not None and _holds(v)]


def _map_fields(fn: Callable[..., Any], lc: LayerCache, *others: LayerCache) -> Dict[str, Any]:
    """The LayerCache field values (keyword arguments, the offset aside) of `map_state(fn, lc, *others)`."""
    values = (("state", lc.state), ("shift", lc.shift), ("kv", lc.kv), ("extra", lc.extra))
    if others:
        out: Dict[str, Any] = {"conv": {s: map_state(fn, w, *[o.conv[s] for o in others]) for s, w in lc.conv.items()}}
        out.update((name, map_state(fn, v, *[getattr(o, name) for o in others])) for name, v in values
                   if v is not None and _holds(v))
        return out
    # one tree, the common case (per layer and token): tensors and KV caches need no call of the walk
    out = {"conv": {s: fn(w) if type(w) is torch.Tensor else map_state(fn, w) for s, w in lc.conv.items()}}
    for name, v in values:
        if v is not None:
            if type(v) is torch.Tensor or type(v) is KVCache:
                out[name] = fn(v)
            elif _holds(v):
                out[name] = map_state(fn, v)
    return out


def _rebuild(lc: LayerCache, fields: Dict[str, Any], offset: Any) -> LayerCache:
    """`lc` made to hold `fields` (`_map_fields`) and `offset` instead, in place, without the fast path's view."""
    lc.state, lc.conv, lc.shift = fields.get("state"), fields["conv"], fields.get("shift")
    lc.kv, lc.extra, lc._offset, lc.fast = fields.get("kv"), fields.get("extra", {}), offset, None
    return lc


def _state_leaves(lc: LayerCache) -> List[Any]:
    """The leaves of what a LayerCache holds (the offset aside), in `flatten_state` order."""
    out: List[Any] = []
    for value in (lc.state, *lc.conv.values(), lc.shift, lc.kv, lc.extra or None):
        if value is None:
            continue
        if type(value) is torch.Tensor or _is_leaf(value):
            out.append(value)
        elif _holds(value):
            out += pytree.tree_leaves(value, is_leaf=per_row_ints)
    return out


pytree.register_pytree_node(LayerCache, _flatten_layer_cache, _unflatten_layer_cache,
                            serialized_type_name="linattn.layers.cache.LayerCache")


class KVCache:
    """Keys and values `[B, T, H, D]` in preallocated buffers that grow in whole chunks of `chunk`
    tokens (by at least half their size, so appending is amortised O(1) per token).

    With `window=w` only the last w-1 tokens can ever be attended again, so older ones are
    dropped (amortised: once the buffer holds w-1+chunk tokens). `start` is the absolute
    position of the first stored token.

    Args:
        chunk: The growth step, in tokens.
        window: A sliding window w (None: keep every token).
    """

    def __init__(self, chunk: int = 256, window: Optional[int] = None):
        self.chunk, self.window = int(chunk), window
        self.k: Optional[torch.Tensor] = None
        self.v: Optional[torch.Tensor] = None
        self.length = 0
        self.start = 0
        # tokens kept beyond the window's w - 1, so that a rollback of up to this many tokens still
        # finds the keys the window needs (set by a Cache with rollback)
        self.keep_extra = 0

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

    def reserve(self, T: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        """Make rows `length` .. `length + T - 1` of the buffers writable: drop what a window no longer needs, then
        grow (buffers shaped and typed like like_k / like_v `[B, *, H, D]`). `append` stores there; the compiled
        decoding step (models/decode_plan.py) writes the row itself and then advances `length`."""
        if self.window is not None and self.length + T > self.window - 1 + self.keep_extra + self.chunk and self.length:
            keep = min(self.length, max(self.window - 1 + self.keep_extra, 0))
            drop = self.length - keep
            if drop > 0:
                self.k[:, :keep] = self.k[:, drop: self.length].clone()
                self.v[:, :keep] = self.v[:, drop: self.length].clone()
                self.length, self.start = keep, self.start + drop
        self._grow(self.length + T, like_k, like_v)

    def append(self, k: torch.Tensor, v: torch.Tensor):
        """Store new keys/values and return all stored ones (views) with their first position.

        Args:
            k: New keys `[B, T, H, D]`.
            v: New values `[B, T, H, Dv]`.

        Returns:
            (k, v, start): every stored key and value (views of the buffers) and the absolute position of the first.
        """
        T = k.shape[1]
        self.reserve(T, k, v)
        self.k[:, self.length: self.length + T] = k
        self.v[:, self.length: self.length + T] = v
        self.length += T
        return self.k[:, : self.length], self.v[:, : self.length], self.start

    def nbytes(self) -> int:
        if self.k is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def copy(self) -> "KVCache":
        """A deep copy of the stored tokens (capacity trimmed to the length; the next append grows it)."""
        out = KVCache(chunk=self.chunk, window=self.window)
        out.length, out.start, out.keep_extra = self.length, self.start, self.keep_extra
        if self.k is not None:
            out.k = self.k[:, : self.length].clone()
            out.v = self.v[:, : self.length].clone()
        return out

    def mark(self) -> "_KVMark":
        """Where the stored tokens end now (a rollback record: no copy of the keys and values)."""
        return _KVMark(self.start + self.length)

    def truncate(self, end: int) -> None:
        """Forget every token from absolute position `end` on (a rollback to a `mark`).

        Args:
            end: The absolute position to cut at.
        """
        # the next query (position end) must still find the keys it attends: all of them, or the
        # window's last w - 1 (`keep_extra` keeps them through a rollback)
        first_needed = 0 if self.window is None else max(end - (self.window - 1), 0)
        if not (self.start <= first_needed and end <= self.start + self.length):
            raise LinattnError(f"cannot cut the KV cache back to position {end}: it holds positions "
                               f"{self.start} to {self.start + self.length}, and position {end} needs "
                               f"those from {first_needed}")
        self.length = end - self.start

    def index_select(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (beam search), in place.

        Args:
            index: The rows to keep, an int64 tensor.
        """
        if self.k is not None:
            self.k = self.k.index_select(0, index.to(self.k.device))
            self.v = self.v.index_select(0, index.to(self.v.device))

    def __repr__(self) -> str:
        return f"KVCache(length={self.length}, start={self.start}, nbytes={self.nbytes()})"


class _KVMark(int):
    """A recorded `KVCache`: the absolute position where its tokens ended (rolled back by truncation)."""


def _copy_leaf(value: Any) -> Any:
    """A copy of one leaf that shares no tensor with it (a KVCache deep-copied)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, KVCache):
        return value.copy()
    if per_row_ints(value):
        return type(value)(value)
    raise LinattnTypeError(f"a cache entry of type {type(value).__name__} cannot be copied: a layer's cache may hold "
                           f"tensors, KVCache, tuples / NamedTuples, lists, dicts, numbers and None")


def _copy_layers(layers: List[Dict[str, LayerCache]], record: bool = False) -> List[Dict[str, LayerCache]]:
    """A copy of a Cache's layers that shares no tensor with them (`_copy_leaf` through every LayerCache)."""
    copy = _record_leaf if record else _copy_leaf
    return [{name: _map_layer_cache(copy, lc) for name, lc in d.items()} for d in layers]


def _record_leaf(value: Any) -> Any:
    """`_copy_leaf`, except that a KVCache is only marked (a rollback cuts its keys and values back, no copy)."""
    if type(value) is torch.Tensor:
        return value.detach().clone()
    return value.mark() if isinstance(value, KVCache) else _copy_leaf(value)


def _select_leaf(index: torch.Tensor, value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.index_select(0, index.to(value.device)) if value.dim() else value
    if isinstance(value, KVCache):
        value.index_select(index)
        return value
    if per_row_ints(value):
        return type(value)(value[i] for i in index.tolist())
    return value


def _leaf_rows(value: Any) -> Optional[int]:
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else None
    if isinstance(value, KVCache):
        return None if value.k is None else int(value.k.shape[0])
    return None


def _batch_of(layers: List[Dict[str, LayerCache]]) -> Optional[int]:
    for d in layers:
        for lc in d.values():
            for leaf in _state_leaves(lc):
                n = _leaf_rows(leaf)
                if n is not None:
                    return n
    return None


def _leaf_layout(value: Any) -> Any:
    """What restoring a leaf over another must agree on: its kind, and for tensors their dtype and rank."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dim(), value.dtype)
    if isinstance(value, KVCache):
        return ("kv",) if value.k is None else ("kv", tuple(value.k.shape[2:]), value.k.dtype)
    return ("ints",) if per_row_ints(value) else type(value).__name__


def _layout(lc: LayerCache) -> Tuple[Any, ...]:
    """What restoring a LayerCache over another must agree on (the offset aside): the fields it holds, its conv
    streams, the structure of a field that is a tree, `_leaf_layout` of every leaf; () when it holds none."""
    kinds, trees = [], []
    for value in (lc.state, *lc.conv.values(), lc.shift, lc.kv, lc.extra or None):
        if value is None:
            continue
        if type(value) is torch.Tensor or _is_leaf(value):
            kinds.append(_leaf_layout(value))
        elif _holds(value):
            leaves, spec = flatten_state(value)
            trees.append(" ".join(str(spec).split()))
            kinds += map(_leaf_layout, leaves)
    if not kinds:
        return ()
    held = (lc.state is not None, lc.shift is not None, lc.kv is not None, bool(lc.extra))
    return (held, tuple(lc.conv), tuple(trees), tuple(kinds))


def layers_layout(layers: List[Dict[str, LayerCache]]) -> List[Dict[str, Tuple[Any, ...]]]:
    """Per layer and module, `_layout` of its LayerCache."""
    return [{name: _layout(lc) for name, lc in d.items()} for d in layers]


def _describe(layout: Tuple[Any, ...]) -> str:
    if not layout:
        return "nothing"
    held = [n for n, h in zip(("state", "shift", "kv", "extra"), layout[0]) if h]
    return f"fields {held}, conv {list(layout[1])}, trees {list(layout[2])}, leaves {list(layout[3])}"


def model_layout(config: Any, dtype: torch.dtype) -> Tuple[Tuple[str, str], ...]:
    """What a model's decoding states follow, cheaply (once per `LanguageModel.new_cache`): its config's fields and
    its parameters' dtype, as sorted (name, repr) pairs. Snapshots carry it; `restore` compares."""
    fields = vars(config) if hasattr(config, "__dict__") else {"config": config}
    return tuple(sorted((str(k), repr(v)) for k, v in fields.items())) + (("dtype", str(dtype)),)


class CacheSnapshot:
    """Every layer's state after `seen_tokens` tokens (`Cache.snapshot`); shares no tensor with any cache.
    `model_layout`: the model the cache belonged to (None: unknown); `batch`: its rows (None: no state yet);
    `layout`: `layers_layout` of the states."""

    def __init__(self, layers: List[Dict[str, LayerCache]], seen_tokens: int,
                 model_layout: Optional[Tuple[str, ...]] = None):
        self.layers, self.seen_tokens = layers, int(seen_tokens)
        self.model_layout = model_layout
        self.batch = _batch_of(layers)

    @functools.cached_property
    def layout(self) -> List[Dict[str, Tuple[Any, ...]]]:
        """`layers_layout` of the states, computed when a `restore` first compares it (a snapshot never changes)."""
        return layers_layout(self.layers)

    def nbytes(self) -> int:
        return sum(c.nbytes() for d in self.layers for c in d.values())

    def __repr__(self) -> str:
        return (f"CacheSnapshot(n_layers={len(self.layers)}, seen_tokens={self.seen_tokens}, batch={self.batch}, "
                f"nbytes={self.nbytes()})")


class Cache:
    """A model's decoding cache: `layers[i]` maps a module name ("mixer", "lobe") to its LayerCache.

    `seen_tokens` counts the tokens consumed so far. With `rollback=k` (module docstring) the model
    records the states after each of the last k tokens, and `crop` goes back to any of them.

    Args:
        n_layers: The model's number of blocks.
        rollback: k, how many tokens `crop` may later remove (0: none; the memory it costs: docs/states.md).

    Examples:
        >>> import torch
        >>> from linattn import LanguageModel, LMConfig
        >>> model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, mixer="gated-deltanet"))
        >>> ids = torch.randint(0, 64, (1, 10))
        >>> cache = model.new_cache(rollback=3)
        >>> _ = model(ids, cache=cache)
        >>> cache.seen_tokens
        10
        >>> cache.crop(8)                                  # back to the state after 8 tokens
        >>> cache.seen_tokens
        8
    """

    #: whether crop / snapshot / restore / reorder see the whole state (the layers and seen_tokens). A subclass
    #: that keeps more (TLinFormerCache: token ids, window bookkeeping) must opt in after handling it.
    state_ops = True
    #: the whole-model decoding step's buffers (models/decode_plan.ModelFastState), valid only while the layers'
    #: entries are still the views it made of them; never state (an operation that replaces entries makes it stale)
    fast: Any = None
    #: tokens the whole-model decoding step ran but has not yet written into the layers' entries
    #: (models/decode_plan.ModelPending, with `apply(cache)`): reading `layers` applies them first, so every reader
    #: sees the entries as if they were written token by token; never state of its own (a copy copies it along)
    pending: Any = None
    #: `model_layout(config, dtype)` of the model that made the cache (`LanguageModel.new_cache`), None when unknown:
    #: `restore` refuses a snapshot of another model
    model_layout: Optional[Tuple[str, ...]] = None

    @property
    def layers(self) -> List[Dict[str, LayerCache]]:
        """`layers[i]` maps a module name ("mixer", "lobe") of block i to its LayerCache."""
        p = self.pending
        if p is not None:
            self.pending = None
            p.apply(self)
        return self._layers

    @layers.setter
    def layers(self, value: List[Dict[str, LayerCache]]) -> None:
        self.pending = None   # replaced entries: the pending tokens ran on the old ones
        self._layers = value

    def __setstate__(self, state: Dict[str, Any]) -> None:
        if "layers" in state:   # pickled before `layers` became a property
            state["_layers"] = state.pop("layers")
        self.__dict__.update(state)

    def _check_state_ops(self, op: str) -> None:
        if type(self) is not Cache and not type(self).__dict__.get("state_ops", False):
            raise UsageError(f"{type(self).__name__} does not support {op}: it keeps state beyond its layers' "
                             f"entries (only linattn's Cache of a LanguageModel does; docs/states.md)")

    def __init__(self, n_layers: int, rollback: int = 0):
        if isinstance(rollback, bool) or not isinstance(rollback, int) or rollback < 0:
            raise LinattnError(f"rollback must be an int >= 0 (how many tokens crop may remove), got {rollback!r}")
        self.layers: List[Dict[str, LayerCache]] = [dict() for _ in range(n_layers)]
        self.seen_tokens = 0
        self.rollback = rollback
        # (seen_tokens, recorded layers), oldest first; the empty state is the first record
        self._history: List[Tuple[int, List[Dict[str, LayerCache]]]] = [(0, [dict() for _ in range(n_layers)])] \
            if rollback else []

    # -- rollback ----------------------------------------------------------------------------
    def record(self) -> None:
        """Record every layer's state now (after `seen_tokens` tokens) and forget records older than
        the window; the model calls it after each token it runs one at a time. No-op without rollback."""
        if not self.rollback:
            return
        for d in self.layers:    # a sliding window must keep its keys through a rollback
            for lc in d.values():
                if isinstance(lc.kv, KVCache):
                    lc.kv.keep_extra = max(lc.kv.keep_extra, self.rollback)
        n = self.seen_tokens
        self._history = [(s, rec) for s, rec in self._history if n - self.rollback <= s < n]
        self._history.append((n, _copy_layers(self.layers, record=True)))

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens: transformers' `DynamicCache.crop`.

        A negative value removes that many; a length at or beyond `seen_tokens` changes nothing. Needs `rollback`
        of at least the number of tokens removed (`model.new_cache(rollback=k)`).

        Args:
            max_length: The tokens to keep, or a negative number of tokens to remove.

        Raises:
            LinattnTypeError: max_length is not an int.
            UsageError: More tokens removed than the cache holds, or than its rollback window keeps.
        """
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise LinattnTypeError(f"crop takes an int (tokens to keep, or a negative number to remove), got "
                                   f"{max_length!r}")
        n = self.seen_tokens + max_length if max_length < 0 else max_length
        if n >= self.seen_tokens:
            return
        self._check_state_ops("crop")
        if n < 0:
            raise UsageError(f"crop({max_length}) removes more tokens than the cache holds ({self.seen_tokens})")
        rec = next((r for s, r in self._history if s == n), None)
        if rec is None:
            if not self.rollback:
                raise UsageError(f"crop({max_length}): this cache keeps no past states (rollback=0); make it with "
                                 f"model.new_cache(rollback=k) to remove up to k tokens")
            oldest = min((s for s, _ in self._history), default=self.seen_tokens)
            raise UsageError(f"crop({max_length}) would go back {self.seen_tokens - n} tokens, to {n}; this cache "
                             f"(rollback={self.rollback}) can go back to {oldest} at the earliest (seen_tokens "
                             f"{self.seen_tokens})")
        self._set_layers(rec)
        self.seen_tokens = n
        self._history = [(s, r) for s, r in self._history if s <= n]

    def _set_layers(self, rec: List[Dict[str, LayerCache]]) -> None:
        """Live layers from recorded ones: tensors copied (the record may be needed again), KV caches cut back."""
        live = _copy_layers(rec)
        for i, d in enumerate(rec):
            for name, lc in d.items():
                if isinstance(lc.kv, _KVMark):
                    kv = live[i][name].kv = self.layers[i][name].kv
                    kv.truncate(int(lc.kv))
        self.layers = live

    def history_nbytes(self) -> int:
        """Bytes held by the recorded states (the cost of `rollback`; 0 without it).

        Returns:
            The size in bytes.
        """
        return sum(c.nbytes() for _, rec in self._history for d in rec for c in d.values())

    # -- prefix caching, beams -----------------------------------------------------------------
    def snapshot(self) -> CacheSnapshot:
        """A deep copy of every layer's state (KV caches included): `restore` it into this or a fresh cache.

        Returns:
            The `CacheSnapshot`, which records the layout it was taken from (the model, the batch size, the
            entries' kinds and dtypes) for `restore` to check.
        """
        self._check_state_ops("snapshot")
        return CacheSnapshot(_copy_layers(self.layers), self.seen_tokens, getattr(self, "model_layout", None))

    def restore(self, snap: CacheSnapshot) -> None:
        """Continue from `snap` (its tensors are copied again, so it can be restored any number of times).

        The rollback window restarts at the restored position.

        Args:
            snap: A `snapshot()` of a cache of the same model.

        Raises:
            LinattnError: `snap` comes from another model (other mixers, sizes or dtypes), holds another number of
                layers, or, into a cache that holds states, another batch size or other kinds of entries.
        """
        self._check_state_ops("restore")
        if not isinstance(snap, CacheSnapshot):
            raise LinattnTypeError(f"restore takes a CacheSnapshot (cache.snapshot()), got {type(snap).__name__}")
        if len(snap.layers) != len(self.layers):
            raise LinattnError(f"the snapshot holds {len(snap.layers)} layers, this cache {len(self.layers)}")
        self._check_same_model(snap)
        self.layers = _copy_layers(snap.layers)
        self.seen_tokens = snap.seen_tokens
        self._history = []
        self.record()

    def _check_same_model(self, snap: CacheSnapshot) -> None:
        mine = getattr(self, "model_layout", None)
        if mine is not None and snap.model_layout is not None and tuple(mine) != tuple(snap.model_layout):
            here, there = dict(mine), dict(snap.model_layout)
            diff = [k for k in sorted(set(here) | set(there)) if here.get(k) != there.get(k)]
            raise LinattnError("the snapshot comes from another model: " + "; ".join(
                f"its {k} is {there.get(k, 'unset')}, this cache's model's {here.get(k, 'unset')}" for k in diff[:4]))
        live = self.layers
        batch = _batch_of(live)
        if batch is not None and snap.batch is not None and batch != snap.batch:
            raise LinattnError(f"the snapshot holds {snap.batch} batch rows, this cache {batch}; restore it into a "
                               f"fresh cache (model.new_cache()) to continue with {snap.batch} rows")
        for i, (here, there) in enumerate(zip(layers_layout(live), snap.layout)):
            for name in set(here) & set(there):
                if here[name] and there[name] and here[name] != there[name]:
                    raise LinattnError(f"the snapshot's layer {i} ({name}) holds {_describe(there[name])}, this "
                                       f"cache's {_describe(here[name])}: it comes from another model")

    def reorder(self, index: torch.Tensor) -> None:
        """Keep batch rows `index` (as transformers' `reorder_cache(beam_idx)`).

        Every state's dim 0 is indexed, recorded states included.

        Args:
            index: The rows to keep, an int64 (or int32) tensor `[B']` of values in [0, B).

        Raises:
            LinattnError: `index` is not a 1-D integer tensor, or names a row the cache does not have.
        """
        if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
            raise LinattnError(f"index must be a 1-D int64 tensor of batch rows, got "
                               f"{getattr(index, 'dtype', type(index).__name__)} {tuple(getattr(index, 'shape', ()))}")
        self._check_state_ops("reorder")
        index = index.long()
        batch = _batch_of(self.layers)
        if index.numel() and batch is not None and not bool(((index >= 0) & (index < batch)).all()):
            bad = sorted({i for i in index.tolist() if not 0 <= i < batch})
            raise LinattnError(f"index names rows {bad[:8]} the cache does not have: it holds rows 0..{batch - 1}")
        self.fast = None   # the whole-model step's buffers hold the old rows
        select = functools.partial(_select_leaf, index)
        for layers in [self.layers] + [rec for _, rec in self._history]:
            for d in layers:
                for lc in d.values():   # in place (no `fast`: the fast steps' views held the old rows)
                    _rebuild(lc, _map_fields(select, lc), select(lc._offset))

    def layer(self, i: int, name: str) -> LayerCache:
        """The `LayerCache` of module `name` ("mixer", "lobe") in block `i`, created empty on first use.

        Args:
            i: The block index.
            name: The module's name in the block.

        Returns:
            The `LayerCache`.
        """
        d = self.layers[i]
        if name not in d:
            d[name] = LayerCache()
        return d[name]

    def nbytes(self) -> int:
        """Bytes of the live states (the recorded ones: `history_nbytes`)."""
        return sum(c.nbytes() for d in self.layers for c in d.values())

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterable[Dict[str, LayerCache]]:
        return iter(self.layers)

    def __repr__(self) -> str:
        extra = f", rollback={self.rollback}, history_nbytes={self.history_nbytes()}" if self.rollback else ""
        return f"Cache(n_layers={len(self.layers)}, seen_tokens={self.seen_tokens}, nbytes={self.nbytes()}{extra})"

    # -- rows of a running batch (continuous batching) -------------------------------
    @property
    def n_rows(self) -> int:
        """The batch rows this cache holds (0 while empty)."""
        return _rows_of_layers(self.layers)

    def snapshot_rows(self, rows) -> CacheSnapshot:
        """A copy of the state of batch rows `rows` only (shares no tensor with the cache).

        Rows of a batch whose positions differ (per-row offsets, left-padded KV caches) come out as single
        sequences again: each row's own keys and values, its own int offset.

        Args:
            rows: Row indices (a list of ints or a 1-D int tensor), in the order wanted.

        Returns:
            A `CacheSnapshot` of len(rows) rows (`seen_tokens`: the first row's tokens).

        Raises:
            LinattnError: A row out of range, or no rows asked for.
        """
        self._check_state_ops("snapshot_rows")
        index = _row_index(rows, self.n_rows)
        layers = [{name: _take_rows(lc, index) for name, lc in d.items()} for d in self.layers]
        return CacheSnapshot(layers, _first_row_tokens(layers, self.seen_tokens))

    def insert_rows(self, snap: CacheSnapshot) -> None:
        """Append the rows of `snap` to this batch (a request joins a running batch); its tensors are copied.

        Rows at other positions than the batch's are kept exact: offsets become per-row `[B]` tensors and softmax
        KV caches are left-padded to a common length (the padding is masked: docs/serving.md). An empty cache takes
        the snapshot as it is.

        Args:
            snap: A `snapshot()` / `snapshot_rows()` of a cache of the same model.

        Raises:
            LinattnError: The snapshot is of another model or mixer (its layout differs), or its states cannot
                share a batch with these (`rows_mergeable` says why).
        """
        self._check_state_ops("insert_rows")
        if not isinstance(snap, CacheSnapshot):
            raise LinattnTypeError(f"insert_rows takes a CacheSnapshot (cache.snapshot_rows(rows)), got "
                                   f"{type(snap).__name__}")
        problem = self.rows_mergeable(snap)
        if problem:
            raise LinattnError(f"cannot insert these rows: {problem}")
        self.fast = None   # the whole-model step's buffers hold the old rows
        if not self.n_rows:
            self.layers, self.seen_tokens = _copy_layers(snap.layers), snap.seen_tokens
            return
        n = self.n_rows
        for d, sd in zip(self.layers, snap.layers):
            for name, lc in d.items():   # in place (no `fast`: the fast steps' views held the old rows)
                _rebuild(lc, *_merge_rows(lc, sd[name], n))
        self.seen_tokens = max(self.seen_tokens, snap.seen_tokens)

    def remove_rows(self, rows) -> None:
        """Drop batch rows `rows` (requests that finished); the others keep their order.

        Args:
            rows: Row indices (a list of ints or a 1-D int tensor).
        """
        self._check_state_ops("remove_rows")
        n = self.n_rows
        drop = set(_row_index(rows, n).tolist())
        keep = [i for i in range(n) if i not in drop]
        if not keep:
            self.layers = [dict() for _ in self.layers]
            self.seen_tokens, self.fast = 0, None
            self._history = []
            return
        self.reorder(torch.tensor(keep, dtype=torch.long))
        for d in self.layers:
            for lc in d.values():
                if isinstance(lc.kv, KVCache) and lc.kv.k is not None and isinstance(lc.offset, torch.Tensor):
                    _trim_padding(lc.kv, lc)

    def rows_mergeable(self, snap: CacheSnapshot) -> Optional[str]:
        """Why the rows of `snap` cannot join this batch (None: they can).

        A different layout (another model or mixer: other modules, entries, dtypes or state sizes) is refused;
        per-token states other than a softmax KV cache (FoX, DeltaFormer, PaTH) join only rows at the same
        position.

        Args:
            snap: A `CacheSnapshot`.

        Returns:
            None, or the reason as a sentence.
        """
        if len(snap.layers) != len(self.layers):
            return f"the rows hold {len(snap.layers)} layers, this cache {len(self.layers)}"
        if not self.n_rows:
            return None
        for i, (d, sd) in enumerate(zip(self.layers, snap.layers)):
            if sorted(d) != sorted(sd):
                return f"block {i} holds modules {sorted(sd)}, this cache {sorted(d)}"
            for name, lc in d.items():
                why = _merge_problem(lc, sd[name])
                if why:
                    return f"block {i} {name} {why}"
        return None


def _row_index(rows, n: int) -> torch.Tensor:
    """`rows` as a checked int64 index into n rows."""
    index = torch.as_tensor(rows, dtype=torch.long) if not isinstance(rows, torch.Tensor) else rows
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32) or index.numel() == 0:
        raise LinattnError(f"rows must be a non-empty 1-D list or int tensor of row indices, got {rows!r}")
    if bool(((index < 0) | (index >= n)).any()):
        raise LinattnError(f"rows {index.tolist()} out of range: this cache holds {n} rows")
    return index.long()


def _rows_of_layers(layers: List[Dict[str, LayerCache]]) -> int:
    """The rows of the first entry that has any (a per-row offset counts, unlike `_batch_of`); 0 when none."""
    for d in layers:
        for lc in d.values():
            for leaf in (*_state_leaves(lc), lc._offset):
                n = _leaf_rows(leaf)
                if n is not None:
                    return n
    return 0


def _kv_row_lengths(kv: KVCache, lc: LayerCache) -> torch.Tensor:
    """The tokens row b really holds in `kv` (the rest is left padding): min(its offset, stored slots)."""
    n = kv.k.shape[0]
    off = lc.offset
    off = off.long().cpu() if isinstance(off, torch.Tensor) else torch.full((n,), kv.start + kv.length)
    return off.clamp(max=kv.length)


def _take_rows(lc: LayerCache, index: torch.Tensor) -> LayerCache:
    """A copy of rows `index` of a LayerCache; a KV cache row as a single sequence (its padding cut off)."""
    def take(value):
        if isinstance(value, KVCache):
            return _take_kv_rows(value, index, lc)
        return _copy_leaf(_select_leaf(index, value))

    off = lc._offset
    if isinstance(off, torch.Tensor) and off.dim() == 1 and index.numel() == 1:
        off = int(off[int(index[0])])
    return LayerCache(**_map_fields(take, lc), offset=take(off))


def _take_kv_rows(value: KVCache, index: torch.Tensor, lc: LayerCache) -> KVCache:
    if value.k is None or index.numel() != 1:
        out = value.copy()
        out.index_select(index)
        return out
    b = int(index[0])
    n = int(_kv_row_lengths(value, lc)[b])
    out = KVCache(chunk=value.chunk, window=value.window)
    out.k = value.k[b:b + 1, value.length - n:value.length].clone()
    out.v = value.v[b:b + 1, value.length - n:value.length].clone()
    out.length, out.keep_extra = n, value.keep_extra
    out.start = _row_offset(lc, b) - n
    return out


def _row_offset(lc: LayerCache, b: int) -> int:
    off = lc.offset
    return int(off[b]) if isinstance(off, torch.Tensor) else int(off)


def _first_row_tokens(layers: List[Dict[str, LayerCache]], default: int) -> int:
    lc = next((lc for d in layers for lc in d.values()), None)
    if lc is None:
        return default
    off = lc.offset
    return int(off[0]) if isinstance(off, torch.Tensor) else int(off)


def _merge_problem(lc: LayerCache, other: LayerCache) -> Optional[str]:
    """Why the rows of `other` cannot be stacked under those of `lc` (None: they can); the offsets always can (an
    int or a per-row `[B]`)."""
    fa, fb = _slots(lc), _slots(other)
    if [n for n, _ in fa] != [n for n, _ in fb]:
        return f"the rows hold entries {[n for n, _ in fb]}, this cache {[n for n, _ in fa]}"
    for (name, va), (_, vb) in zip(fa, fb):
        if _is_leaf(va) and _is_leaf(vb):
            why = _leaf_merge_problem(va, vb)
            if why:
                return f"entry {name!r}: {why}"
            continue
        (la, sa), (lb, sb) = flatten_state(va), flatten_state(vb)
        if sa != sb:
            return f"entry {name!r}: the rows hold {' '.join(str(sb).split())}, this cache {' '.join(str(sa).split())}"
        why = next((w for w in map(_leaf_merge_problem, la, lb) if w), None)
        if why:
            return f"entry {name!r}: {why}"
    return None


def _leaf_merge_problem(a: Any, b: Any) -> Optional[str]:
    """Why leaves a (the batch's) and b (the new rows') cannot be stacked (None: they can)."""
    if isinstance(a, KVCache) or isinstance(b, KVCache):
        if not (isinstance(a, KVCache) and isinstance(b, KVCache)):
            return "a KV cache against another kind of state"
        if (a.k is None) != (b.k is None) or a.window != b.window:
            return "KV caches of another window or an empty one"
        if a.k is not None and (a.k.shape[2:] != b.k.shape[2:] or a.v.shape[2:] != b.v.shape[2:]
                                or a.k.dtype != b.k.dtype):
            return f"KV heads/sizes {tuple(b.k.shape[2:])} {b.k.dtype}, the batch's {tuple(a.k.shape[2:])} {a.k.dtype}"
        return None
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"a tensor against {type(b).__name__}"
        if a.dim() != b.dim() or a.dtype != b.dtype or (a.dim() and a.shape[1:] != b.shape[1:]):
            return f"a {b.dtype} tensor of row shape {tuple(b.shape[1:])}, the batch's {a.dtype} {tuple(a.shape[1:])}"
        if not a.dim() and not torch.equal(a, b):
            return "scalar states that differ"
        return None
    if per_row_ints(a) and per_row_ints(b):
        return None
    if type(a) is not type(b) or (a != b and not isinstance(a, int)):
        return f"{b!r}, the batch's {a!r}"
    return None


def _merge_rows(lc: LayerCache, other: LayerCache, n: int) -> Tuple[Dict[str, Any], Any]:
    """(fields, offset) of LayerCache lc (n rows) with other's rows appended (copied)."""
    def merge(a, b):
        if isinstance(a, KVCache):
            return _merge_kv(a, b, lc, other)
        if isinstance(a, torch.Tensor):
            return torch.cat([a, b.to(a.device)]) if a.dim() else a
        return type(a)([*a, *b]) if per_row_ints(a) else a

    ra = lc.offset if isinstance(lc.offset, torch.Tensor) else torch.full((n,), lc.offset, dtype=torch.long)
    rb = other.offset if isinstance(other.offset, torch.Tensor) else torch.full(
        (_rows_of_layers([{"x": other}]) or 1,), other.offset, dtype=torch.long)
    both = torch.cat([ra.long().cpu(), rb.long().cpu()])
    offset = int(both[0]) if bool((both == both[0]).all()) and not _has_padding(lc, other) else both
    return _map_fields(merge, lc, other), offset


def _has_padding(lc: LayerCache, other: LayerCache) -> bool:
    """Whether the merged KV cache of these entries has a left-padded row (its offsets must then stay per row)."""
    kv_a, kv_b = lc.kv, other.kv
    if not isinstance(kv_a, KVCache) or kv_a.k is None or not isinstance(kv_b, KVCache) or kv_b.k is None:
        return False
    lengths = torch.cat([_kv_row_lengths(kv_a, lc), _kv_row_lengths(kv_b, other)])
    return bool((lengths != max(kv_a.length, kv_b.length)).any())


def _trim_padding(kv: KVCache, lc: LayerCache) -> None:
    """Drop the left padding no row needs any more (its longest row left the batch)."""
    pad = kv.length - int(_kv_row_lengths(kv, lc).max())
    if pad > 0:
        kv.k, kv.v = kv.k[:, pad:kv.length], kv.v[:, pad:kv.length]
        kv.length, kv.start = kv.length - pad, kv.start + pad


def _merge_kv(a: KVCache, b: KVCache, lc: LayerCache, other: LayerCache) -> KVCache:
    """One KV cache of a's rows then b's, right-aligned in L = the longer length (the rest zero padding, which the
    softmax layer masks for rows with per-row offsets)."""
    if a.k is None:
        return a
    L = max(a.length, b.length)
    out = KVCache(chunk=a.chunk, window=a.window)
    na = a.k.shape[0]
    nb = b.k.shape[0]
    out.k = a.k.new_zeros(na + nb, L, *a.k.shape[2:])
    out.v = a.v.new_zeros(na + nb, L, *a.v.shape[2:])
    out.k[:na, L - a.length:] = a.k[:, :a.length]
    out.v[:na, L - a.length:] = a.v[:, :a.length]
    out.k[na:, L - b.length:] = b.k[:, :b.length].to(a.k.device)
    out.v[na:, L - b.length:] = b.v[:, :b.length].to(a.v.device)
    out.length, out.keep_extra = L, max(a.keep_extra, b.keep_extra)
    out.start = max(a.start + a.length, b.start + b.length) - L
    return out
