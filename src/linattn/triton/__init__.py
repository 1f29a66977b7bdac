"""Triton kernels for the chunkwise (training) and fused-recurrent (decoding) forms.

Importing this package does NOT import triton: `linattn` must install and work without it. The
kernel modules (`linattn.triton.linear`, `linattn.triton.delta`) import triton when they are
imported themselves, which the dispatch (`linattn.ops.backend`) only does once it has picked the
Triton backend.

The modules here import nothing from `linattn.ops`: their entry points take prepared tensors
(features or raw q/k for the fused maps, log-gates, states, sequence boundaries), and the operators
in ops/ validate and prepare a call once, for both backends, before handing it over
(`linattn.ops.backend`):

    linattn.triton.linear.chunk_linear_attention      linear_attention(mode="chunk", causal=True)
    linattn.triton.linear.fused_recurrent_linear_attention   ... mode="recurrent" (forward only)
    linattn.triton.delta.chunk_delta_rule               the delta family, mode="chunk"
    linattn.triton.delta.fused_recurrent_delta_rule     ... mode="recurrent" (forward only)
    linattn.triton.common                               what both share (tiles, chunk index, _fwd_o, _bwd_dv)

On a machine without a GPU the kernels run under Triton's interpreter on CPU tensors when the
environment variable TRITON_INTERPRET=1 is set *before* triton is first imported (slow: tests only).
"""
from __future__ import annotations

import importlib.util
import os

__all__ = ["available", "interpret_mode", "triton_chunk_size", "TRITON_CHUNK_SIZES"]

TRITON_CHUNK_SIZES = (16, 32, 64)

_AVAILABLE = None


def available() -> bool:
    """True when triton can be imported (checked once, lazily; nothing is imported before the call)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        if importlib.util.find_spec("triton") is None:
            _AVAILABLE = False
        else:
            try:
                import triton  # noqa: F401
                import triton.language  # noqa: F401
                _AVAILABLE = True
            except Exception:  # a broken install counts as absent
                _AVAILABLE = False
    return _AVAILABLE


def interpret_mode() -> bool:
    """True when Triton's CPU interpreter is requested (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def triton_chunk_size(chunk_size: int) -> int:
    """The kernels' token tile BT: the requested chunk size when it is 16, 32 or 64, else 64.
    The result does not depend on it (the chunk form is exact for every chunk size)."""
    return chunk_size if chunk_size in TRITON_CHUNK_SIZES else 64
