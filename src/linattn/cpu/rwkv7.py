"""RWKV-7's diagonal-plus-rank-one scan on compiled CPU kernels (`csrc/rwkv7.c`), as torch custom ops.

    S_t = Diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T,      o_t = scale S_t^T r_t

the state [K, V] per head (fla's layout, `ops/rwkv7.py`). Inputs flat over tokens: r, w, k, a, b [TT, H, K],
v [TT, H, V], with the sequence boundaries `starts` (B equal sequences, or cu_seqlens); states [N, H, K, V];
float32 or float64, one dtype. The kernel scans token by token with the state in cache; the forward keeps the
state every CHECKPOINT tokens when a gradient is needed, and the compiled backward recomputes each stretch from
its checkpoint and runs the reverse recurrence (memory: TT / CHECKPOINT states per head, no per-token ones).

Ops: `linattn::cpu_rwkv7_fwd` (registered with autograd) and `linattn::cpu_rwkv7_bwd`; `rwkv7_scan` is the entry
point. Nothing here imports linattn.ops.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from . import bindings, checkpoint_offsets, ptr, threads

__all__ = ["CHECKPOINT", "available", "rwkv7_scan"]

CHECKPOINT = 64  # tokens between the states the forward keeps for the backward


def available() -> bool:
    """True when the kernels are switched on and rwkv7.c builds (compiles it on the first call)."""
    return bindings.bind("rwkv7") is not None


def _forward(r, w, k, v, a, b, S0, starts, ck_off, n_ckpt, scale):
    TT, H, K = r.shape
    V, N = v.shape[-1], starts.numel() - 1
    o = r.new_empty(TT, H, V)
    S = r.new_empty(N, H, K, V)
    ckpt = r.new_empty(n_ckpt, H, K, V)
    dec = torch.exp(w)  # held here: the kernel reads it through a raw pointer
    bindings.require("rwkv7")("linattn_rwkv7_fwd", r.dtype, N, H, K, V, ptr(starts), ptr(r), ptr(dec),
          ptr(k), ptr(v), ptr(a), ptr(b), scale, ptr(S0), ptr(o), ptr(S), ptr(ckpt) if n_ckpt else None, ptr(ck_off),
          CHECKPOINT, threads())
    return o, S, ckpt


@torch.library.custom_op("linattn::cpu_rwkv7_fwd", mutates_args=(), device_types="cpu")
def rwkv7_fwd(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              S0: Optional[torch.Tensor], starts: torch.Tensor, ck_off: torch.Tensor, n_ckpt: int, scale: float
              ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (o [TT, H, V], S [N, H, K, V], checkpoints [n_ckpt, H, K, V]; n_ckpt = 0: none kept)."""
    return _forward(r, w, k, v, a, b, S0, starts, ck_off, n_ckpt, scale)


@rwkv7_fwd.register_fake
def _(r, w, k, v, a, b, S0, starts, ck_off, n_ckpt, scale):
    TT, H, K = r.shape
    V, N = v.shape[-1], starts.shape[0] - 1
    return r.new_empty(TT, H, V), r.new_empty(N, H, K, V), r.new_empty(n_ckpt, H, K, V)


@torch.library.custom_op("linattn::cpu_rwkv7_bwd", mutates_args=(), device_types="cpu")
def rwkv7_bwd(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              ckpt: torch.Tensor, starts: torch.Tensor, ck_off: torch.Tensor, do: torch.Tensor, dS: torch.Tensor,
              scale: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                     torch.Tensor, torch.Tensor]:
    """-> (dr, dw, dk, dv, da, db, dS0) from do [TT, H, V] and dS = dL/dS_final."""
    TT, H, K = r.shape
    V, N = v.shape[-1], starts.numel() - 1
    dr, dw, dk, dv, da, db = (torch.empty_like(x) for x in (r, w, k, v, a, b))
    dS0 = dS.clone()  # the kernel turns dL/dS_final into dL/dS0 in place
    dec = torch.exp(w)  # held here: the kernel reads it through a raw pointer
    bindings.require("rwkv7")("linattn_rwkv7_bwd", r.dtype, N, H, K, V, ptr(starts), ptr(r), ptr(dec),
          ptr(k), ptr(v), ptr(a), ptr(b), scale, ptr(ckpt), ptr(ck_off), CHECKPOINT, ptr(do), ptr(dS0), ptr(dr),
          ptr(dk), ptr(dv), ptr(da), ptr(db), ptr(dw), threads())
    return dr, dw, dk, dv, da, db, dS0


@rwkv7_bwd.register_fake
def _(r, w, k, v, a, b, ckpt, starts, ck_off, do, dS, scale):
    return tuple(torch.empty_like(x) for x in (r, w, k, v, a, b, dS))


def _setup(ctx, inputs, output):
    r, w, k, v, a, b, S0, starts, ck_off, n_ckpt, scale = inputs
    ctx.has_S0, ctx.scale = S0 is not None, scale
    # no zero-filled gradients for outputs the loss does not reach (the checkpoints never are); _backward
    # treats None as zeros
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(r, w, k, v, a, b, output[2], starts, ck_off)


def _backward(ctx, do, dS, _dckpt):
    r, w, k, v, a, b, ckpt, starts, ck_off = ctx.saved_tensors
    N, H, K, V = starts.shape[0] - 1, r.shape[1], r.shape[2], v.shape[-1]
    do = do.contiguous() if do is not None else v.new_zeros(v.shape)
    dS = dS.contiguous() if dS is not None else r.new_zeros(N, H, K, V)
    dr, dw, dk, dv, da, db, dS0 = rwkv7_bwd(r, w, k, v, a, b, ckpt, starts, ck_off, do, dS, ctx.scale)
    return dr, dw, dk, dv, da, db, (dS0 if ctx.has_S0 else None), None, None, None, None


rwkv7_fwd.register_autograd(_backward, setup_context=_setup)



def rwkv7_scan(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               S0: Optional[torch.Tensor], starts: Sequence[int], scale: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """The scan on flat inputs: r, w, k, a, b [TT, H, K], v [TT, H, V], S0 [N, H, K, V] or None, starts [N + 1]
    -> (o [TT, H, V], S_final [N, H, K, V]). Every tensor in one dtype (float32 or float64), on the CPU, w the log
    decay (<= 0); differentiable in all of them."""
    r, w, k, v, a, b = (x.contiguous() for x in (r, w, k, v, a, b))
    S0 = S0.contiguous() if S0 is not None else None
    need_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (r, w, k, v, a, b, S0))
    starts = list(starts)
    st = torch.tensor(starts, dtype=torch.int64)
    scale = float(scale)
    if not need_grad and not torch.compiler.is_compiling():
        # eager inference (decoding): the kernel directly; the custom op's dispatch costs more than a one-token step
        o, S, _ = _forward(r, w, k, v, a, b, S0, st, st, 0, scale)
        return o, S
    offs, n = checkpoint_offsets(starts, CHECKPOINT)
    o, S, _ = rwkv7_fwd(r, w, k, v, a, b, S0, st, torch.tensor(offs, dtype=torch.int64), n if need_grad else 0, scale)
    return o, S
