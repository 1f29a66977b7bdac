"""Causal linear attention of the log-space feature maps (Hadamard Exp, FAVOR+) on the compiled CPU kernels
(csrc/linear_log.c): forward, backward and the one-token decoding step.

The kernels take log-features lq = log phi(scale q), lk = log psi(k) (computed in PyTorch, so that autograd
differentiates the map), values and an optional scalar log-gate per token and head, as rows [TT, H, D] of packed
sequences (`starts`, N + 1 row offsets). The state is kept as the forms keep it: S [N, H, K_phi, V + 1] ([kv | z])
and its per-feature log-scale mu [N, H, K_phi] (the true state is exp(mu) S, mu the running maximum of the decayed
key log-features); each output row comes relative to its own log-scale c (num and den both), as
ops/linear_recurrent.py and ops/linear_chunk_log.py return it. fp32 and fp64.

One custom op with a registered backward (`linattn::cpu_linear_log_fwd` / `..._bwd`), so that autograd and
torch.compile see single ops; `step` calls the forward kernel directly for decoding (no autograd, no op dispatch).
K_phi is at most `MAX_FEATURES` (the backward keeps a chunk's states per thread): `check_features` raises a
LinattnError naming the argument beyond it. This module never imports linattn.ops.
"""
from __future__ import annotations

import ctypes
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..errors import LinattnError
from . import bindings, ptr, threads
from .abi import LOG_MAX_FEATURES, LinearLogPlan

__all__ = ["MAX_FEATURES", "check_features", "chunk_linear_log_attention", "step"]

#: the widest log-feature vector (K_phi) the kernels take
MAX_FEATURES = LOG_MAX_FEATURES


def check_features(n: int, what: str = "the feature map's K_phi") -> None:
    """Raise a LinattnError when n log-features are more than the kernels take."""
    if n > MAX_FEATURES:
        raise LinattnError(f"{what} = {n} exceeds the {MAX_FEATURES} log-features the compiled log-space kernel "
                           f"takes (q/k head width too large for this map); use backend='torch'")


def _plan(starts: Tensor, N: int, H: int, K: int, V: int, C: int) -> LinearLogPlan:
    return LinearLogPlan(N, H, K, V, C, ptr(starts), threads(), 0)


