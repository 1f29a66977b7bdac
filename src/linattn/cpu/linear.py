"""Causal linear attention, chunk form, on the compiled CPU kernels (csrc/linear.c): forward and backward.

The kernels take prepared features (phi(scale q), psi(k), computed in PyTorch so that autograd differentiates
the map), values and an optional scalar log-gate per token and head, all as rows [TT, H, D] of packed
sequences (`starts`, N + 1 row offsets; a batch of B sequences of length T is starts = [0, T, 2T, ...]):

    num_i = phi_i . (S_0 + sum_{j<=i} decay_ij psi_j v_j^T),   den_i = phi_i . (z_0 + sum_{j<=i} decay_ij psi_j)

with decay_ij = exp(sum_{t=j+1..i} g_t). fp32 and fp64 (the same C code, compiled for both).

Two custom ops, so that autograd and torch.compile see single ops: `linattn::cpu_linear_chunk_fwd` ->
(num [TT, H, V] (or o = num / den' when eps >= 0, den' = den floored to |den| >= eps with its sign), den [TT, H]
(empty unless norm), final state [N, H, K, W], chunk-start states [NC, H, K, W], and flags [1] (int32: NUM_NONFINITE
when the kernel divided and num held inf / NaN or den' was NaN, OUT_NONFINITE when a value written to num (o) is
inf / NaN)) and `linattn::cpu_linear_chunk_bwd`, its registered
backward (it reuses the chunk-start states; after a division it also takes the division's backward, from o and
den, as `_FlooredDivide` in ops/linear.py does for finite num). W = V + 1 when norm (the normaliser's state z is
the last column), else V.

This module never imports linattn.ops; `ops/backend.py` lays a prepared call out for `chunk_linear_attention`.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..feature_codes import FMAP_IDENTITY, FUSED_MAPS
from . import bindings, ptr, threads, torch_on_one_thread
from .abi import LinearPlan

FMAPS = {None: FMAP_IDENTITY, **FUSED_MAPS}  # the maps applied inside the kernels (None: features given)
# the forward's flags (linear.c's LIN_*_NONFINITE): num held inf / NaN where it divided; the output held inf / NaN
NUM_NONFINITE, OUT_NONFINITE = 1, 2


# a thread per GRAIN of rows x heads x K x (C + W) (about a millisecond of one thread's forward)
GRAIN = float(1 << 24)


def _plan(starts: Tensor, rows: int, N: int, H: int, K: int, V: int, C: int, norm: bool, fmap: int, scale: float,
          eps: float) -> LinearPlan:
    nthreads = threads(float(rows) * H * K * (C + V + int(norm)), GRAIN)
    return LinearPlan(N, H, K, V, C, ptr(starts), int(norm), fmap, nthreads, 0, scale, eps)


def n_chunks(starts: List[int], C: int) -> int:
    return sum(-(-(b - a) // C) for a, b in zip(starts[:-1], starts[1:]))


def _opt(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.contiguous() if t is not None and t.numel() > 0 else None


def _forward(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], S0: Optional[Tensor], starts: List[int],
             chunk_size: int, norm: bool, fmap: int, scale: float,
             keep_states: bool, eps: float = -1.0) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The body of `linattn::cpu_linear_chunk_fwd` (`_fwd`), also called directly where nothing needs the op's
    dispatch (`_plain_eager`)."""
    TT, H, K = q.shape
    V = v.shape[-1]
    W = V + int(norm)
    N = len(starts) - 1
    q, k, v, g, S0 = q.contiguous(), k.contiguous(), v.contiguous(), _opt(g), _opt(S0)
    num = q.new_empty(TT, H, V)
    den = q.new_empty(TT, H) if norm else q.new_empty(0)
    S = q.new_empty(N, H, K, W)
    P = q.new_empty(n_chunks(starts, chunk_size), H, K, W) if keep_states else q.new_empty(0)
    bad = torch.zeros(1, dtype=torch.int32)
    st = torch.tensor(starts, dtype=torch.int64)
    plan = _plan(st, TT, N, H, K, V, chunk_size, norm, fmap, scale, eps)
    bindings.require("linear")("linattn_linear_fwd", q.dtype, ctypes.byref(plan), ptr(q), ptr(k), ptr(v), ptr(g),
                               ptr(S0), ptr(num), ptr(den) if norm else None, ptr(P) if keep_states else None, ptr(S),
                               ptr(bad))
    return num, den, S, P, bad


