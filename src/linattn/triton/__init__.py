"""Triton kernels for the chunkwise (training) and fused-recurrent (decoding) forms.

Importing this package does NOT import triton: `linattn` must install and work without it. The
kernel modules (`linattn.triton.linear`, `linattn.triton.delta`) import triton when they are
imported themselves, which the dispatch (`linattn.ops.backend`) only does once it has picked the
Triton backend.

Entry points (same semantics as the PyTorch operators, see docs/triton.md):

    linattn.triton.linear.chunk_linear_attention      linear_attention(mode="chunk", causal=True)
    linattn.triton.linear.fused_recurrent_linear_attention   ... mode="recurrent" (forward only)
    linattn.triton.delta.chunk_delta_rule               delta_rule(mode="chunk")
    linattn.triton.delta.fused_recurrent_delta_rule     delta_rule(mode="recurrent") (forward only)

On a machine without a GPU the kernels run under Triton's interpreter on CPU tensors when the
environment variable TRITON_INTERPRET=1 is set *before* triton is first imported (slow: tests only).
"""
from __future__ import annotations

import importlib.util
import os

__all__ = ["available", "interpret_mode"]

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
