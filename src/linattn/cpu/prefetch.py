"""Cache lines asked for ahead of a pass that reads them one after another (`csrc/prefetch.c`): the decode plans'
guard (`models/decode_plan.PlanGuard`) reads ~500 tensors' data pointers and versions per token, each two or three
dependent cache misses after the token's weight stream, one at a time since Python reads them in order; a
`Prefetcher` built with the guard asks for every line those reads touch at once, at the top of each check.

What a tensor's reads touch (CPython's and torch's layouts, read once when the list is built): its Python object,
its TensorImpl, its StorageImpl and its version counter (found by `version_counter_offset`, checked on tensors of
our own; None where it cannot be: then no version counter lines). A prefetch never faults and changes nothing, so a
stale address (a tensor since replaced, a storage swapped) costs one useless line; the check's reads, and so its
result, are the same with or without it. `prefetcher(...)` is None when the kernels are off or prefetch.c cannot be
built: the check then runs as it did without one.
"""
from __future__ import annotations

import ctypes
import os
import sys
from typing import Callable, Iterable, List, Optional, Union

import torch

from . import bindings
from .build import enabled

__all__ = ["Prefetcher", "prefetcher", "tensor_addresses", "list_addresses", "version_counter_offset",
           "ProcessMemory"]

LINE = 64
#: the byte ranges of a TensorImpl its data pointer and version reads touch (torch 2.x: the storage and version
#: counter in its first 48 bytes, the storage offset, numel, dtype and flags at 144-176; more lines only fill the
#: cache and the queue of misses)
TENSOR_IMPL_RANGES = ((0, 48), (144, 176))
#: the bytes of a StorageImpl its data pointer read touches (the DataPtr at 16, the flags before 64)
STORAGE_IMPL_BYTES = 64
_VC = []   # [(offset in the TensorImpl, offset of the count in the counter) or None], once per process


class ProcessMemory:
    """Reads of this process's memory through /proc/self/mem: an address that is not mapped gives None, not a fault
    (the layouts' searches here and in `guard` read words that may not be pointers). Raises OSError when the file
    cannot be opened."""

    def __init__(self):
        self.fd = os.open("/proc/self/mem", os.O_RDONLY)

    def close(self) -> None:
        os.close(self.fd)

    def read(self, addr: int, size: int) -> Optional[int]:
        """The size bytes at addr as an unsigned number in the machine's byte order, or None."""
        try:
            got = os.pread(self.fd, size, addr)
        except (OSError, OverflowError, ValueError):
            return None
        return int.from_bytes(got, sys.byteorder) if len(got) == size else None


def _find_version_counter() -> Optional[tuple]:
    try:
        mem = ProcessMemory()
    except OSError:
        return None
    try:
        return _search_version_counter(mem)
    finally:
        mem.close()


def _search_version_counter(mem: ProcessMemory) -> Optional[tuple]:
    word = ctypes.c_uint64.from_address
    t, other = torch.zeros(3), torch.zeros(3)
    alias = t.detach()   # (its own TensorImpl, t's storage and version counter)
    storage = t.untyped_storage()._cdata
    for off in range(8, 64, 8):   # (inside the TensorImpl: these words are ours to read)
        p = word(t._cdata + off).value
        if (p == 0 or p % 8 or p == storage or p != word(alias._cdata + off).value
                or p == word(other._cdata + off).value):
            continue
        for cnt in (8, 12, 16, 20, 24):
            seen = []
            for _ in range(3):
                got = mem.read(p + cnt, 4)   # (p may not be a pointer: read where a bad address cannot fault)
                if got is None:
                    break
                seen.append((got, t._version))
                t.add_(1)
            if len(seen) == 3 and all(a == b for a, b in seen) and seen[0][0] != seen[-1][0]:
                return off, cnt
    return None


def version_counter_offset() -> Optional[tuple]:
    """(where a TensorImpl holds its version counter's address, where the counter holds its count), found once on
    tensors of our own (a word shared with a detached alias, not with another tensor, whose target follows
    `_version` over three in-place writes), or None where no word does (then no counter lines are asked for)."""
    if not _VC:
        _VC.append(_find_version_counter())
    return _VC[0]


def tensor_addresses(t: torch.Tensor, version: bool = True) -> List[int]:
    """The addresses `t.data_ptr()` (and `t._version` with `version`) read: the Python object, the TensorImpl, the
    StorageImpl, the version counter."""
    impl = t._cdata
    out = [id(t), id(t) + 31] + [impl + a for r in TENSOR_IMPL_RANGES for a in (r[0], r[1] - 1)]
    try:
        st = t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):   # (a tensor without a storage: its own data_ptr says so)
        st = None
    if st:
        out += [st + 16, st + STORAGE_IMPL_BYTES - 1]
    vc = version_counter_offset() if version else None
    if vc is not None:
        p = ctypes.c_uint64.from_address(impl + vc[0]).value
        if p:
            out += [p, p + vc[1] + 3]
    return out


def list_addresses(items: list) -> List[int]:
    """The addresses of a list's object and its item array (CPython's `ob_item`, after the object header and size),
    then of each item's object."""
    out = [id(items)]
    if sys.implementation.name == "cpython" and items:
        arr = ctypes.c_void_p.from_address(id(items) + 3 * ctypes.sizeof(ctypes.c_void_p)).value or 0
        if arr:
            out += list(range(arr, arr + 8 * len(items), LINE)) + [arr + 8 * len(items) - 1]
    return out + [id(x) for x in items]


class Prefetcher:
    """The lines of a list of addresses (first occurrence order), asked for by one call: `self()`. `addresses` a
    callable: the list is made on the first call (the guard's, ~7,900 lines at the 530M shape and ~7 ms to make, is
    needed only where its compiled words say "changed", or it has none)."""

    __slots__ = ("fn", "n", "lines", "source")

    def __init__(self, fn, addresses: Union[Iterable[int], Callable[[], Iterable[int]]]):
        self.fn, self.n, self.lines, self.source = fn, 0, None, addresses
        if not callable(addresses):
            self._make()

    def _make(self) -> None:
        lines = dict.fromkeys(a & ~(LINE - 1) for a in (self.source() if callable(self.source) else self.source) if a)
        self.n, self.source = len(lines), None
        self.lines = (ctypes.c_uint64 * self.n)(*lines)

    def __call__(self) -> None:
        if self.lines is None:
            self._make()
        self.fn(self.n, self.lines)

    def addresses(self) -> List[int]:
        """The lines asked for, in order (the tests); made first where they were not yet."""
        if self.lines is None:
            self._make()
        return list(self.lines)


def function():
    """`linattn_prefetch_lines`, or None when the kernels are off or prefetch.c cannot be built."""
    if not enabled() or torch.compiler.is_compiling():
        return None
    lib = bindings.bind("prefetch")
    return None if lib is None else lib.function("linattn_prefetch_lines")


def prefetcher(addresses: Callable[[], Iterable[int]]) -> Optional[Prefetcher]:
    """A `Prefetcher` of the addresses `addresses()` gives, or None without the compiled function (module docstring);
    the list is made on its first call."""
    fn = function()
    return None if fn is None else Prefetcher(fn, addresses)
