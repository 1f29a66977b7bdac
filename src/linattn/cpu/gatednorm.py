"""The layers' output norm with its gate on a compiled kernel (`csrc/gatednorm.c`): RMSNorm(x) * w * silu(gate),
GatedRMSNorm's default form (`layers/common.py`), forward and backward in one pass each.

`gated_rms_norm(norm, x, gate)`: the compiled form when it covers the call (a plain GatedRMSNorm, CPU float32 /
float64 tensors, eager, the kernels switched on), else `norm(x, gate)`, the PyTorch form, which stays the
fallback and the reference (tests/cpu/test_gatednorm.py). Eager only: under torch.compile tracing the PyTorch
form runs. Nothing here imports linattn.ops or linattn.layers (the norm is read by its attributes).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import bindings, ptr, threads
from .build import enabled

__all__ = ["available", "covers", "gated_rms_norm"]

_SFX = {torch.float32: "f32", torch.float64: "f64"}


def available(dtype: torch.dtype = torch.float32) -> bool:
    """True for float32 / float64 when the kernels are switched on and gatednorm.c builds (compiled once), eagerly."""
    if dtype not in _SFX or torch.compiler.is_compiling() or not enabled():
        return False
    return bindings.bind("gatednorm") is not None


class _GatedRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, w, eps):
        D = x.shape[-1]
        R = x.numel() // D
        y = torch.empty_like(x)
        rstd = x.new_empty(x.shape[:-1])
        bindings.require("gatednorm")("linattn_gnorm_fwd", x.dtype, R, D, ptr(x), ptr(gate), ptr(w), eps, ptr(y),
                                      ptr(rstd), threads())
        ctx.save_for_backward(x, gate, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, gate, w, rstd = ctx.saved_tensors
        D = x.shape[-1]
        R = x.numel() // D
        dy = dy.contiguous()
        dx = torch.empty_like(x)
        dgate = torch.empty_like(gate) if gate is not None else None
        dw = torch.empty_like(w) if (w is not None and ctx.needs_input_grad[2]) else None
        bindings.require("gatednorm")("linattn_gnorm_bwd", x.dtype, R, D, ptr(x), ptr(gate), ptr(w), ptr(rstd), ptr(dy),
                                      ptr(dx), ptr(dgate), ptr(dw), threads())
        return dx, dgate, dw, None


def covers(norm, x: torch.Tensor, gate: Optional[torch.Tensor]) -> bool:
    """Whether the compiled kernel computes `norm(x, gate)` (module docstring)."""
    w = norm.weight
    return (getattr(norm, "plain", False) and x.device.type == "cpu" and x.dim() >= 1 and x.shape[-1] == norm.dim
            and x.numel() > 0 and (gate is None or (gate.dtype == x.dtype and gate.shape == x.shape))
            and (w is None or w.device.type == "cpu") and available(x.dtype))


def gated_rms_norm(norm, x: torch.Tensor, gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`norm(x, gate)` for a GatedRMSNorm `norm` (x, gate `[..., dim]`): on the compiled kernel when it covers the
    call (module docstring), the same values to rounding; otherwise the PyTorch form."""
    if not covers(norm, x, gate):
        return norm(x, gate)
    w = norm.weight
    w = w.to(x.dtype).contiguous() if w is not None else None
    return _GatedRMSNorm.apply(x.contiguous(), gate.contiguous() if gate is not None else None, w, float(norm.eps))
