"""The delta-rule family: DeltaNet, Gated DeltaNet and EFLA (error-free linear attention).

One recurrence covers all four variants. With the state S_t `[K, V]` per head,

    S_t = exp(g_t) (I - a_t k_t k_t^T) S_{t-1} + a_t k_t v_t^T,      o_t = scale * S_t^T q_t,

* DeltaNet:        a_t = beta_t, no gate;
* Gated DeltaNet:  a_t = beta_t, log-gate g_t <= 0;
* EFLA:            a_t = (1 - exp(-beta_t lambda_t)) / lambda_t with lambda_t = ||k_t||^2, the exact
                   (zero-order-hold) solution of dS/dt = -k k^T S + k v^T over a step of length beta_t;
                   a_t -> beta_t as lambda_t -> 0 (EFLA is DeltaNet's explicit-Euler limit);
* EFLA + gate.

Three forms that agree to floating-point precision:

* `recurrent` - one token at a time, a constant-size state (decoding);
* `chunk`     - the WY representation per chunk (UT transform: one unit lower-triangular solve per
                chunk, batched over all chunks), then a sequential loop over chunks that only carries
                the state (training);
* `parallel`  - the closed form over the whole sequence,
                O = scale [(Q K^T * Gam * M) (I + tril_-1(diag(a) (K K^T * Gam)))^-1 (diag(a) V - diag(a e^G) K S_0)
                           + (Q * e^G) S_0]
                with Gam_ij = exp(G_i - G_j), G the cumulative log-gate (the chunk form with one chunk).

Chunk algebra (gated, derived from the recurrence). Inside a chunk, with G_r the gate's cumulative sum
from the chunk start (so every exponent below is <= 0) and the "pseudo-values" u_r = a_r (v_r -
exp(g_r) S_{r-1}^T k_r), the recurrence gives S_r = e^{G_r} S_0 + sum_{i<=r} e^{G_r - G_i} k_i u_i^T, hence

    (I + tril_-1(diag(a) (K K^T * Gam))) U = diag(a) V - diag(a e^G) K S_0,
    U = U~ - W~ S_0   with  [U~ | W~] = (I + ...)^-1 [diag(a) V | diag(a e^G) K],

    O = scale [(Q * e^G) S_0 + (Q K^T * Gam * M) U],    S_C = e^{G_C} S_0 + (K * e^{G_C - G})^T U.

U~ and W~ do not depend on S_0, so they are computed for all chunks at once; the Python loop over
chunks only does U = U~ - W~ S and S <- e^{G_C} S + K_dec^T U (two batched matmuls per chunk, with
K_dec = K * e^{G_C - G}); O then follows from the stacked chunk-start states and U in batched matmuls.
(Precomputing each chunk's K x K transition P = e^{G_C} I - K_dec^T W~ would make the loop one matmul
per chunk but costs more arithmetic in all: T K^2 for P, plus U afterwards.)
Backward is plain autograd: it keeps one state per chunk and O(T * chunk) intermediates, never a
state per token.

Numerics: key-norm rescaling. The recurrence only sees k through a_t k_t k_t^T and a_t k_t v_t^T, so
for any d_t > 0 it is unchanged by k~ = k / d, v~ = v / d, a~ = a d^2. We take d_t = max(||k_t||, 1)
(detached: the result does not depend on d, so its gradient is exactly zero and the gradients stay
exact; this also keeps gradients finite at k = 0), whenever some ||k||^2 > 4 (below that, the raw
UT entries are already <= 4 beta and the extra pass is skipped). Then every key has ||k~|| <= 1, and the
eigenvalue of (I - a~ k~ k~^T) along k, 1 - a~ ||k~||^2 = 1 - a lambda, is carried by the bounded
factor a~ ||k~||^2. For EFLA, a lambda = 1 - exp(-beta lambda) in [0, 1): keys with norm 1e3
(lambda = 1e6) give a~ < 1 and strictly-lower UT entries a~_i k~_i^T k~_j of size <= 1, where the raw
keys give a_i k_i^T k_j up to ||k_j|| / ||k_i|| (~1e3 for norms 1 and 1e3 side by side), so the unit
triangular matrix, W~ and U~ stay O(1) whatever the key norms, and the contraction exp(-beta lambda)
in (0, 1] is carried by a bounded factor. Tiny keys (norm 1e-6) are left as they are (d = 1):
a~ = a ~ beta and every product is a plain rescaling, with no cancellation.
What we measured (fp32 vs an fp64 reference, key norms 1e-6 .. 1e3, also adversarial sequences of
nearly parallel keys alternating norms 1 / 1e3): both forms give outputs, states and gradients within
~1e-6 of the reference. The raw form is not worse in practice because forward substitution's rounding
error is componentwise and the rescaling is a diagonal similarity A~ = D^-1 A D, to which that
error bound is blind; its large entries are not large errors. We keep the rescaled form for its bounded
intermediates (no dependence of any UT quantity on the key scale); it costs one pass over k and v,
and only when some key has norm > 2.
The EFLA coefficient is a = -expm1(-beta lambda) / lambda, evaluated with its Taylor series
beta (1 - x/2 + x^2/6 - x^3/24), x = beta lambda, for x < 1e-3 (torch.where, with a safe denominator in
the unused branch), so lambda = 0 gives a = beta exactly and finite gradients; no eps shifts the value.
Its gradients come from their closed forms (a small autograd.Function): da/dbeta = exp(-beta lambda),
which autograd through expm1 would round to 0 in fp32 for saturated keys, and da/dlambda =
-beta^2 psi(beta lambda), psi(x) = (1 - (1 + x) e^-x) / x^2, with its own series for small x.

DeltaNet with unnormalised keys is unstable by nature when beta lambda > 2: the factor (I - beta k k^T)
has the eigenvalue 1 - beta lambda < -1 along k and the state grows geometrically. That growth is the
recurrence's, not the implementation's: all forms compute the same (growing) values, and the chunk
form's triangular solve reproduces it (see the tests, which compare short sequences in that regime).
Use qk_l2norm=True with beta in [0, 1] (or [0, 2]), or exact=True (EFLA), for a contractive update.

State: a plain tensor `[N, H, K, V]` (flash-linear-attention's convention; N = B, or the number of
sequences in cu_seqlens), fp32 (fp64 for fp64 inputs). It round-trips between modes and calls.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ._common import (FLOAT_DTYPES, check_cu_seqlens, check_log_gate, check_mode, check_qkv,
                      compute_dtype, pad_time, run_varlen)
from .backend import delta_rule_backend

SERIES_BELOW = 1e-3      # the EFLA coefficient uses its Taylor series below x = beta lam = 1e-3
PSI_SERIES_BELOW = 0.1  # ... and its lam-derivative below x = 0.1
RESCALE_ABOVE = 4.0      # key-norm rescaling (module docstring) when some ||k||^2 exceeds this
L2NORM_EPS = 1e-6        # qk_l2norm: x / max(||x||, eps), as flash-linear-attention


def _efla_value(beta: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    x = beta * lam
    small = x < SERIES_BELOW
    lam_safe = torch.where(small, torch.ones_like(lam), lam)
    quotient = -torch.expm1(-beta * lam_safe) / lam_safe
    series = beta * (1 - x / 2 * (1 - x / 3 * (1 - x / 4)))  # beta (1 - x/2 + x^2/6 - x^3/24)
    return torch.where(small, series, quotient)


def _psi(x: torch.Tensor) -> torch.Tensor:
    """psi(x) = (1 - (1 + x) exp(-x)) / x^2 for x >= 0 (psi(0) = 1/2), without cancellation."""
    small = x < PSI_SERIES_BELOW
    x_safe = torch.where(small, torch.ones_like(x), x)
    direct = (-torch.expm1(-x_safe) - x_safe * torch.exp(-x_safe)) / x_safe / x_safe
    # psi(x) = sum_j (-1)^j (j + 1) / (j + 2)! x^j; 11 terms reach 1e-17 at x = 0.1
    series = torch.zeros_like(x)
    for j in range(10, -1, -1):
        series = series * x + (-1) ** j * (j + 1) / math.factorial(j + 2)
    return torch.where(small, series, direct)


class _EFLACoefficient(torch.autograd.Function):
    """a = (1 - exp(-beta lam)) / lam = -expm1(-beta lam) / lam, with a = beta at lam = 0.

    Value: the expm1 quotient, or for x = beta lam < 1e-3 its Taylor series beta (1 - x/2 + x^2/6 -
    x^3/24) (truncation error x^4/120 relative); the unused torch.where branch gets a safe denominator.
    Gradients from their closed forms, da/dbeta = exp(-x) and da/dlam = -beta^2 psi(x), because
    autograd through expm1 differentiates it as (expm1(-x) + 1), which rounds to 0 in fp32 for x > 17
    and would lose da/dbeta for saturated keys. Everything is finite at lam = 0 (da/dlam = -beta^2/2).
    """

    @staticmethod
    def forward(ctx, beta, lam):
        ctx.save_for_backward(beta, lam)
        return _efla_value(beta, lam)

    @staticmethod
    def backward(ctx, grad):
        beta, lam = ctx.saved_tensors
        x = beta * lam
        return grad * torch.exp(-x), grad * (-beta * beta * _psi(x))


# ----------------------------------------------------------------------------------------------
# The three forms. Shared layout inside this module: [B, H, T, D]; q already scaled (and
# normalised), k and v rescaled by d (see the module docstring), b = a~ [B, H, T], g a log-gate
# [B, H, T] or None, S [B, H, K, V]. Each returns (o [B, H, T, V], S_final or None).
# ----------------------------------------------------------------------------------------------

def _recurrent(q, k, v, b, g, S):
    T = q.shape[2]
    b = b[..., None, None]                                            # [B, H, T, 1, 1]
    bv = v.unsqueeze(-2) * b                                          # [B, H, T, 1, V]
    decay = torch.exp(g)[..., None, None] if g is not None else None
    outs = []
    # per-step tensors by unbind: indexing [:, :, t] would give every step a full-size backward
    decays = decay.unbind(2) if decay is not None else [None] * T
    for q_t, k_t, bv_t, b_t, dec_t in zip(q.unbind(2), k.unbind(2), bv.unbind(2), b.unbind(2), decays):
        if dec_t is not None:
            S = S * dec_t
        kt = k_t.unsqueeze(-2)                                         # [B, H, 1, K]
        err = torch.addcmul(bv_t, b_t, kt @ S, value=-1.0)             # a~ (v - S^T k)
        S = torch.addcmul(S, kt.transpose(-1, -2), err)               # out with the old, in with the new
        outs.append(q_t.unsqueeze(-2) @ S)
    return torch.cat(outs, dim=2), S


def _wy_blocks(q, k, v, b, g):
    """The S_0-independent parts of blocks [..., C, D] (any leading dims): X = [U~ | W~] of the UT transform,
    the masked decayed scores Q K^T * Gam * M, the decayed queries and keys, and the block decay."""
    C = k.shape[-2]
    kb = k * b.unsqueeze(-1)                                          # diag(a~) K
    kk = kb @ k.transpose(-1, -2)                                     # diag(a~) K K^T
    qk = q @ k.transpose(-1, -2)
    if g is not None:
        G = g.cumsum(-1)                                              # [..., C], local to the block
        incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
        D = torch.exp((G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~incl, float("-inf")))
        kk, qk = kk * D, qk * D
        eG = torch.exp(G)
        q_dec = q * eG.unsqueeze(-1)
        k_dec = k * torch.exp(G[..., -1:] - G).unsqueeze(-1)
        block_decay = eG[..., -1:].unsqueeze(-1)                      # [..., 1, 1]
        kbw = kb * eG.unsqueeze(-1)
    else:
        q_dec, k_dec, block_decay, kbw = q, k, None, kb
    # in place on fresh intermediates that no backward needs; the diagonal of A is the implicit 1
    A = kk.tril_(-1)
    rhs = torch.cat([v * b.unsqueeze(-1), kbw], dim=-1)
    X = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)  # [U~ | W~]
    return X, qk.tril_(), q_dec, k_dec, block_decay


def _parallel(q, k, v, b, g, S, need_state):
    """The closed form: the whole sequence as one block (O(T^2) memory, O(T^2 (K + V)) work)."""
    X, Aqk, q_dec, k_dec, decay = _wy_blocks(q, k, v, b, g)
    Ut, Wt = X.split([v.shape[-1], k.shape[-1]], dim=-1)
    U = Ut - Wt @ S
    o = Aqk @ U + q_dec @ S
    if not need_state:
        return o, None
    S = S if decay is None else decay * S
    return o, S + k_dec.transpose(-1, -2) @ U


def _chunk(q, k, v, b, g, S, C):
    B, H, T, K = k.shape
    V = v.shape[-1]
    # padding tokens: a = 0 (no erase, no write) and g = 0 (no decay), so S is unchanged by them
    q, k, v, b = (pad_time(x, C, dim=2) for x in (q, k, v, b))
    g = pad_time(g, C, dim=2) if g is not None else None
    n = q.shape[2] // C
    BH = B * H

    def blocks(x):  # [B, H, n*C, *] -> [B*H, n, C, *] (a view for contiguous inputs)
        return x.reshape(BH, n, C, *x.shape[3:])

    X, Aqk, q_dec, k_dec, decay = _wy_blocks(
        blocks(q), blocks(k), blocks(v), blocks(b), blocks(g) if g is not None else None)
    Ut, Wt = X.split([V, K], dim=-1)                                  # [BH, n, C, V], [BH, n, C, K]
    KdT = k_dec.transpose(-1, -2)                                     # [BH, n, K, C]
    S = S.reshape(BH, K, V)
    starts, Us = [], []
    # the only sequential part, two batched matmuls per chunk: U = U~ - W~ S, S <- e^{G_C} S + K_dec^T U
    # (unbind, not indexing: the backward of n selects would materialise n full-size gradients)
    decays = decay.unbind(1) if decay is not None else [None] * n
    for Ut_i, Wt_i, KdT_i, dec_i in zip(Ut.unbind(1), Wt.unbind(1), KdT.unbind(1), decays):
        starts.append(S)
        U = torch.baddbmm(Ut_i, Wt_i, S, alpha=-1.0)
        Us.append(U)
        S = torch.baddbmm(S if dec_i is None else dec_i * S, KdT_i, U)
    starts, Us = torch.stack(starts, dim=1), torch.stack(Us, dim=1)  # [BH, n, K or C, V]
    o = torch.baddbmm(Aqk.view(BH * n, C, C) @ Us.view(BH * n, C, V), q_dec.reshape(BH * n, C, K),
                      starts.view(BH * n, K, V))
    o = o.view(B, H, n * C, V)[:, :, :T]
    return o, S.reshape(B, H, K, V)


# ----------------------------------------------------------------------------------------------
# Public operator
# ----------------------------------------------------------------------------------------------

def _check_beta(beta, B, T, H, device):
    layout = f"[B, T, H] = {(B, T, H)}"
    if not isinstance(beta, torch.Tensor):
        raise TypeError(f"beta must be a torch.Tensor of shape {layout}, got {type(beta).__name__}")
    if beta.dtype not in FLOAT_DTYPES:
        raise TypeError(f"beta must be float16, bfloat16, float32 or float64, got {beta.dtype}")
    if tuple(beta.shape) != (B, T, H):
        raise ValueError(f"beta must have shape {layout}, got {tuple(beta.shape)}")
    if beta.device != device:
        raise ValueError(f"beta must be on the device of q ({device}), got {beta.device}")
    if not bool((beta >= 0).all()):  # one pass catches both NaN and negative entries
        if torch.isnan(beta).any():
            raise ValueError("beta contains NaN")
        raise ValueError(f"beta is a step size and must be >= 0 everywhere, got a minimum of {beta.min().item():.4g}")


def _check_state(state, N, H, K, V, device):
    layout = f"[N, H, K, V] = {(N, H, K, V)}"
    if not isinstance(state, torch.Tensor):
        raise TypeError(f"initial_state must be a torch.Tensor of shape {layout} (as returned with "
                        f"output_final_state=True), got {type(state).__name__}")
    if state.dtype not in FLOAT_DTYPES:
        raise TypeError(f"initial_state must be a floating tensor, got {state.dtype}")
    if tuple(state.shape) != (N, H, K, V):
        raise ValueError(f"initial_state must have shape {layout} (N = B, or the number of sequences in "
                         f"cu_seqlens), got {tuple(state.shape)}")
    if state.device != device:
        raise ValueError(f"initial_state must be on the device of q ({device}), got {state.device}")


def check_args(q, k, v, beta, g, exact, scale, qk_l2norm, mode, chunk_size, initial_state, cu_seqlens):
    """Every argument check of `delta_rule` (shared with the Triton entry point).

    Returns (B, T, H, K, V, scale, offsets, N), with scale defaulted to K**-0.5 and offsets the
    packed-sequence boundaries (or None), N the number of sequences.
    """
    B, T, H, K, V = check_qkv(q, k, v)
    check_mode(mode, chunk_size)
    _check_beta(beta, B, T, H, q.device)
    if g is not None:
        check_log_gate(g, "g", B, T, H)
        if g.device != q.device:
            raise ValueError(f"g must be on the device of q ({q.device}), got {g.device}")
        if not torch.isfinite(g).all():
            raise ValueError("g must be finite (a log-gate of -inf would erase the state; use a large negative value)")
    if not isinstance(exact, bool):
        raise TypeError(f"exact must be a bool, got {type(exact).__name__}")
    if not isinstance(qk_l2norm, bool):
        raise TypeError(f"qk_l2norm must be a bool, got {type(qk_l2norm).__name__}")
    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    N = B if offsets is None else len(offsets) - 1
    if initial_state is not None:
        _check_state(initial_state, N, H, K, V, q.device)
    return B, T, H, K, V, scale, offsets, N


def delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
    g: Optional[torch.Tensor] = None,
    exact: bool = False,
    scale: Optional[float] = None,
    qk_l2norm: bool = False,
    mode: str = "chunk",
    chunk_size: int = 64,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Delta-rule linear attention. q, k `[B, T, H, K]`, v `[B, T, H, V]`, beta `[B, T, H]` (>= 0)
    -> (o `[B, T, H, V]`, final state `[N, H, K, V]` or None).

    S_t = exp(g_t) (I - a_t k_t k_t^T) S_{t-1} + a_t k_t v_t^T and o_t = scale * S_t^T q_t, with
    a_t = beta_t (exact=False: DeltaNet, or Gated DeltaNet when the log-gate `g` `[B, T, H]` (<= 0)
    is given) or a_t = (1 - exp(-beta_t ||k_t||^2)) / ||k_t||^2 (exact=True: EFLA, the exact solution
    of the delta rule's ODE; a_t = beta_t at k_t = 0). scale defaults to K**-0.5.
    qk_l2norm=True L2-normalises q and k first (inside the op, differentiably).

    mode: "chunk" (training), "recurrent" (decoding), "parallel" (quadratic closed form).
    The state is a plain tensor `[N, H, K, V]` (N = B, or the number of sequences in `cu_seqlens`,
    int64 `[N+1]` with B == 1), fp32 (fp64 for fp64 inputs); it round-trips between modes and calls.
    Inputs of any float dtype; accumulation in fp32 (fp64 for fp64 inputs); output in the input dtype.
    DeltaNet with unnormalised keys and beta ||k||^2 > 2 is unstable by nature (see the module notes).
    backend: "auto" (Triton kernels for covered CUDA calls, PyTorch otherwise), "torch" or "triton"
    (on CPU only under TRITON_INTERPRET=1); see docs/triton.md.
    """
    if delta_rule_backend(backend, q, k, v, beta, mode=mode, g=g, initial_state=initial_state) == "triton":
        from ..triton.delta import delta_rule_triton
        return delta_rule_triton(q, k, v, beta, g=g, exact=exact, scale=scale, qk_l2norm=qk_l2norm, mode=mode,
                                 chunk_size=chunk_size, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    B, T, H, K, V, scale, offsets, N = check_args(q, k, v, beta, g, exact, scale, qk_l2norm, mode, chunk_size,
                                                  initial_state, cu_seqlens)

    cdt = compute_dtype(q.dtype)
    # [B, T, H, D] -> [B, H, T, D], contiguous once, so that the chunk blocks are plain views
    qt, kt, vt = (x.to(cdt).transpose(1, 2).contiguous() for x in (q, k, v))
    bt = beta.to(cdt).transpose(1, 2).contiguous()
    gt = g.to(cdt).transpose(1, 2).contiguous() if g is not None else None
    if qk_l2norm:
        qt = F.normalize(qt, dim=-1, eps=L2NORM_EPS)
        kt = F.normalize(kt, dim=-1, eps=L2NORM_EPS)
    qt = qt * scale
    lam = (kt * kt).sum(-1)                                           # [B, H, T]
    a = _EFLACoefficient.apply(bt, lam) if exact else bt
    # key-norm rescaling (module docstring): k~ = k / d, v~ = v / d, a~ = a d^2, d = max(||k||, 1)
    # only worth a pass over k and v when some key is long (||k|| <= 2 keeps the UT entries <= 4 beta)
    if bool((lam.detach() > RESCALE_ABOVE).any()):
        d2 = lam.detach().clamp_min(1.0)
        d = d2.sqrt().unsqueeze(-1)
        kt, vt, bt = kt / d, vt / d, a * d2
    else:
        bt = a

    S0 = (initial_state.to(cdt) if initial_state is not None
          else torch.zeros(N, H, K, V, dtype=cdt, device=q.device))

    def run(q, k, v, b, g, S):
        if mode == "recurrent":
            return _recurrent(q, k, v, b, g, S)
        if mode == "parallel":
            return _parallel(q, k, v, b, g, S, output_final_state)
        return _chunk(q, k, v, b, g, S, chunk_size)

    if offsets is None:
        o, S = run(qt, kt, vt, bt, gt, S0)
    else:
        def one(i, sl):
            o_i, S_i = run(qt[:, :, sl], kt[:, :, sl], vt[:, :, sl], bt[:, :, sl],
                           gt[:, :, sl] if gt is not None else None, S0[i:i + 1])
            return o_i.transpose(1, 2), S_i

        o, S = run_varlen(offsets, one, lambda states: torch.cat(states) if output_final_state else None)
        o = o.transpose(1, 2)
    return o.transpose(1, 2).to(q.dtype), (S if output_final_state else None)
