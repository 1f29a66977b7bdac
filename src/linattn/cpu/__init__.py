"""Compiled CPU kernels (optional): portable C11 + OpenMP, built on first use, called through ctypes.

The PyTorch forms in `linattn/ops/` stay the reference and the fallback. Importing this package compiles
nothing and imports nothing heavy: `build.load_library(name)` compiles `csrc/<name>.c` with the system C
compiler the first time a kernel is needed and caches the library per machine (see `build.py`).
`LINATTN_CPU_KERNELS=0` switches the kernels off; without a compiler they are off with one notice.

Like `linattn.triton`, the modules here never import `linattn.ops`: their entry points take prepared,
contiguous tensors ([TT, H, D] rows with the sequence boundaries), and `ops/backend.py` lays a prepared
call out for them. The kernels are registered as custom ops (`torch.library.custom_op("linattn::...")`,
with fake and autograd registrations) so that autograd and torch.compile see them as single ops.

Every library's interface (functions, argument types, return codes, ABI version, plan structs) is declared once
in `abi.py`; `bindings.py` loads a library and binds it from that table (`bindings.require(name)`), and `build.py`
checks a loaded library against it. Helpers shared by the kernel modules: `ptr` (the address of a contiguous
tensor for ctypes), `threads` (torch's intra-op thread count, passed to every kernel: a kernel's `num_threads(n)`
follows `torch.set_num_threads`), `torch_on_one_thread` (the small torch operators around a kernel on one thread,
the kernel on the caller's count), `available(name)`.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import LinattnError
from .build import enabled, load_library

__all__ = ["available", "enabled", "load_library", "ptr", "threads", "checkpoint_offsets", "torch_on_one_thread",
           "KERNEL_DTYPES", "MAX_CHUNK"]

KERNEL_DTYPES = (torch.float32, torch.float64)  # the kernels compute in these; other dtypes are cast or fall back
MAX_CHUNK = 512  # the chunk kernels keep a few C x C blocks per thread


def available(name: str = "probe") -> bool:
    """True when the kernels are switched on and `csrc/<name>.c` builds (compiles it on the first call)."""
    return enabled() and load_library(name) is not None


def ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    """The data address of a contiguous CPU tensor (None -> NULL)."""
    if t is None:
        return None
    if not t.is_contiguous() or t.device.type != "cpu":
        raise LinattnError(f"the compiled CPU kernels take contiguous CPU tensors, got one of shape {tuple(t.shape)} "
                           f"on {t.device} (contiguous: {t.is_contiguous()})")
    return t.data_ptr()


def checkpoint_offsets(starts: Sequence[int], every: int) -> Tuple[List[int], int]:
    """For a scan that keeps a state every `every` tokens of each sequence (cu_seqlens `starts`) for its backward:
    each sequence's first checkpoint index and the total, ceil(length / every) per sequence."""
    offs, n = [], 0
    for lo, hi in zip(starts[:-1], starts[1:]):
        offs.append(n)
        n += -(-(hi - lo) // every)
    return offs, n


def threads(work: Optional[float] = None, grain: float = 1.0) -> int:
    """torch's intra-op thread count, or fewer for a small call: at most one thread per `grain` of `work` (a kernel's
    own cost measure; a grain is about a millisecond of one thread's work). Forking threads for less than that costs
    more than it saves, and on a busy machine a thread that the system deschedules holds the whole call back."""
    n = max(1, getattr(_SCOPE, "threads", 0) or torch.get_num_threads())
    return n if work is None else max(1, min(n, int(work // grain)))


_SCOPE = threading.local()  # per Python thread: the count torch_on_one_thread keeps for the kernels


@contextlib.contextmanager
def torch_on_one_thread() -> Iterator[None]:
    """Inside the block torch's operators run on one thread, and `threads()` still gives the kernels torch's count
    from before it. The operators around a kernel call (checks, gates, casts, layouts: a few passes over [B, T, H]
    or [B, T, H, D]) are short, and each parallel one ends at a barrier: on a machine where another process holds
    a core, the thread the system deschedules holds every such operator back by up to a time slice (measured on a
    loaded 2-core machine: 15-30 ms each for 64k elements at 2 threads, where one thread takes 0.1 ms), while the
    kernels themselves share their work dynamically (chains.h). Nested blocks keep the outer count; under
    torch.compile (which traces the operators, not this state) and at one thread it does nothing. torch's count is
    one per process: another Python thread running torch meanwhile runs on one thread too, and a count that it sets
    meanwhile is kept."""
    if torch.compiler.is_compiling() or getattr(_SCOPE, "threads", 0) or torch.get_num_threads() <= 1:
        yield
        return
    n = torch.get_num_threads()
    _SCOPE.threads = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _SCOPE.threads = 0
        if torch.get_num_threads() == 1:
            torch.set_num_threads(n)


c_ptr = ctypes.c_void_p
c_i64 = ctypes.c_int64
c_int = ctypes.c_int
c_double = ctypes.c_double