def n_chunks(starts: List[int], C: int) -> int:
    return sum(-(-(b - a) // C) for a, b in zip(starts[:-1], starts[1:]))


def _opt(t: Optional[Tensor]) -> Optional[Tensor]:
    return t.contiguous() if t is not None and t.numel() > 0 else None


@torch.library.custom_op("linattn::cpu_linear_log_fwd", mutates_args=(), device_types="cpu")
def _fwd(lq: Tensor, lk: Tensor, v: Tensor, g: Optional[Tensor], S0: Optional[Tensor], mu0: Optional[Tensor],
         starts: List[int], chunk_size: int, keep_states: bool
         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    TT, H, K = lq.shape
    V = v.shape[-1]
    N = len(starts) - 1
    lq, lk, v, g, S0, mu0 = lq.contiguous(), lk.contiguous(), v.contiguous(), _opt(g), _opt(S0), _opt(mu0)
    num, den, c = lq.new_empty(TT, H, V), lq.new_empty(TT, H), lq.new_empty(TT, H)
    S, mu = lq.new_empty(N, H, K, V + 1), lq.new_empty(N, H, K)
    NC = n_chunks(starts, chunk_size) if keep_states else 0
    P, Pmu = lq.new_empty(NC, H, K, V + 1), lq.new_empty(NC, H, K)
    st = torch.tensor(starts, dtype=torch.int64)
    plan = _plan(st, N, H, K, V, chunk_size)
    bindings.require("linear_log")("linattn_linear_log_fwd", lq.dtype, ctypes.byref(plan), ptr(lq), ptr(lk), ptr(v),
                                   ptr(g), ptr(S0), ptr(mu0), ptr(num), ptr(den), ptr(c), ptr(S), ptr(mu),
                                   ptr(P) if keep_states else None, ptr(Pmu) if keep_states else None)
    return num, den, c, S, mu, P, Pmu


@_fwd.register_fake
def _(lq, lk, v, g, S0, mu0, starts, chunk_size, keep_states):
    TT, H, K = lq.shape
    V = v.shape[-1]
    N = len(starts) - 1
    NC = n_chunks(starts, chunk_size) if keep_states else 0
    return (lq.new_empty(TT, H, V), lq.new_empty(TT, H), lq.new_empty(TT, H), lq.new_empty(N, H, K, V + 1),
            lq.new_empty(N, H, K), lq.new_empty(NC, H, K, V + 1), lq.new_empty(NC, H, K))


@torch.library.custom_op("linattn::cpu_linear_log_bwd", mutates_args=(), device_types="cpu")
def _bwd(lq: Tensor, lk: Tensor, v: Tensor, g: Optional[Tensor], mu0: Optional[Tensor], c: Tensor, P: Tensor,
         Pmu: Tensor, mu_end: Tensor, dnum: Optional[Tensor], dden: Optional[Tensor], dS: Optional[Tensor],
         starts: List[int], chunk_size: int, want_dS0: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    TT, H, K = lq.shape
    V = v.shape[-1]
    N = len(starts) - 1
    if P.shape[0] != n_chunks(starts, chunk_size):
        raise RuntimeError("linattn: the compiled log-space forward ran without keeping its chunk states "
                           "(no input required grad), so it has no backward")
    lq, lk, v, g, mu0 = lq.contiguous(), lk.contiguous(), v.contiguous(), _opt(g), _opt(mu0)
    c, P, Pmu, mu_end = c.contiguous(), P.contiguous(), Pmu.contiguous(), mu_end.contiguous()
    dnum, dden, dS = _opt(dnum), _opt(dden), _opt(dS)
    if dnum is None:
        dnum = lq.new_zeros(TT, H, V)
    dlq, dlk, dv = torch.empty_like(lq), torch.empty_like(lk), torch.empty_like(v)
    dg = lq.new_zeros(TT, H) if g is not None else lq.new_empty(0)
    dS0 = lq.new_empty(N, H, K, V + 1) if want_dS0 else lq.new_empty(0)
    st = torch.tensor(starts, dtype=torch.int64)
    plan = _plan(st, N, H, K, V, chunk_size)
    bindings.require("linear_log")("linattn_linear_log_bwd", lq.dtype, ctypes.byref(plan), ptr(lq), ptr(lk), ptr(v),
                                   ptr(g), ptr(mu0), ptr(c), ptr(P), ptr(Pmu), ptr(mu_end), ptr(dnum), ptr(dden),
                                   ptr(dS), ptr(dlq), ptr(dlk), ptr(dv), ptr(dg) if g is not None else None,
                                   ptr(dS0) if want_dS0 else None)
    return dlq, dlk, dv, dg, dS0


@_bwd.register_fake
def _(lq, lk, v, g, mu0, c, P, Pmu, mu_end, dnum, dden, dS, starts, chunk_size, want_dS0):
    TT, H, K = lq.shape
    V = v.shape[-1]
    N = len(starts) - 1
    return (torch.empty_like(lq), torch.empty_like(lk), torch.empty_like(v),
            lq.new_empty(TT, H) if g is not None else lq.new_empty(0),
            lq.new_empty(N, H, K, V + 1) if want_dS0 else lq.new_empty(0))


def _setup(ctx, inputs, output):
    lq, lk, v, g, S0, mu0, starts, chunk_size, keep_states = inputs
    ctx.save_for_backward(lq, lk, v, g, mu0, output[2], output[5], output[6], output[4])
    ctx.args = (starts, chunk_size, S0 is not None)
    ctx.set_materialize_grads(False)


def _backward(ctx, dnum, dden, dc, dS, dmu, dP, dPmu):
    lq, lk, v, g, mu0, c, P, Pmu, mu_end = ctx.saved_tensors
    starts, chunk_size, has_S0 = ctx.args
    dlq, dlk, dv, dg, dS0 = _bwd(lq, lk, v, g, mu0, c, P, Pmu, mu_end, dnum, dden, dS, starts, chunk_size, has_S0)
    return dlq, dlk, dv, (dg if g is not None else None), (dS0 if has_S0 else None), None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup)


def chunk_linear_log_attention(lq: Tensor, lk: Tensor, v: Tensor, g: Optional[Tensor], S0: Optional[Tensor],
                               mu0: Optional[Tensor], *, starts: List[int], chunk_size: int
                               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """lq, lk [TT, H, K_phi] log-features, v [TT, H, V], g [TT, H] log-gate or None, S0 [N, H, K_phi, V + 1] and
    mu0 [N, H, K_phi] or None, all of one dtype (fp32 or fp64); chunk_size: the backward's checkpoint interval.
    -> (num [TT, H, V], den [TT, H], c [TT, H] (num and den relative to exp(c)), S [N, H, K_phi, V + 1], mu).
    c and mu carry no gradient (their effect cancels); the gradient of S0 is taken with mu0 held constant."""
    check_features(lq.shape[-1])
    if (S0 is None) != (mu0 is None):
        raise LinattnError("an initial state S0 needs its log-scale mu0 (and mu0 its S0)")
    keep = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (lq, lk, v, g, S0))
    num, den, c, S, mu, _, _ = _fwd(lq, lk, v, g, S0, mu0, [int(s) for s in starts], int(chunk_size), keep)
    return num, den, c, S, mu


def step(lq: Tensor, lk: Tensor, v: Tensor, g: Optional[Tensor], S: Optional[Tensor], mu: Optional[Tensor]
         ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One decoded token for B rows (grad-free): lq, lk [B, H, K_phi], v [B, H, V], g [B, H] or None, the state S
    [B, H, K_phi, V + 1] and mu [B, H, K_phi] or None (empty) -> (num [B, H, V], den [B, H], c [B, H], new S, new
    mu), fresh tensors. The forward kernel on B sequences of one token each: the chunk path's bits."""
    B, H, K = lq.shape
    V = v.shape[-1]
    check_features(K)
    lq, lk, v = lq.contiguous(), lk.contiguous(), v.contiguous()
    g, S, mu = _opt(g), _opt(S), _opt(mu)
    num, den, c = lq.new_empty(B, H, V), lq.new_empty(B, H), lq.new_empty(B, H)
    S1, mu1 = lq.new_empty(B, H, K, V + 1), lq.new_empty(B, H, K)
    st = torch.arange(B + 1, dtype=torch.int64)
    plan = _plan(st, B, H, K, V, 1)
    plan.nthreads = 1 if B * H < 4 else threads()
    bindings.require("linear_log")("linattn_linear_log_fwd", lq.dtype, ctypes.byref(plan), ptr(lq), ptr(lk), ptr(v),
                                   ptr(g), ptr(S), ptr(mu), ptr(num), ptr(den), ptr(c), ptr(S1), ptr(mu1), None, None)
    return num, den, c, S1, mu1
