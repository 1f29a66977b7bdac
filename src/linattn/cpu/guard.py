"""The decode plans' guard's common case in one compiled call (`csrc/guard.c`): "nothing changed".

`models/decode_plan.PlanGuard.valid` reads, every token, each dict's version tag and each tensor's data pointer and
(for the tensors the plan copied) version: ~1,500 Python reads at the 530M shape, each a chain of cache misses after
the token's weight stream. Those values are functions of a few machine words: a dict's `ma_version_tag`; a tensor
object's TensorImpl, the TensorImpl's StorageImpl, the StorageImpl's data pointer, the storage offset, numel and
dtype (data_ptr = data + offset * itemsize, or null when empty); the TensorImpl's version counter and its count.
A `WordGuard` records those words when the guard is built and compares them all in one call: equal words mean
equal pointers and versions, so the call can only say "unchanged"; on any difference the guard runs its Python
check, which stays the reference (and decides).

Safety: the words' offsets are CPython's and torch's private layouts, so they are found once per process on tensors
and dicts of our own, reading through /proc/self/mem (a wrong guess reads None or a wrong number, never faults),
and accepted only where every field follows what Python reports (`layout`); each guarded object is then checked
the same way when the guard is built (`word_guard`: any disagreement, an unusual tensor, no layout: None, the
Python check alone). The C call reads an address only after the pointer leading to it compared equal to its
record: the objects are the guard's, the TensorImpl is the one the object holds, the StorageImpl and counter are
the ones the guard's detached aliases hold. None when the kernels are off or guard.c cannot be built.
"""
from __future__ import annotations

import ctypes
from typing import Callable, List, Optional, Sequence

import torch

from . import bindings
from .build import enabled
from .prefetch import ProcessMemory, version_counter_offset

__all__ = ["WordGuard", "word_guard", "layout", "WORDS"]

#: the words recorded per tensor (csrc/guard.c GUARD_WORDS): object, TensorImpl, StorageImpl, data, offset, numel,
#: dtype
WORDS = 7
_LAYOUT: list = []   # [the layout or None], once per process
_DTYPE_CODES: dict = {}


def _first(offsets, ok: Callable[[int], bool]) -> Optional[int]:
    return next((o for o in offsets if ok(o)), None)


def _find_layout(mem: ProcessMemory, dict_version: Callable) -> Optional[tuple]:
    w = lambda a: mem.read(a, 8)   # noqa: E731
    dicts = [{"a": 1}, {"b": 2, "c": 3}, {}]
    dv = _first(range(8, 64, 8), lambda o: all(w(id(d) + o) == dict_version(d) for d in dicts))
    if dv is None:
        return None
    for d in dicts:   # (a write changes the tag the word holds)
        d["z"] = object()
        if w(id(d) + dv) != dict_version(d):
            return None
    ts = [torch.zeros(5), torch.nn.Parameter(torch.ones(3, 2)), torch.zeros(64, dtype=torch.int8)]
    cd = _first(range(16, 64, 8), lambda o: all(w(id(t) + o) == t._cdata for t in ts))
    so = _first(range(8, 256, 8), lambda o: all(w(t._cdata + o) == t.untyped_storage()._cdata for t in ts))
    if cd is None or so is None:
        return None
    do = _first(range(8, 64, 8), lambda o: all(w(t.untyped_storage()._cdata + o) == t.data_ptr() for t in ts))
    base = torch.zeros(64)
    views = [base[3:18].view(3, 5), base[5:19].view(7, 2), base[11:44].view(3, 11)]
    oo = _first(range(8, 256, 8), lambda o: all(w(v._cdata + o) == v.storage_offset() for v in views))
    no = _first(range(8, 256, 8), lambda o: all(w(v._cdata + o) == v.numel() for v in views))
    # the dtype: a 16-bit field equal for two float tensors of other shapes, different for each of five dtypes
    # viewing the same bytes (same sizes, storage and offset)
    f, g = torch.zeros(4), torch.zeros(2, 3)
    h = torch.zeros(4, dtype=torch.bfloat16)
    kinds = [f, f.view(torch.int32), h, h.view(torch.float16), h.view(torch.int16)]

    def is_dtype(o):
        vals = [mem.read(t._cdata + o, 2) for t in kinds]
        return None not in vals and len(set(vals)) == len(vals) and mem.read(g._cdata + o, 2) == vals[0]
    dt = _first(range(8, 256, 2), is_dtype)
    vc = version_counter_offset()
    if None in (do, oo, no, dt, vc):
        return None
    return (dv, cd, so, do, oo, no, dt, vc[0], vc[1])


def layout(dict_version: Callable) -> Optional[tuple]:
    """The offsets csrc/guard.c reads (its `lay`), found once per process on objects of our own (module docstring),
    or None where a field is not found or does not follow what Python reports."""
    if not _LAYOUT:
        try:
            mem = ProcessMemory()
        except OSError:
            _LAYOUT.append(None)
        else:
            try:
                _LAYOUT.append(_find_layout(mem, dict_version))
            finally:
                mem.close()
    return _LAYOUT[0]