_fwd = torch.library.custom_op("linattn::cpu_linear_chunk_fwd", _forward, mutates_args=(), device_types="cpu")


def _plain_eager(*tensors: Optional[Tensor]) -> bool:
    """Whether a forward that keeps no autograd graph may call `_forward` without the custom op's dispatch (its
    schema checks, autograd wrapper and output alias checks cost ~0.2 ms per call after a call that streamed the
    inputs through the caches): every tensor a plain torch.Tensor (no fake tensor nor subclass), no dispatch or
    function mode, no functorch transform (vmap, grad), no forward-mode AD level, no profiler (whose trace names
    the op). Anything else takes the op, which is what the op's dispatch is for. The same body, the same bits."""
    try:
        if (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
                or torch._C._functorch.peek_interpreter_stack() is not None
                or torch.autograd.forward_ad._current_level >= 0 or torch.autograd._profiler_enabled()):
            return False
    except AttributeError:  # a torch without one of these: always the op
        return False
    return all(t is None or type(t) is Tensor for t in tensors)


@_fwd.register_fake
def _(q, k, v, g, S0, starts, chunk_size, norm, fmap, scale, keep_states, eps=-1.0):
    TT, H, K = q.shape
    V = v.shape[-1]
    W = V + int(norm)
    return (q.new_empty(TT, H, V), q.new_empty(TT, H) if norm else q.new_empty(0),
            q.new_empty(len(starts) - 1, H, K, W),
            q.new_empty(n_chunks(starts, chunk_size), H, K, W) if keep_states else q.new_empty(0),
            q.new_empty(1, dtype=torch.int32))


@torch.library.custom_op("linattn::cpu_linear_chunk_bwd", mutates_args=(), device_types="cpu")
def _bwd(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], P: Tensor, dnum: Optional[Tensor],
         dden: Optional[Tensor], dS: Optional[Tensor], starts: List[int], chunk_size: int,
         norm: bool, fmap: int, scale: float, o: Optional[Tensor] = None, den: Optional[Tensor] = None,
         eps: float = -1.0) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    TT, H, K = q.shape
    V = v.shape[-1]
    W = V + int(norm)
    N = len(starts) - 1
    if P.dim() != 4 and n_chunks(starts, chunk_size) > 0:   # kept states are [NC, H, K, W] (empty when H = 0)
        raise RuntimeError("linattn: the compiled linear-attention forward ran without keeping its chunk states "
                           "(no input required grad), so it has no backward")
    q, k, v, g, P = q.contiguous(), k.contiguous(), v.contiguous(), _opt(g), P.contiguous()
    dnum, dden, dS = _opt(dnum), _opt(dden) if norm else None, _opt(dS)
    divided = norm and eps >= 0 and o is not None and den is not None  # dnum is then the gradient of o = num / den'
    o, den = (o.contiguous(), den.contiguous()) if divided else (None, None)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dg = q.new_zeros(TT, H) if g is not None else q.new_empty(0)
    dS0 = q.new_empty(N, H, K, W)
    st = torch.tensor(starts, dtype=torch.int64)
    plan = _plan(st, TT, N, H, K, V, chunk_size, norm, fmap, scale, float(eps) if divided else -1.0)
    bindings.require("linear")("linattn_linear_bwd", q.dtype, ctypes.byref(plan), ptr(q), ptr(k), ptr(v), ptr(g),
                               ptr(P), ptr(dnum), ptr(dden), ptr(o), ptr(den), ptr(dS), ptr(dq), ptr(dk), ptr(dv),
                               ptr(dg) if g is not None else None, ptr(dS0))
    return dq, dk, dv, dg, dS0


@_bwd.register_fake
def _(q, k, v, g, P, dnum, dden, dS, starts, chunk_size, norm, fmap, scale, o=None, den=None, eps=-1.0):
    TT, H, K = q.shape
    V = v.shape[-1]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(TT, H) if g is not None else q.new_empty(0), q.new_empty(len(starts) - 1, H, K, V + int(norm)))


