"""Weights on transparent huge pages (2 MiB) for CPU decoding.

A decoded token streams every weight once. On a machine whose transparent huge pages are in `madvise` mode (the
kernel gives 2 MiB pages only to memory that asks for them) torch's allocations sit on 4 KiB pages, and under a
virtual machine's nested paging the TLB misses of that stream cost a large part of the read rate (measured on the
project's 2-core VM: a 1 GiB read at 8-10 GB/s on 4 KiB pages, 14.3-14.6 GB/s on 2 MiB pages).

`place_module(module)` moves a module's large parameters and buffers onto mappings that asked for huge pages, in
place: every tensor object stays the same object (a Parameter stays the Parameter an optimiser holds, with its
`requires_grad`), tensors that share a storage (tied weights) still share one, the values are the same bits, and
the old storage is freed. `empty(n, dtype)` gives a fresh buffer on huge pages, `place_copy(t)` a tensor nobody
else holds moved there.

The design (three were weighed):

* (a, chosen) one anonymous mapping per storage: `mmap` of exactly the storage's bytes (rounded up to 4 KiB) at a
  2 MiB-aligned address, `madvise(MADV_HUGEPAGE)` before the first touch, the bytes copied in, and every tensor of
  the storage re-pointed at it (`Tensor.set_` with its own offset, size and strides). A storage is exactly the
  bytes it had, so `torch.save`, safetensors and `save_pretrained` write the same files as before. The mapping is
  trimmed to the storage (the unaligned head and the slack are unmapped), so no 2 MiB page covers bytes that are
  not the tensor's; the kernel's khugepaged then has nothing beyond the tensor to collapse. When the storage is
  freed the mapping is kept for reuse (up to `POOL_BYTES`) or unmapped. Cost: one copy, once; on the project's VM
  faulting fresh 2 MiB pages in is the expensive part (1.5 s per 256 MiB, against 0.5 s on 4 KiB pages).
* (b) `madvise(MADV_COLLAPSE)` on the existing storage: no copy of ours (the kernel copies), but only the 2 MiB-
  aligned interior of each allocation can collapse (torch's allocations are 64-byte aligned: the ends of every
  tensor stay on 4 KiB pages), it needs Linux >= 6.1, and it fails where the kernel cannot find huge pages at once:
  measured on the project's VM (kernel 6.18) it collapsed 76-92 MiB of a 256 MiB tensor and then returned ENOMEM,
  where (a)'s page faults, allowed to compact, got all 256 MiB.
* (c) one arena per model (every weight a view of one big tensor): fewest mappings, but tensors sharing a storage
  break the drop-in contracts (safetensors refuses shared storages, `save_pretrained` deduplicates them,
  `torch.save` writes a view's whole storage), so a saved model would change.

Storages under one huge page cannot fill a 2 MiB page of their own, yet a decoded token streams them from memory as
it does the large ones (an int4 layer's output and down projections, 1-1.75 MiB at the 530M shape, and every
product's scales), and on 4 KiB pages they read 6-11 % slower (docs/cpu_kernels.md, round 19b). Those of at least
`MIN_BYTES` are copied side by side into shared chunks (`CHUNK_BYTES`, 2 MiB-aligned, asked for huge pages): each
is still a storage of its own with exactly its bytes (so the saved files and the drop-in contracts above hold), a
64-byte-aligned piece of a chunk that stays mapped while any piece of it is alive. A chunk is never reused piece by
piece: a replaced small weight's bytes stay mapped until its chunk's other pieces go. Storages under `MIN_BYTES`
stay where they are (norm weights, biases: a few KiB each).

Where it cannot work (not Linux, transparent huge pages `never`, `madvise` refused, `LINATTN_HUGEPAGES=0`) it does
nothing and says why in its `PlacementReport` - never an error. A storage that something outside the module also
holds (a view kept elsewhere) stays: re-pointing only the module's tensors would turn an alias into a copy.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch

#: the huge page size the mappings are aligned to (x86-64 and arm64 with 4 KiB base pages)
HUGE = 2 << 20
_PAGE = mmap.PAGESIZE
#: storages below this stay where they are (`place_module`, `place_copy`); those from it up to one huge page share
#: chunks; `empty`'s buffers (fresh every token) below one huge page are torch's
MIN_BYTES = 64 << 10
#: the size of a shared chunk (a storage under one huge page is a piece of one; the last few pieces' worth of a chunk
#: may stay unused, under 2 MiB of it)
CHUNK_BYTES = 8 * HUGE
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"
_OFF = ("0", "false", "off", "no")

#: address -> weak reference to the live mapping object that starts there (a storage placed by us)
_MAPPINGS: Dict[int, "weakref.ref"] = {}
_LOCK = threading.Lock()
_LIBC = None
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


@dataclass
class PlacementReport:
    """What a placement did: `placed_bytes` moved onto huge-page mappings by this call (`placed` storages),
    `already_bytes` found there from an earlier call, `skipped` bytes left in place by reason, `reason` why
    nothing was placed (None: placement ran), `ranges` the (address, bytes) of the module's storages on our
    mappings; `huge_bytes()` asks the kernel how many of their bytes are on 2 MiB pages now."""

    placed_bytes: int = 0
    placed: int = 0
    already_bytes: int = 0
    skipped: Dict[str, int] = field(default_factory=dict)
    reason: Optional[str] = None
    ranges: List[Tuple[int, int]] = field(default_factory=list, repr=False)

    def skip(self, why: str, nbytes: int) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + nbytes

    def huge_bytes(self) -> Optional[int]:
        """/proc/self/smaps' AnonHugePages of the mappings holding `ranges` (None where unreadable)."""
        return huge_bytes(self.ranges)

    def huge_capacity(self) -> int:
        """The bytes of `ranges` that whole 2 MiB pages can cover (a storage of its own mapping: its tail past its
        last 2 MiB boundary sits on 4 KiB pages, however free memory is; a piece of a chunk: all of it): what
        `huge_bytes()` reaches when the kernel grants all."""
        return sum(n if n < HUGE else max(0, ((a + n) // HUGE - -(-a // HUGE)) * HUGE) for a, n in self.ranges)


def switched_on() -> bool:
    """False when `LINATTN_HUGEPAGES` is 0 / false / off / no (read at every call)."""
    return os.environ.get("LINATTN_HUGEPAGES", "").strip().lower() not in _OFF


def _libc():
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _LIBC = lib
    return _LIBC


_THP_MODE_TEXT: Dict[str, Optional[str]] = {}


def _thp_mode_text(path: str) -> Optional[str]:
    """The THP mode file's text (None: unreadable), read once per path: `empty` asks on every decoded token."""
    if path not in _THP_MODE_TEXT:
        try:
            with open(path) as f:
                _THP_MODE_TEXT[path] = f.read()
        except OSError:
            _THP_MODE_TEXT[path] = None
    return _THP_MODE_TEXT[path]


def unavailable() -> Optional[str]:
    """Why huge-page mappings cannot be made here (None: they can)."""
    if not switched_on():
        return "LINATTN_HUGEPAGES=0"
    if not sys.platform.startswith("linux"):
        return f"not Linux ({sys.platform})"
    mode = _thp_mode_text(_THP_MODE)
    if mode is None:
        return f"no transparent huge pages ({_THP_MODE} unreadable)"
    if "[never]" in mode:
        return "transparent huge pages are 'never'"
    return None


#: mappings whose storage was freed, kept for reuse by length (a decode step's fresh state buffer every token
#: would otherwise fault its huge pages in again: ~6 ms per 2 MiB page on the project's VM), up to POOL_BYTES
POOL_BYTES = 64 << 20
_POOL: Dict[int, List[int]] = {}
_pooled = 0


def _release(addr: int, length: int) -> None:
    global _pooled
    with _LOCK:
        if _pooled + length <= POOL_BYTES:
            _POOL.setdefault(length, []).append(addr)
            _pooled += length
            return
    _LIBC.munmap(addr, length)


def _pooled_mapping(length: int) -> Optional[int]:
    global _pooled
    with _LOCK:
        got = _POOL.get(length)
        if not got:
            return None
        _pooled -= length
        return got.pop()


def _mapping(nbytes: int):
    """A writable buffer object of exactly nbytes on a fresh anonymous mapping at a 2 MiB-aligned address that asked
    for huge pages (a pooled one of the same length when there is one); released when the object is freed. Raises
    OSError when mmap or madvise refuses."""
    length = -(-nbytes // _PAGE) * _PAGE
    start = _pooled_mapping(length)
    if start is None:
        start = _new_mapping(length)
    return _wrap(start, length, nbytes)


def _new_mapping(length: int) -> int:
    """The start of a fresh anonymous mapping of length bytes (a multiple of the page) at a 2 MiB-aligned address,
    asked for huge pages before its first touch. Raises OSError when mmap or madvise refuses."""
    lib = _libc()
    got = lib.mmap(None, length + HUGE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   -1, 0)
    if got is None or got == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap refused")
    start = -(-got // HUGE) * HUGE
    if start > got:   # (trimmed: no huge page may cover bytes beyond the storage)
        lib.munmap(got, start - got)
    tail = got + length + HUGE - (start + length)
    if tail:
        lib.munmap(start + length, tail)
    if lib.madvise(start, length, _MADV_HUGEPAGE) != 0:
        err = ctypes.get_errno()
        lib.munmap(start, length)
        raise OSError(err, "madvise(MADV_HUGEPAGE) refused")
    return start


def _wrap(start: int, length: int, nbytes: int):
    buf = (ctypes.c_char * nbytes).from_address(start)
    weakref.finalize(buf, _release, start, length).atexit = False   # (as _Chunk's)
    with _LOCK:
        _MAPPINGS[start] = weakref.ref(buf)
    return buf


class _Chunk:
    """A shared mapping that storages under one huge page are carved from, in order (`_piece`); unmapped when the
    last piece and the allocator have let it go."""

    __slots__ = ("start", "length", "used", "__weakref__")

    def __init__(self, length: int):
        self.start, self.length, self.used = _new_mapping(length), length, 0
        # (not at exit: a storage still alive then may be read by another finalizer; the process's end unmaps it)
        weakref.finalize(self, _libc().munmap, self.start, length).atexit = False


_CHUNK: List[Optional[_Chunk]] = [None]   # the chunk pieces are carved from now


def _piece(nbytes: int):
    """A writable buffer object of exactly nbytes, a 64-byte-aligned piece of the current shared chunk (a new chunk
    when it is full); the buffer keeps its chunk mapped. Raises OSError when a new chunk's mmap or madvise refuses."""
    size = -(-nbytes // 64) * 64
    with _LOCK:
        chunk = _CHUNK[0]
        if chunk is None or chunk.used + size > chunk.length:
            chunk = _CHUNK[0] = _Chunk(max(CHUNK_BYTES, -(-size // HUGE) * HUGE))
        start = chunk.start + chunk.used
        chunk.used += size
    buf = (ctypes.c_char * nbytes).from_address(start)
    buf._linattn_chunk = chunk   # (the piece holds its chunk: no unmap under a live storage)
    with _LOCK:
        _MAPPINGS[start] = weakref.ref(buf)
    return buf


def _ours(addr: int) -> bool:
    """Whether a storage starting at addr is one of our live mappings."""
    ref = _MAPPINGS.get(addr)
    if ref is None:
        return False
    if ref() is None:
        with _LOCK:
            if _MAPPINGS.get(addr) is ref:
                del _MAPPINGS[addr]
        return False
    return True


def _storage_copy(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """A copy of storage's bytes on a fresh huge-page mapping (OSError where the kernel refuses)."""
    n = storage.nbytes()
    dst = torch.frombuffer(_mapping(n) if n >= HUGE else _piece(n), dtype=torch.uint8, count=n)
    dst.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
    return dst.untyped_storage()


def _placeable(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized
            and type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_inference())


def empty(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh uninitialised 1-d buffer of n elements, on a huge-page mapping when it is large enough and placement
    can run, else torch's."""
    nbytes = n * torch.empty(0, dtype=dtype).element_size()
    if nbytes < max(MIN_BYTES, HUGE) or unavailable() is not None:   # (never a piece: freed every token)
        return torch.empty(n, dtype=dtype)
    try:
        return torch.frombuffer(_mapping(nbytes), dtype=dtype, count=n)
    except OSError:
        return torch.empty(n, dtype=dtype)


def place_copy(t: torch.Tensor) -> torch.Tensor:
    """t's values on a huge-page mapping (a new tensor of the same shape, strides and dtype) when t is large enough
    and placement can run, else t itself. For tensors nobody else holds (copies a plan keeps)."""
    if (not _placeable(t) or t.requires_grad or t.untyped_storage().nbytes() < MIN_BYTES
            or _ours(t.untyped_storage().data_ptr()) or unavailable() is not None):
        return t
    try:
        storage = _storage_copy(t.untyped_storage())
    except OSError:
        return t
    return torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(), t.size(), t.stride())


def _module_tensors(module: torch.nn.Module) -> List[torch.Tensor]:
    seen, out = set(), []
    tensors = [p for _, p in module.named_parameters(remove_duplicate=False)]
    tensors += [b for _, b in module.named_buffers(remove_duplicate=False) if b is not None]
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def place_module(module: torch.nn.Module, min_bytes: Optional[int] = None) -> PlacementReport:
    """Moves module's parameters and buffers onto huge-page mappings, in place (module docstring); idempotent.

    Args:
        module: Any nn.Module; tensors off the CPU, sparse, quantized or subclassed ones are left alone.
        min_bytes: Storages smaller than this stay (default `MIN_BYTES`); those from it up to one huge page are
            pieces of shared chunks, larger ones get mappings of their own.

    Returns:
        A `PlacementReport` (also kept as `module._linattn_hugepages`). Never raises for a machine that cannot
        place: the report's `reason` says why nothing moved.
    """
    report = PlacementReport(reason=unavailable())
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    groups: Dict[Tuple[int, int], List[torch.Tensor]] = {}
    for t in _module_tensors(module):
        if not _placeable(t):
            report.skip("not a dense CPU tensor", t.numel() * t.element_size())
            continue
        s = t.untyped_storage()
        groups.setdefault((s.data_ptr(), s.nbytes()), []).append(t)
    s = None   # (a storage object counts as a holder in `_held_elsewhere`)
    for (addr, nbytes), ts in groups.items():
        if _ours(addr):
            report.already_bytes += nbytes
            report.ranges.append((addr, nbytes))
        elif report.reason is not None:
            report.skip(report.reason, nbytes)
        elif nbytes < min_bytes or nbytes == 0:
            report.skip("smaller than min_bytes", nbytes)
        elif _held_elsewhere(ts):
            report.skip("a view of it is held outside the module", nbytes)
        else:
            try:
                storage = _storage_copy(ts[0].untyped_storage())
            except OSError as e:
                report.skip(f"mapping refused: {e}", nbytes)
                continue
            with torch.no_grad():
                for t in ts:
                    t.set_(storage, t.storage_offset(), t.size(), t.stride())
            report.placed_bytes += nbytes
            report.placed += 1
            report.ranges.append((storage.data_ptr(), nbytes))
    try:
        object.__setattr__(module, "_linattn_hugepages", report)
    except AttributeError:
        pass
    return report


def _held_elsewhere(ts: List[torch.Tensor]) -> bool:
    """Whether a tensor outside ts shares their storage (torch's count of the storage's holders: ts' tensors and
    the storage object asked here; a view's base, which autograd keeps, is such a tensor). Unknown (no such count
    in this torch): assumed not."""
    if any(t._base is not None for t in ts):
        return True
    if _storage_use_count is None:
        return False
    return _storage_use_count(ts[0].untyped_storage()._cdata) > len(ts) + 1


def huge_bytes(ranges: Iterable[Tuple[int, int]]) -> Optional[int]:
    """The AnonHugePages bytes of the mappings (/proc/self/smaps) that hold any of the (address, bytes) ranges, each
    mapping counted once; None where smaps cannot be read. (Adjacent mappings that asked for huge pages may be
    one kernel mapping: the count is then that mapping's.)"""
    ranges = sorted(ranges)
    if not ranges:
        return 0
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return None
    total, hit = 0, False
    for line in text.splitlines():
        head = line.split(None, 1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, _, hi = head.partition("-")
            try:
                a, b = int(lo, 16), int(hi, 16)
            except ValueError:
                continue
            hit = any(r < b and r + n > a for r, n in ranges)
        elif hit and head == "AnonHugePages:":
            total += int(line.split()[1]) << 10
    return total


def tensor_huge_bytes(tensors: Iterable[torch.Tensor]) -> Optional[int]:
    """`huge_bytes` of the storages of tensors."""
    return huge_bytes({(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in tensors})


__all__ = ["CHUNK_BYTES", "HUGE", "MIN_BYTES", "PlacementReport", "empty", "huge_bytes", "place_copy", "place_module",
           "switched_on", "tensor_huge_bytes", "unavailable"]