def _dtype_code(mem: ProcessMemory, lay: tuple, dtype: torch.dtype) -> Optional[int]:
    if dtype not in _DTYPE_CODES:
        _DTYPE_CODES[dtype] = mem.read(torch.empty(1, dtype=dtype)._cdata + lay[6], 2)
    return _DTYPE_CODES[dtype]


def _record(mem: ProcessMemory, lay: tuple, t: torch.Tensor) -> Optional[List[int]]:
    """t's words (`WORDS`), checked against what Python reports, or None where it is not a plain strided CPU tensor
    with a storage or a word disagrees."""
    if (type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout != torch.strided or t.device.type != "cpu"
            or t.is_quantized or t.is_nested or not t.numel()):
        return None
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    impl, r = t._cdata, mem.read
    words = [id(t), impl, st._cdata, st.data_ptr(), t.storage_offset(), t.numel(), _dtype_code(mem, lay, t.dtype)]
    got = [id(t), r(id(t) + lay[1], 8), r(impl + lay[2], 8), r(st._cdata + lay[3], 8), r(impl + lay[4], 8),
           r(impl + lay[5], 8), r(impl + lay[6], 2)]
    if got != words or None in words or words[3] + words[4] * t.element_size() != t.data_ptr():
        return None
    return words


class WordGuard:
    """The recorded words of a guard's dicts and tensors; `self()`: whether every one is unchanged (module
    docstring). `dicts_again(versions)` records new dict version tags (after the Python check saw the dicts'
    entries unchanged)."""

    __slots__ = ("fn", "lay", "nd", "dicts", "dvers", "nt", "rec", "nv", "vrec")

    def __init__(self, fn, lay, dicts: List[int], dvers: List[int], rec: List[int], vrec: List[int]):
        self.fn, self.lay = fn, (ctypes.c_int64 * len(lay))(*lay)
        self.nd, self.nt, self.nv = len(dicts), len(rec) // WORDS, len(vrec) // 3
        self.dicts = (ctypes.c_uint64 * max(1, len(dicts)))(*dicts)
        self.dvers = (ctypes.c_uint64 * max(1, len(dvers)))(*dvers)
        self.rec = (ctypes.c_uint64 * max(1, len(rec)))(*rec)
        self.vrec = (ctypes.c_uint64 * max(1, len(vrec)))(*vrec)

    def __call__(self) -> bool:
        return self.fn(self.lay, self.nd, self.dicts, self.dvers, self.nt, self.rec, self.nv, self.vrec) == 1

    def dicts_again(self, versions: Sequence[int]) -> None:
        self.dvers[:self.nd] = list(versions)


def function():
    """`linattn_guard_same`, called with the GIL held, or None when the kernels are off or guard.c cannot be built.
    (ctypes lets the GIL go around a call of a CDLL's function: another thread could then swap a guarded tensor's
    TensorImpl and free it between the compare of its address and the reads through it.)"""
    if not enabled() or torch.compiler.is_compiling():
        return None
    lib = bindings.bind("guard")
    if lib is None:
        return None
    fn = lib.function("linattn_guard_same")   # (the library stays loaded for the process: build's cache holds it)
    if _HELD[0] is None or _HELD[0][0] is not fn:
        proto = ctypes.PYFUNCTYPE(fn.restype, *fn.argtypes)
        _HELD[0] = (fn, proto(ctypes.cast(fn, ctypes.c_void_p).value))
    return _HELD[0][1]


_HELD = [None]   # [(the CDLL's function, the same address as a PYFUNCTYPE: the GIL held)]


def word_guard(dicts: Sequence[dict], dict_version: Optional[Callable], tensors: Sequence[torch.Tensor],
               copied: Sequence[torch.Tensor]) -> Optional[WordGuard]:
    """A `WordGuard` of dicts' version tags (`dict_version`: the guard's reader), tensors' data pointers and the
    versions of `copied` (a subset of tensors), or None: no compiled function, no reader, no layout, or an object
    whose words disagree with what Python reports (module docstring). The caller keeps every object alive and
    detached aliases of the tensors (their storages and version counters)."""
    fn = function() if dict_version is not None else None
    lay = layout(dict_version) if fn is not None else None
    if lay is None:
        return None
    try:
        mem = ProcessMemory()
    except OSError:
        return None
    try:
        dvers = [dict_version(d) for d in dicts]
        if any(type(d) is not dict or mem.read(id(d) + lay[0], 8) != v for d, v in zip(dicts, dvers)):
            return None
        rec, index = [], {}
        for i, t in enumerate(tensors):
            words = _record(mem, lay, t)
            if words is None:
                return None
            rec += words
            index[id(t)] = i
        vrec = []
        for t in copied:
            i = index.get(id(t))
            vc = mem.read(t._cdata + lay[7], 8) if i is not None else None
            if not vc or mem.read(vc + lay[8], 4) != t._version:
                return None
            vrec += [i, vc, t._version]
    finally:
        mem.close()
    return WordGuard(fn, lay, [id(d) for d in dicts], dvers, rec, vrec)
