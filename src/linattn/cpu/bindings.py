"""The compiled libraries, bound from their tables (`abi.LIBRARIES`): one loading path for every kernel module.

`bind(name)` loads `csrc/<name>.c` (`build.load_library`: built on first use, cached, checked against the table:
symbols, ABI version, plan struct sizes) and sets the argument and return types of every function the table lists,
once per loaded library; None when the kernels are switched off or cannot be built. `require(name)` is the same
but raises a `LinattnError` instead of returning None.

A `Bound` library is called with the function's name without its dtype suffix and the dtype of its data:

    lib = bindings.require("delta")
    lib("linattn_delta_fwd", q.dtype, ctypes.byref(plan), ptr(q), ...)

which picks `_f32` / `_f64`, calls it and turns a nonzero return code into the exception the table gives
(`MemoryError` for the scratch allocations). `lib.function(name, dtype)` gives the raw ctypes function, for a
caller that checks the code itself.

`kernel_time()` measures how much of a stretch of code runs inside the compiled functions called this way (the rest of
a public call is Python and torch operators): `linattn bench threads` reports both parts.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ..errors import LinattnError
from .abi import LIBRARIES, OUT_OF_MEMORY, Fn
from .build import load_library

__all__ = ["Bound", "bind", "require", "suffix", "kernel_time"]

_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_BOUND: Dict[int, "Bound"] = {}
_LOCK = threading.Lock()
_CLOCK = threading.local()  # .spent: the list kernel_time() adds to in this Python thread (absent: not measuring)


@contextlib.contextmanager
def kernel_time() -> Iterator[List[float]]:
    """Inside the block, the seconds spent in calls through a `Bound` library from this Python thread add up in the
    one-element list it yields (nested blocks: the innermost one counts)."""
    outer = getattr(_CLOCK, "spent", None)
    _CLOCK.spent = spent = [0.0]
    try:
        yield spent
    finally:
        _CLOCK.spent = outer


def suffix(dtype: torch.dtype) -> str:
    """`f32` / `f64`: the variant of a typed function that computes in dtype."""
    try:
        return _SUFFIX[dtype]
    except KeyError:
        raise TypeError(f"internal: the compiled kernels take float32 or float64 data, got {dtype}") from None


class Bound:
    """A loaded library with the argument types of its table set (see the module docstring)."""

    def __init__(self, name: str, lib: ctypes.CDLL):
        self.name, self.lib = name, lib
        self._fns: Dict[Tuple[str, Optional[str]], Tuple[object, Fn]] = {}
        for spec in LIBRARIES[name].functions:
            for sfx in (("f32", "f64") if spec.typed else (None,)):
                f = getattr(lib, f"{spec.name}_{sfx}" if sfx else spec.name)
                f.argtypes, f.restype = list(spec.args), spec.restype
                self._fns[(spec.name, sfx)] = (f, spec)

    def function(self, name: str, dtype: Optional[torch.dtype] = None):
        """The ctypes function `name` (its variant for dtype when it has float and double ones)."""
        return self._fns[(name, suffix(dtype) if dtype is not None else None)][0]

    def __call__(self, name: str, dtype: Optional[torch.dtype], *args):
        """Call `name` (dtype's variant) with args; a nonzero status code raises (MemoryError when the kernel
        could not allocate, else RuntimeError)."""
        f, spec = self._fns[(name, suffix(dtype) if dtype is not None else None)]
        spent = getattr(_CLOCK, "spent", None)
        if spent is None:
            rc = f(*args)
        else:
            t0 = time.perf_counter()
            rc = f(*args)
            spent[0] += time.perf_counter() - t0
        if spec.status and rc != 0:
            why = (spec.errors or {}).get(rc, OUT_OF_MEMORY if spec.errors is None else f"returned {rc}")
            what = f"linattn: the compiled kernel {name} ({self.name}) {why}"
            raise MemoryError(what) if why == OUT_OF_MEMORY else RuntimeError(what)
        return rc


def bind(name: str) -> Optional[Bound]:
    """The library `name` bound from its table, or None when the kernels are off or it cannot be built."""
    lib = load_library(name)
    if lib is None:
        return None
    with _LOCK:
        bound = _BOUND.get(id(lib))
        if bound is None or bound.lib is not lib:
            bound = _BOUND[id(lib)] = Bound(name, lib)
        return bound


def require(name: str) -> Bound:
    """`bind(name)`, raising a LinattnError when the library is not available."""
    bound = bind(name)
    if bound is None:
        raise LinattnError(f"the compiled CPU kernel '{name}' is not available (LINATTN_CPU_KERNELS=0 or no C "
                           "compiler); use backend='torch'")
    return bound