def _setup(ctx, inputs, output):
    q, k, v, g, S0, starts, chunk_size, norm, fmap, scale, keep_states = inputs[:11]
    eps = float(inputs[11]) if len(inputs) > 11 else -1.0
    ctx.divided = bool(norm) and eps >= 0  # output[0] is o = num / den': the kernel's backward divides too
    ctx.save_for_backward(q, k, v, g, output[3], *((output[0], output[1]) if ctx.divided else ()))
    ctx.args = (starts, chunk_size, norm, fmap, scale, S0 is not None, eps)
    ctx.set_materialize_grads(False)  # unused outputs (the chunk states, often the final state): None, not zeros


def _backward(ctx, dnum, dden, dS, dP, dbad):
    q, k, v, g, P, *o_den = ctx.saved_tensors
    starts, chunk_size, norm, fmap, scale, has_S0, eps = ctx.args
    o, den = o_den if ctx.divided else (None, None)
    with torch_on_one_thread():  # only the allocations around the kernel: cpu.torch_on_one_thread says why
        dq, dk, dv, dg, dS0 = _bwd(q, k, v, g, P, dnum, dden, dS, starts, chunk_size, norm, fmap, scale, o, den, eps)
    return (dq, dk, dv, (dg if g is not None else None), (dS0 if has_S0 else None), None, None, None, None, None, None,
            None)


_fwd.register_autograd(_backward, setup_context=_setup)


class OutputFinite:
    """The forward kernel's word that every value it wrote is finite, read only when asked (`bool(finite)`): where
    no check needs it (value checks off, as CUDA's default), a decoded token reads nothing on the host."""

    __slots__ = ("_flags",)

    def __init__(self, flags: Tensor):
        self._flags = flags

    def __bool__(self) -> bool:
        return not (int(self._flags) & OUT_NONFINITE)


def chunk_linear_attention(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], S0: Optional[Tensor], *,
                           starts: List[int], chunk_size: int, norm: bool, fmap: Optional[str] = None,
                           scale: float = 1.0, eps: Optional[float] = None
                           ) -> Tuple[Tensor, Optional[Tensor], Tensor, bool, Optional[bool]]:
    """q, k [TT, H, K] (features, or the inputs of `fmap`, one of FMAPS: phi(scale q), psi(k) are then computed in
    the kernels), v [TT, H, V], g [TT, H] log-gate or None, S0 [N, H, K, W] or None, all of one dtype (fp32 or fp64).
    -> (num [TT, H, V], den [TT, H] or None (norm=False), final state [N, H, K, W], divided, finite).

    eps (with norm): the kernel returns o = num / den' in place of num (den' = den floored to |den| >= eps, sign
    kept: the arithmetic of ops/linear.py's `finish`), saving passes over the output, and with autograd its
    backward kernel takes the division's backward (`_FlooredDivide`'s arithmetic). Not when num holds inf / NaN
    under autograd (the forward runs again undivided: `finish`'s autograd division keeps them from the other
    gradients) nor while torch.compile traces with autograd; `divided` says whether it did. finite: whether every
    value of the returned num (o when divided) is finite, as the forward kernel found while writing them (no
    extra pass; an `OutputFinite`, read when asked); None while torch.compile traces (the flag is unreadable there)."""
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, g, S0))
    # under autograd the division's backward runs in the backward kernel, for finite num (checked by the forward
    # kernel, which a trace cannot read: there the division stays in PyTorch)
    tracing = torch.compiler.is_compiling()
    divide = bool(norm) and eps is not None and not (keep and tracing)
    args = ([int(s) for s in starts], int(chunk_size), bool(norm), FMAPS[fmap], float(scale), keep)
    fwd = _forward if not keep and not tracing and _plain_eager(q, k, v, g, S0) else _fwd
    num, den, S, _, flags = fwd(q, k, v, g, S0, *args, float(eps) if divide else -1.0)  # chunk states kept
    if divide and keep and int(flags) & NUM_NONFINITE:  # autograd's division in `finish` keeps inf / NaN apart
        num, den, S, _, flags = _fwd(q, k, v, g, S0, *args, -1.0)
        divide = False
    finite = None if tracing else OutputFinite(flags)
    return num, (den if norm else None), S, divide, finite
