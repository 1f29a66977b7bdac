"""Backend dispatch: `backend="auto" | "torch" | "triton"` on the operators.

* "torch"  - the PyTorch forms (always available; the reference and the fallback).
* "triton" - the Triton kernels (linattn/triton): chunk mode (forward + backward) and recurrent
             mode (forward only, for decoding). CUDA tensors, or CPU tensors under Triton's
             interpreter (TRITON_INTERPRET=1 set before triton is imported: how CI tests them).
             A configuration the kernels do not cover falls back to PyTorch with a warning
             (once per reason): see `linear_attention_unsupported` / `delta_rule_unsupported`.
* "auto"   - "triton" for CUDA tensors when triton is importable and the configuration is
             covered, "torch" otherwise (silently).

Nothing here imports triton unless the Triton backend is actually considered (CUDA tensors with
"auto", or "triton" requested): `import linattn` never imports it.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch

from ..triton import available, interpret_mode

BACKENDS = ("auto", "torch", "triton")
_WARNED = set()


def _all_cuda(*tensors) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors)


def _needs_grad(tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def select_backend(backend: str, *tensors, unsupported: Optional[str] = None) -> str:
    """Resolve `backend` for a call on `tensors` (None entries and non-tensors are ignored).

    `unsupported` is None when the Triton kernels cover the call, else the reason they do not.
    Returns "torch" or "triton". Raises ValueError for an unknown backend name, ImportError when
    "triton" is requested without triton, and RuntimeError when it is requested for CPU tensors
    without TRITON_INTERPRET=1.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    ts = [t for t in tensors if isinstance(t, torch.Tensor)]
    on_cuda = bool(ts) and all(t.is_cuda for t in ts)
    if backend == "auto":
        if not on_cuda or unsupported is not None or not available():
            return "torch"
        return "triton"
    if not available():
        raise ImportError("backend='triton' needs the triton package: pip install 'linattn[triton]' "
                          "(or use backend='auto' / 'torch')")
    if not on_cuda and not interpret_mode():
        raise RuntimeError("backend='triton' runs on CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
                           "before triton is imported (Triton's interpreter: slow, for tests) or use backend='torch'")
    if unsupported is not None:
        if unsupported not in _WARNED:
            _WARNED.add(unsupported)
            warnings.warn(f"backend='triton': {unsupported}; falling back to the PyTorch implementation",
                          stacklevel=3)
        return "torch"
    return "triton"


def _dtype_reason(q) -> Optional[str]:
    if isinstance(q, torch.Tensor) and q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"the kernels take fp16 / bf16 / fp32 inputs, not {q.dtype}"
    return None


def linear_attention_unsupported(q, *, feature_map="elu+1", causal=True, mode="chunk", g=None,
                                 grad_tensors=()) -> Optional[str]:
    """Why the Triton kernels do not cover a `linear_attention` call (None when they do).

    Covered: causal chunk mode (forward and backward) and causal recurrent mode (forward only),
    linear-space feature maps (identity, elu+1 and relu fused; the others applied by PyTorch first),
    no gate, a constant gamma or a scalar gate g [B, T, H]. Not covered: log-space maps
    (hadamard_exp, favor+), diagonal gates g [B, T, H, K], causal=False, mode="parallel", fp64,
    and gradients through the recurrent form. `mode` values the operator rejects are reported as
    unsupported too, so the operator's own check raises its error.
    """
    reason = _dtype_reason(q)
    if reason:
        return reason
    if mode not in ("chunk", "recurrent"):
        return f"mode={mode!r} has no Triton kernel (chunk and recurrent do)"
    if not causal:
        return "causal=False has no Triton kernel"
    log_space = (feature_map in ("hadamard_exp", "favor+") if isinstance(feature_map, str)
                 else bool(getattr(feature_map, "log_space", False)))
    if log_space:
        return "log-space feature maps (hadamard_exp, favor+) have no Triton kernel"
    if isinstance(g, torch.Tensor) and g.dim() == 4:
        return "diagonal gates g [B, T, H, K] (GLA) have no Triton kernel"
    if mode == "recurrent" and _needs_grad(grad_tensors):
        return "the fused recurrent kernel is forward-only (decoding) and an input requires grad"
    return None


def delta_rule_unsupported(q, *, mode="chunk", grad_tensors=()) -> Optional[str]:
    """Why the Triton kernels do not cover a `delta_rule` call (None when they do).

    Covered: chunk mode (forward and backward; DeltaNet, Gated DeltaNet, EFLA, qk_l2norm) and
    recurrent mode (forward only), K <= 256. Not covered: mode="parallel", fp64, gradients through
    the recurrent form.
    """
    reason = _dtype_reason(q)
    if reason:
        return reason
    if mode not in ("chunk", "recurrent"):
        return f"mode={mode!r} has no Triton kernel (chunk and recurrent do)"
    if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[-1] > 256:
        return "the kernels keep a whole K in registers and support K <= 256"
    if mode == "recurrent" and _needs_grad(grad_tensors):
        return "the fused recurrent kernel is forward-only (decoding) and an input requires grad"
    return None


def linear_attention_backend(backend, q, k, v, *, feature_map="elu+1", causal=True, mode="chunk", gamma=None,
                             g=None, initial_state=None) -> str:
    """`select_backend` for `linear_attention` (one line in the operator)."""
    if backend == "torch" or (backend == "auto" and not _all_cuda(q, k, v)):
        return "torch"
    state = tuple(initial_state) if isinstance(initial_state, tuple) else ()
    grads = (q, k, v, g, gamma) + state
    why = linear_attention_unsupported(q, feature_map=feature_map, causal=causal, mode=mode, g=g,
                                       grad_tensors=[t for t in grads if isinstance(t, torch.Tensor)])
    return select_backend(backend, q, k, v, unsupported=why)


def delta_rule_backend(backend, q, k, v, beta, *, mode="chunk", g=None, initial_state=None) -> str:
    """`select_backend` for `delta_rule` (one line in the operator)."""
    if backend == "torch" or (backend == "auto" and not _all_cuda(q, k, v)):
        return "torch"
    grads = [t for t in (q, k, v, beta, g, initial_state) if isinstance(t, torch.Tensor)]
    why = delta_rule_unsupported(q, mode=mode, grad_tensors=grads)
    return select_backend(backend, q, k, v, unsupported=why)
