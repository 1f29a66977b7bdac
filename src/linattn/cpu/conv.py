"""The layers' short causal depthwise convolution (ShortConv, T > 1 on the CPU) on a compiled kernel
(`csrc/conv.c`): forward with the SiLU fused in one pass, backward (dx, dw, dbias) in one.

`short_conv(xp, w, bias, silu)`: xp `[B, T + K - 1, D]` (the look-back, then x), w `[K, D]`, bias `[D]` or None ->
`[B, T, D]`, differentiable (an autograd Function). `short_conv_sep(x, past, w, bias, silu)`: the same with x and
its look-back `[B, K - 1, D]` (or None) apart, what the layer calls (no padded copy; the backward recomputes the
pre-activation instead of the forward storing it). The PyTorch form (`layers/common.py: ShortConv._taps`) stays
the fallback and the reference (tests/layers/test_short_conv_taps.py). Eager only: under torch.compile tracing
`available()` is False and the layer uses the PyTorch form. Nothing here imports linattn.ops.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import bindings, ptr, threads
from .build import enabled

__all__ = ["available", "short_conv", "short_conv_sep"]

_SFX = {torch.float32: "f32", torch.float64: "f64"}


def available(dtype: torch.dtype = torch.float32) -> bool:
    """True for float32 / float64 when the kernels are switched on and conv.c builds (compiled once), eagerly."""
    if dtype not in _SFX or torch.compiler.is_compiling() or not enabled():
        return False
    return bindings.bind("conv") is not None


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, xp, w, bias, silu):
        B, TP, D = xp.shape
        K = w.shape[0]
        T = TP - K + 1
        y = torch.empty(B, T, D, dtype=xp.dtype)
        pre = torch.empty_like(y) if silu else None
        bindings.require("conv")(
            "linattn_conv_fwd", xp.dtype, B, T, D, K, ptr(xp), ptr(w), ptr(bias), int(bool(silu)), ptr(y), ptr(pre),
            threads())
        ctx.save_for_backward(xp, w, pre)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, gy):
        xp, w, pre = ctx.saved_tensors
        B, TP, D = xp.shape
        K = w.shape[0]
        gy = gy.contiguous()
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dxp = torch.empty_like(xp) if need_x else None
        dw = torch.empty_like(w) if need_w else None
        db = torch.empty(D, dtype=xp.dtype) if (need_b and ctx.has_bias) else None
        bindings.require("conv")(
            "linattn_conv_bwd", xp.dtype, B, TP - K + 1, D, K, ptr(xp), ptr(w), ptr(pre), ptr(gy), ptr(dxp), ptr(dw),
            ptr(db), threads())
        return dxp, dw, db, None


def short_conv(xp: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], silu: bool) -> torch.Tensor:
    """act(bias + sum_j w[j] * xp[:, j:j + T]) for xp `[B, T + K - 1, D]`, w `[K, D]` (module docstring)."""
    xp, w = xp.contiguous(), w.contiguous()
    bias = bias.contiguous() if bias is not None else None
    return _ShortConv.apply(xp, w, bias, silu)


class _ShortConvSep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, past, w, bias, silu):
        B, T, D = x.shape
        K = w.shape[0]
        y = torch.empty(B, T, D, dtype=x.dtype)
        # no pre-activation kept: the backward recomputes it from the rows it reads anyway
        bindings.require("conv")(
            "linattn_conv_fwd_sep", x.dtype, B, T, D, K, ptr(x), ptr(past), ptr(w), ptr(bias), int(bool(silu)), ptr(y),
            None, threads())
        ctx.save_for_backward(x, past, w, bias)
        ctx.silu = bool(silu)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, past, w, bias = ctx.saved_tensors
        B, T, D = x.shape
        K = w.shape[0]
        gy = gy.contiguous()
        need_x, need_p, need_w, need_b = ctx.needs_input_grad[:4]
        dx = torch.empty_like(x) if need_x else None
        dpast = torch.empty_like(past) if (need_p and past is not None) else None
        dw = torch.empty_like(w) if need_w else None
        db = torch.empty(D, dtype=x.dtype) if (need_b and bias is not None) else None
        bindings.require("conv")(
            "linattn_conv_bwd_sep", x.dtype, B, T, D, K, ptr(x), ptr(past), ptr(w), ptr(bias), int(ctx.silu), ptr(gy),
            ptr(dx), ptr(dpast), ptr(dw), ptr(db), threads())
        return dx, dpast, dw, db, None


def short_conv_sep(x: torch.Tensor, past: Optional[torch.Tensor], w: torch.Tensor, bias: Optional[torch.Tensor],
                   silu: bool) -> torch.Tensor:
    """`short_conv` with x `[B, T, D]` and its look-back past `[B, K - 1, D]` (None: zeros) apart: the same values,
    without the padded copy of x (forward) and the slice of its gradient (backward)."""
    x, w = x.contiguous(), w.contiguous()
    past = past.contiguous() if past is not None else None
    bias = bias.contiguous() if bias is not None else None
    return _ShortConvSep.apply(x, past, w, bias, silu)
