"""The delta family's core: one private scan over the general recurrence

    S_t = D_t S_{t-1} - a_t k_t (S_{t-1}^T r_t)^T + a_t k_t v_t^T,      o_t = S_t^T q_t,

with the state S [K, V] per head, D_t = Diag(exp(g_t)) a decay (g a log-gate <= 0, one per head
`[B, T, H]` or one per key channel `[B, T, H, K]`), a_t the write strength (beta, or EFLA's exact
coefficient), k_t the write key and r_t the read key (None: the delta rule's own, r_t = D_t k_t; Comba: r = p).

A public operator of the family is a thin wrapper: it checks its own arguments, computes a (and r),
and calls `prepare_delta` (every shared check, once, and the shared preprocessing) then
`run_delta` (the PyTorch forms below, or the Triton kernels for the covered calls).

The three forms, the chunk algebra (UT transform, per-channel sub-blocks), the numerics (key-norm rescaling,
the unstable DeltaNet regime) and the state layout `[N, H, K, V]` are explained, with their history,
on the delta rule page of the documentation: docs/delta_rule.md.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Callable, List, Optional, Tuple, Union

import torch
import torch.nn.functional as F

from .. import fla
from ..errors import LinattnError, LinattnTypeError
from ..fla.delta import chunk_kernel
from ..triton import triton_chunk_size
from ._common import (
    FLA_CHUNK,
    FLOAT_DTYPES,
    LOG_GATE_FLOOR,
    all_finite,
    causal_matmul,
    check_cu_seqlens,
    check_log_gate,
    check_mode,
    check_qkv,
    check_same_device,
    check_scale,
    check_values,
    compute_dtype,
    pad_time,
    run_varlen,
)
from .backend import (
    DeltaSource,
    Rwkv7Source,
    choose_backend,
    cpu_delta,
    fla_delta,
    requires_grad,
    select_backend,
    triton_delta,
)
from .heads import value_groups
from .l2norm import L2NORM_EPS, l2norm, resolve_l2norm, select_rows

CHANNEL_BLOCK = 16       # chunk length with per-channel gates (their intra-chunk work is O(T * (c + C/c) * K))
CHANNEL_SUB = 4          # ... and its sub-blocks (c = sqrt(C) minimises c + C/c; 16/4 and 32/8 measured equal on CPU)
TRITON_MAX_K = 256       # the Triton kernels keep a whole K in registers

SERIES_BELOW = 1e-3      # the EFLA coefficient uses its Taylor series below x = beta lam = 1e-3
PSI_SERIES_BELOW = 0.1  # ... and its lam-derivative below x = 0.1
WIDE_GATES_ABOVE = 64    # blocks longer than this (the parallel form) sum fp32 gates in fp64 (`_wy_blocks`)


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



def efla_coefficient(beta: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """EFLA's write strength a = (1 - exp(-beta lam)) / lam (a = beta at lam = 0), with exact gradients."""
    return _EFLACoefficient.apply(beta, lam)

# ----------------------------------------------------------------------------------------------
# The three forms. Layout [B, H, T, D]: q (scaled), k~, v~, r~ or None, b = a~ [B, H, T], g a log-gate
# [B, H, T] (per head) or [B, H, T, K] (per channel) or None, S [B, H, K, V].
# Each returns (o [B, H, T, V], S_final).
# ----------------------------------------------------------------------------------------------

def _decay_factor(g_t: torch.Tensor) -> torch.Tensor:
    """exp(g_t) shaped to scale a state [.., K, V]: [.., 1, 1] per head, [.., K, 1] per channel."""
    return torch.exp(g_t).unsqueeze(-1) if g_t.dim() == 3 else torch.exp(g_t)[..., None, None]


def _recurrent(q, k, v, b, r, g, S):
    T = q.shape[2]
    bv = v * b.unsqueeze(-1)
    # per-step tensors by unbind: indexing [:, :, t] would give every step a full-size backward
    gs = g.unbind(2) if g is not None else [None] * T
    rs = r.unbind(2) if r is not None else [None] * T
    outs = []
    for q_t, k_t, bv_t, b_t, r_t, g_t in zip(q.unbind(2), k.unbind(2), bv.unbind(2), b.unbind(2), rs, gs):
        kt = k_t.unsqueeze(-2)                                         # [B, H, 1, K]
        if r_t is None:  # the delta rule's read: decay first, then predict from the decayed state
            if g_t is not None:
                S = S * _decay_factor(g_t)
            pred = kt @ S
        else:            # a read key of its own, on the undecayed state
            pred = r_t.unsqueeze(-2) @ S
            if g_t is not None:
                S = S * _decay_factor(g_t)
        err = torch.addcmul(bv_t.unsqueeze(-2), b_t[..., None, None], pred, value=-1.0)  # a (v - S^T r)
        S = torch.addcmul(S, kt.transpose(-1, -2), err)
        outs.append(q_t.unsqueeze(-2) @ S)
    return torch.cat(outs, dim=2), S


class _DecayedScores(torch.autograd.Function):
    """M_ti = sum_d x_td y_id E_tid with E_tid = exp(Gx_td - Gy_id) where `keep` [c, c] (else 0); x, y, Gx, Gy
    [..., c, K]. The backward is written out because autograd's, through the [c, c, K] product, runs several
    times slower on a CPU (outer-product matmuls of inner size 1): with W = dM E, dx = sum_i W y and
    dy = sum_t W x, and the gates' gradients come for free, dGx = x dx and dGy = -y dy (E's exponent is
    Gx - Gy)."""

    @staticmethod
    def forward(ctx, x, y, Gx, Gy, keep):
        # Gx, Gy may be fp64 (a long block's gate sums, `_wy_blocks`): E in x's dtype
        E = torch.exp((Gx.unsqueeze(-2) - Gy.unsqueeze(-3)).masked_fill(~keep[..., None], float("-inf"))).to(x.dtype)
        ctx.save_for_backward(x, y, E)
        return (x.unsqueeze(-2) * E * y.unsqueeze(-3)).sum(-1)

    @staticmethod
    def backward(ctx, dM):
        x, y, E = ctx.saved_tensors
        W = dM.unsqueeze(-1) * E
        dx = (W * y.unsqueeze(-3)).sum(-2)
        dy = (W * x.unsqueeze(-2)).sum(-3)
        return dx, dy, x * dx, -(y * dy), None


def _channel_scores(x, y, Gx, Gy, strict: bool) -> torch.Tensor:
    """M_ti = sum_d x_td y_id exp(Gx_td - Gy_id) for i <= t (i < t when `strict`); x, y, Gx, Gy [..., C, K]
    -> M [..., C, C]. Gx, Gy are log-decays from the chunk start (non-increasing in t; Gx_t may lag one token
    behind: Gx_t = Gy_{t-1}, with `strict`), so every exponent formed here is <= 0. Entries above the
    diagonal are 0, or NaN after a non-finite key (0 * inf): the caller masks them (tril_)."""
    C, K = x.shape[-2], x.shape[-1]
    c = min(CHANNEL_SUB, C)
    m = -(-C // c)                       # sub-blocks
    pad = m * c - C
    if pad:  # zero keys and queries, the last log-decay repeated: no exponent turns positive
        x, y = F.pad(x, (0, 0, 0, pad)), F.pad(y, (0, 0, 0, pad))
        Gx, Gy = (torch.cat([G, G[..., -1:, :].expand(*G.shape[:-2], pad, K)], dim=-2) for G in (Gx, Gy))
    lead, Cp = x.shape[:-2], m * c
    xb, yb, Gxb, Gyb = (t.reshape(*lead, m, c, K) for t in (x, y, Gx, Gy))
    # pairs inside one sub-block: explicit [.., m, c, c, K] decays
    inner = torch.ones(c, c, dtype=torch.bool, device=x.device).tril(-1 if strict else 0)
    diag = _DecayedScores.apply(xb, yb, Gxb, Gyb, inner)                             # [.., m, c, c]
    if m == 1:
        return diag.reshape(*lead, c, c)[..., :C, :C]
    # a query after sub-block I and I's keys, through I's last log-decay R_I: two factors <= 1, one matmul
    R = Gyb[..., -1, :]                                                              # [.., m, K]
    y_R = yb * torch.exp(R.unsqueeze(-2) - Gyb).to(yb.dtype)                         # [.., m, c, K]
    after = (torch.arange(Cp, device=x.device) // c)[None, :] > torch.arange(m, device=x.device)[:, None]
    x_R = x.unsqueeze(-3) * torch.exp((Gx.unsqueeze(-3) - R.unsqueeze(-2)).masked_fill(~after[..., None],
                                                                                       float("-inf"))).to(x.dtype)
    across = x_R @ y_R.transpose(-1, -2)                                             # [.., m (I), Cp (t), c]
    # the diagonal sub-blocks from `diag`, chosen (not added: a NaN key of one sub-block must not reach another)
    own = torch.eye(m, dtype=torch.bool, device=x.device)[:, None, :, None]           # [m, 1, m, 1]
    M = torch.where(own, diag.unsqueeze(-2), across.movedim(-3, -2).reshape(*lead, m, c, m, c))
    return M.reshape(*lead, Cp, Cp)[..., :C, :C]


def _wy_blocks(q, k, v, b, r, g):
    """The S_0-independent parts of blocks [..., C, D] (any leading dims): X = [U~ | W~] of the UT transform,
    the masked decayed scores Q K^T * Gam, the decayed queries and keys, and the block decay (or None)."""
    C = k.shape[-2]
    rr = k if r is None else r
    kb_r = rr * b.unsqueeze(-1)                                       # diag(a~) R
    if g is None:
        A, qk = kb_r @ k.transpose(-1, -2), q @ k.transpose(-1, -2)
        q_dec, k_dec, block_decay, w_rhs = q, k, None, kb_r
    else:
        # a long block (the parallel form: C = T) sums its gates in fp64: in fp32 a sum near -400 carries an
        # absolute error ~3e-5 into every exp(G_t - G_i), even for neighbours; the exponentials are
        # taken in that dtype and cast back (`ex`), so everything else stays in q's dtype
        if C > WIDE_GATES_ABOVE and g.dtype == torch.float32:
            g = g.double()
        dt = q.dtype

        def ex(x):
            return torch.exp(x).to(dt)

        G = g.cumsum(-2 if g.dim() == q.dim() else -1)               # [..., C(, K)], local to the block
        Gr = G if r is None else G - g                                # the read key's log-decay
        if g.dim() == q.dim():  # per channel: sub-blocks (module docstring), every exponent <= 0
            qk = _channel_scores(q, k, G, G, strict=False)
            A = _channel_scores(kb_r, k, Gr, G, strict=True)
            eG = ex(G)
            q_dec, w_rhs = q * eG, kb_r * ex(Gr)
            k_dec = k * ex(G[..., -1:, :] - G)
            block_decay = eG[..., -1, :].unsqueeze(-1)                # [..., K, 1]
        else:                   # per head: matmuls times exp(G_t - G_i)
            incl = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
            strict = incl.tril(-1)  # a given read key sees e^{G_{t-1} - G_i}: only i < t is ever used (and <= 0)
            D = ex((G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~incl, float("-inf")))
            Dr = D if r is None else ex((Gr.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~strict, float("-inf")))
            A, qk = (kb_r @ k.transpose(-1, -2)) * Dr, (q @ k.transpose(-1, -2)) * D
            eG = ex(G)
            q_dec, w_rhs = q * eG.unsqueeze(-1), kb_r * ex(Gr).unsqueeze(-1)
            k_dec = k * ex(G[..., -1:] - G).unsqueeze(-1)
            block_decay = eG[..., -1:].unsqueeze(-1)                  # [..., 1, 1]
    # in place on fresh intermediates that no backward needs; the diagonal of A is the implicit 1.
    # (I + A)^-1 by one triangular solve against the identity (C right-hand sides), then two batched
    # matmuls: on a CPU the batched small solve is far slower per flop than a matmul, and this halves it
    # (and its backward) compared with solving for [U~ | W~] (V + K right-hand sides) directly. The inverse
    # is lower triangular: `causal_matmul` keeps a later inf or NaN (value or key) out of earlier rows, as
    # forward substitution did
    A = A.tril_(-1)
    eye = torch.eye(C, dtype=A.dtype, device=A.device).expand(A.shape)
    Tinv = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)
    X = (causal_matmul(Tinv, v * b.unsqueeze(-1)), causal_matmul(Tinv, w_rhs))  # (U~, W~)
    return X, qk.tril_(), q_dec, k_dec, block_decay


def _chunk(q, k, v, b, r, g, S, C):
    B, H, T, K = k.shape
    V = v.shape[-1]
    # padding tokens: a = 0 (no erase, no write) and g = 0 (no decay), so S is unchanged by them
    q, k, v, b = (pad_time(x, C, dim=2) for x in (q, k, v, b))
    r = pad_time(r, C, dim=2) if r is not None else None
    g = pad_time(g, C, dim=2) if g is not None else None
    n = q.shape[2] // C
    BH = B * H

    def blocks(x):  # [B, H, n*C, *] -> [B*H, n, C, *] (a view for contiguous inputs)
        return x.reshape(BH, n, C, *x.shape[3:]) if x is not None else None

    (Ut, Wt), Aqk, q_dec, k_dec, decay = _wy_blocks(blocks(q), blocks(k), blocks(v), blocks(b), blocks(r),
                                                    blocks(g))          # Ut [BH, n, C, V], Wt [BH, n, C, K]
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
    # a later pseudo-value (inf or NaN after a non-finite token) never reaches an earlier row
    o = torch.baddbmm(causal_matmul(Aqk.reshape(BH * n, C, C), Us.view(BH * n, C, V)), q_dec.reshape(BH * n, C, K),
                      starts.view(BH * n, K, V))
    o = o.view(B, H, n * C, V)[:, :, :T]
    return o, S.reshape(B, H, K, V)


# ----------------------------------------------------------------------------------------------
# Validate and prepare once
# ----------------------------------------------------------------------------------------------

@dataclass
class DeltaProblem:
    """One validated delta-family call, preprocessed for every backend, in the compute dtype and the
    caller's layout [B, T, H, *]: q (normalised if asked, scaled), k~, v~, r~ (or None) rescaled by
    d = max(||k||, 1), a = a~ [B, T, H], g [B, T, H] or [B, T, H, K] (or None), S0 [N, H, K, V] or None
    (H: v's heads; q, k, r may have fewer, `value_groups`)."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    r: Optional[torch.Tensor]
    a: torch.Tensor
    g: Optional[torch.Tensor]
    S0: Optional[torch.Tensor]
    mode: str
    chunk_size: int
    offsets: Optional[List[int]]
    N: int
    output_final_state: bool
    out_dtype: torch.dtype
    #: grouped value heads: v, a, g and the state have HV = value_groups * H heads, q, k, r the caller's H (value
    #: head j reads q/k head j // value_groups): the Triton kernels read them so, the other forms through
    #: `value_head_qkr`
    value_groups: int = 1
    #: the caller's inputs (`prepare_delta` sets it; None for a problem built otherwise): the fla backend's input
    source: Union[DeltaSource, Rwkv7Source, None] = None
    #: False: q, k, v, a are the caller's tensors, not preprocessed (`prepare_delta(backend=)` for a call that
    #: fla's kernels take, which read `source`): only the fla backend may run it
    prepared: bool = True
    #: (cpu.delta.PREP_L2 or PREP_RAW, scale, eps): q, k, v are the caller's rows in the compute dtype and a is beta,
    #: which the compiled CPU scan prepares itself as it reads them, forward and backward (`prepare_delta(fused=True,
    #: backend=)` for a call that the compiled CPU kernels take); another backend prepares them first (`run_delta`)
    prep: Optional[Tuple[int, float, float]] = None

    @property
    def channel_gate(self) -> bool:
        return self.g is not None and self.g.dim() == 4

    def value_head_qkr(self) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """q, k, r with one head per value head (repeated when value_groups > 1): the forms that take q, k and v
        with the same heads (PyTorch, the compiled CPU scan)."""
        n = self.value_groups
        if n == 1:
            return self.q, self.k, self.r
        q, k = self.q.repeat_interleave(n, dim=2), self.k.repeat_interleave(n, dim=2)
        # Comba without p reads with k itself: one repeat, so its two gradients add before the heads' sum
        r = k if self.r is self.k else self.r.repeat_interleave(n, dim=2) if self.r is not None else None
        return q, k, r

    def fla_unsupported(self) -> Optional[str]:
        """Why fla's kernels do not cover this call (None when they do; the device and fla-core itself are checked
        by the dispatch): chunk and recurrent forms of DeltaNet, Gated DeltaNet, KDA and EFLA in fp16 / bf16 /
        fp32 with K <= 256; the recurrent kernels are forward-only."""
        if self.source is None:
            return "this operator has no fla adapter yet"
        if self.out_dtype not in fla.DTYPES:
            return f"fla's kernels take fp16 / bf16 / fp32 inputs, not {self.out_dtype}"
        if self.mode not in ("chunk", "recurrent"):
            return f"mode={self.mode!r} has no fla kernel (chunk and recurrent do)"
        src = self.source
        if self.r is not None and not isinstance(src, Rwkv7Source):
            return ("a read key of its own (Comba's p) is not translated to fla's kernels yet (fla's Comba reads "
                    "the decayed state, linattn's the undecayed one)")
        if self.q.shape[-1] > fla.MAX_HEAD_DIM:
            return f"fla's delta-rule kernels take head sizes K <= {fla.MAX_HEAD_DIM}, got K = {self.q.shape[-1]}"
        grads = requires_grad(*(t for t in src if isinstance(t, torch.Tensor)), self.g, self.S0)
        if self.mode == "recurrent" and grads:
            return "fla's fused_recurrent delta-rule kernels are forward-only (decoding) and an input requires grad"
        if (self.mode == "chunk" and grads and not isinstance(src, Rwkv7Source)
                and chunk_kernel(None if self.g is None else self.g.dim(), src.q.dtype,
                                 self.value_groups)[1] in fla.GATED_BACKWARD_KERNELS):
            return fla.gated_backward_refused()
        return None

    def triton_unsupported(self) -> Optional[str]:
        """Why the Triton kernels do not cover this call (None when they do)."""
        if self.out_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"the kernels take fp16 / bf16 / fp32 inputs, not {self.out_dtype}"
        if self.mode not in ("chunk", "recurrent"):
            return f"mode={self.mode!r} has no Triton kernel (chunk and recurrent do)"
        if self.q.shape[-1] > TRITON_MAX_K:
            return f"the kernels keep a whole K in registers and support K <= {TRITON_MAX_K}"
        if self.r is not None:
            return "a read key of its own (r, Comba's p) has no Triton kernel"
        if self.mode == "recurrent" and requires_grad(self.q, self.k, self.v, self.a, self.g, self.S0):
            return "the fused recurrent kernel is forward-only (decoding) and an input requires grad"
        return None

    cpu_kernel = "delta"  # the compiled CPU library (linattn/cpu/csrc/delta.c) that runs this problem

    def cpu_unsupported(self) -> Optional[str]:
        """Why the compiled CPU kernels do not cover this call (None when they do). They run every mode (one
        exact token-by-token scan), every gate (none, per head, per channel), fp32 and fp64 compute dtypes."""
        if self.q.device.type != "cpu":
            return f"the compiled kernels take CPU tensors, got {self.q.device}"
        if self.q.dtype not in (torch.float32, torch.float64):
            return f"the compiled kernels compute in float32 / float64, not {self.q.dtype}"
        if self.r is not None:
            return "a read key of its own (r, Comba's p) has no compiled CPU kernel"
        return None

    def chunk_size_used(self, backend: str) -> int:
        """The chunk length a backend really uses for this call (recurrent: 1, parallel: T)."""
        if backend == "cpu":  # the compiled scan goes token by token in every mode
            return 1
        if self.mode == "recurrent":
            return 1
        if self.mode == "parallel":
            return self.q.shape[1]
        if backend == "fla":  # fla's default chunk (its result does not depend on it)
            return FLA_CHUNK
        if backend == "triton":  # per-channel gates (KDA): a 16-token tile (triton/delta.py's KDA_CHUNK)
            return 16 if self.channel_gate else triton_chunk_size(self.chunk_size)
        return min(self.chunk_size, CHANNEL_BLOCK) if self.channel_gate else self.chunk_size


def _check_step(x, name: str, shape, ref: torch.Tensor, layout: str) -> None:
    """beta-like per-token tensors: shape, dtype, device, and >= 0 (when value checks run)."""
    if not isinstance(x, torch.Tensor):
        raise LinattnTypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise LinattnTypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise LinattnError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(x.shape)}")
    check_same_device(x, name, ref)
    # one reduction catches both NaN (the minimum is then NaN) and negative entries
    if check_values(x) and x.numel() and not bool(x.detach().min() >= 0):
        if torch.isnan(x).any():
            raise LinattnError(f"{name} contains NaN")
        raise LinattnError(f"{name} is a step size and must be >= 0 everywhere, got a minimum of "
                           f"{x.min().item():.4g}")


def check_state(state, N, H, K, V, device, ref: str = "q") -> None:
    """An initial state `[N, H, K, V]` of the delta family: a floating tensor of that shape on `device` (that of
    the input named `ref`)."""
    layout = f"[N, H, K, V] = {(N, H, K, V)}"
    if not isinstance(state, torch.Tensor):
        raise LinattnTypeError(f"initial_state must be a torch.Tensor of shape {layout} (as returned with "
                               f"output_final_state=True), got {type(state).__name__}")
    if state.dtype not in FLOAT_DTYPES:
        raise LinattnTypeError(f"initial_state must be a floating tensor, got {state.dtype}")
    if tuple(state.shape) != (N, H, K, V):
        raise LinattnError(f"initial_state must have shape {layout} (N = B, or the number of sequences in "
                           f"cu_seqlens), got {tuple(state.shape)}")
    if state.device != device:
        raise LinattnError(f"initial_state must be on the device of {ref} ({device}), got {state.device}")


def _check_flag(x, name: str) -> None:
    if not isinstance(x, bool):
        raise LinattnTypeError(f"{name} must be a bool, got {type(x).__name__}")


def prepare_delta(q, k, v, beta, *, g=None, r=None, channel_gate: bool = False,
                  coefficient: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None,
                  scale=None, qk_l2norm=False, mode: str = "chunk", chunk_size: int = 64,
                  initial_state=None, output_final_state: bool = False, cu_seqlens=None,
                  fused: bool = False, backend: Optional[str] = None) -> DeltaProblem:
    """Every check shared by the delta family, once, and the shared preprocessing: the base of a new delta variant.

    A variant chooses the write strength a (through `coefficient`), the read key r and the gate g of the core's
    step S_t = exp(g_t) S_{t-1} - a_t k_t (S_{t-1}^T r_t)^T + a_t k_t v_t^T (CONTRIBUTING.md's recipe), then runs
    the prepared problem with `linattn.ops.delta_core.run_delta(problem, backend)`.

    Grouped value heads: HV = n H (n >= 1), value head j reads q/k (and r) head j // n (transformers'
    repeat_interleave); beta, g and the state `[N, HV, K, V]` are per value head. The prepared q, k, r keep the
    H heads (`DeltaProblem.value_head_qkr` repeats them for the forms that need HV).

    Args:
        q: Queries `[B, T, H, K]`, any float dtype.
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, HV, V]`.
        beta: Write strengths `[B, T, HV]`, >= 0.
        g: A log-gate `[B, T, HV]` (or `[B, T, HV, K]` when `channel_gate`), or None.
        r: The read key `[B, T, H, K]`, or None (the delta rule's own).
        channel_gate: Accept a per-key-channel gate `[B, T, HV, K]`.
        coefficient: `coefficient(beta, ||k||^2)` -> a (default a = beta; EFLA passes `efla_coefficient`),
            evaluated after qk_l2norm.
        scale: None means K**-0.5.
        qk_l2norm: False, True = "rsqrt" or "clamp" (`ops/l2norm.py`), as in `delta_rule`.
        mode: "chunk", "recurrent" or "parallel".
        chunk_size: The chunk length of the chunk form.
        initial_state: The state `[N, HV, K, V]` to start from, or None.
        output_final_state: Return the final state when the problem is run.
        cu_seqlens: int64 `[N+1]` offsets of N packed sequences (B == 1).
        fused: Allow the compiled CPU preprocessing (`linattn.cpu.delta.delta_prepare`: the normalisation, scale
            and key-norm rescaling in one pass each way) where it covers the call: CPU float32 / float64 inputs,
            qk_l2norm "rsqrt" without a coefficient, or no qk_l2norm with or without one (EFLA: the coefficient
            and d2 then run in PyTorch on [B, T, H]), no r, no grouped value heads, eager, kernels switched on. The
            same values as the PyTorch lines to rounding; they stay the reference and the fallback. Without EFLA's
            coefficient, with `backend` given, a call that the compiled CPU kernels take comes back with
            `DeltaProblem.prep` set: the scan then prepares the caller's rows itself, forward and backward (the
            bits and gradients of the pass, which is not run).
        backend: The backend the call will be run on, when known: a call that it sends to fla's kernels skips the
            PyTorch preprocessing (fla takes the caller's tensors, `DeltaProblem.prepared` False); None: always
            preprocess (the problem then runs on any backend).

    Returns:
        The prepared call, a `DeltaProblem` in the compute dtype, for `run_delta` (or `chunk_size_used`).

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from linattn import delta_rule, prepare_delta
        >>> from linattn.ops.delta_core import run_delta
        >>> q, v = torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
        >>> k, beta = F.normalize(torch.randn(1, 6, 2, 8), dim=-1), torch.rand(1, 6, 2)
        >>> o, _ = run_delta(prepare_delta(q, k, v, beta), "torch")
        >>> torch.allclose(o, delta_rule(q, k, v, beta)[0], atol=1e-6)
        True
    """
    with _torch_scope(fused, q, v, qk_l2norm, coefficient, r):
        return _prepare_delta(q, k, v, beta, g=g, r=r, channel_gate=channel_gate, coefficient=coefficient,
                              scale=scale, qk_l2norm=qk_l2norm, mode=mode, chunk_size=chunk_size,
                              initial_state=initial_state, output_final_state=output_final_state,
                              cu_seqlens=cu_seqlens, fused=fused, backend=backend)


def _torch_scope(fused: bool, q, v, qk_l2norm, coefficient, r):
    """`cpu.torch_on_one_thread` when the compiled preprocessing takes the call (the torch operators left around
    the kernels are then a few passes over [B, T, H]: on one thread they never wait for a descheduled one), else
    nothing (bad arguments: nothing here, the checks raise)."""
    if (not fused or torch.compiler.is_compiling() or not isinstance(q, torch.Tensor)
            or not isinstance(v, torch.Tensor) or q.device.type != "cpu"):
        return contextlib.nullcontext()
    try:
        covered = _fused_prep(compute_dtype(q.dtype), q.device, resolve_l2norm(qk_l2norm), coefficient, r,
                              value_groups(q, v))
    except (LinattnError, RuntimeError):
        return contextlib.nullcontext()
    from ..cpu import torch_on_one_thread

    return torch_on_one_thread() if covered else contextlib.nullcontext()


def _prepare_delta(q, k, v, beta, *, g, r, channel_gate, coefficient, scale, qk_l2norm, mode, chunk_size,
                   initial_state, output_final_state, cu_seqlens, fused, backend) -> DeltaProblem:
    """prepare_delta's work (its docstring)."""
    n = value_groups(q, v)
    B, T, H, K, V = check_qkv(q, k, v[:, :, ::n] if n > 1 else v)   # a view with H heads: metadata only
    HV = H * n
    if K == 0:
        raise LinattnError(f"q and k must have shape [B, T, H, K] with K >= 1 (the state is [K, V]), "
                           f"got {tuple(q.shape)}")
    check_mode(mode, chunk_size)
    _check_step(beta, "beta", (B, T, HV), q, "[B, T, HV] (HV: v's heads)" if n > 1 else "[B, T, H]")
    if g is not None:
        check_log_gate(g, "g", B, T, HV, K, allow_diagonal=channel_gate, ref=q)
        if check_values(g) and not all_finite(g):  # (a sum, not isfinite's boolean copy: ~0.5 ms at 64k)
            raise LinattnError("g must be finite (a log-gate of -inf would erase the state; use a large "
                               "negative value)")
    if r is not None:
        check_tensor_like(r, "r", q)
    l2 = resolve_l2norm(qk_l2norm)
    _check_flag(output_final_state, "output_final_state")
    scale = check_scale(scale, K ** -0.5)
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    N = B if offsets is None else len(offsets) - 1
    if initial_state is not None:
        check_state(initial_state, N, HV, K, V, q.device)

    cdt = compute_dtype(q.dtype)
    source = DeltaSource(q, k, v, beta, l2, scale, coefficient)
    fused = fused and _fused_prep(cdt, q.device, l2, coefficient, r, n)
    if fused:  # the floor's backward as well on one thread (`cpu.torch_on_one_thread`)
        from ..cpu.delta import delta_prepare, delta_prepare_raw, delta_prepare_raw_a, floor_log_gate

        g_c = floor_log_gate(g.to(cdt), LOG_GATE_FLOOR) if g is not None else None
    else:
        g_c = g.to(cdt).clamp_min(-LOG_GATE_FLOOR) if g is not None else None
    S0 = initial_state.to(cdt) if initial_state is not None else None
    if backend is not None and backend != "torch" and fla.runs_on(q.device):
        # the caller's tensors as they are: fla's kernels normalise and scale themselves (`fla_delta`)
        raw = DeltaProblem(q, k, v, r, beta, g_c, S0, mode, chunk_size, offsets, N, output_final_state, q.dtype,
                           n, source, prepared=False)
        if choose_backend(backend, raw).backend == "fla":
            return raw
    q_c, k_c, v_c, b_c = q.to(cdt), k.to(cdt), v.to(cdt), beta.to(cdt)
    if fused:
        if l2 is None and coefficient is not None:   # the lines below, but for EFLA's coefficient and d2
            q_c, k_c, v_c, lam = delta_prepare_raw(q_c, k_c, v_c, scale)
            a = (coefficient(b_c.to(lam.dtype), lam) * lam.detach().clamp_min(1.0)).to(cdt)
        else:
            deferred = _deferred_prep(q_c, k_c, v_c, b_c, g_c, S0, l2, scale, mode, chunk_size, offsets, N,
                                      output_final_state, q.dtype, source, backend)
            if deferred is not None:
                return deferred
            if l2 is None:   # a = beta d2 in the same pass (the bits of delta_prepare_raw then write_strength)
                q_c, k_c, v_c, a = delta_prepare_raw_a(q_c, k_c, v_c, b_c, scale)
            else:
                q_c, k_c, v_c, a = delta_prepare(q_c, k_c, v_c, b_c, scale, L2NORM_EPS)
        return DeltaProblem(q_c, k_c, v_c, None, a, g_c, S0, mode, chunk_size, offsets, N, output_final_state,
                            q.dtype, n, source)
    if l2 is not None:
        q_c, k_c = l2norm(q_c, l2), l2norm(k_c, l2)
    q_c = q_c * scale
    lam, d2, d = key_norms(k_c)
    k_c = k_c / d
    r_c = r.to(cdt) / d if r is not None else None
    if n > 1:  # a and v~ per value head; q, k, r stay on the H heads (`DeltaProblem.value_head_qkr`)
        lam, d2, d = (x.repeat_interleave(n, dim=2) for x in (lam, d2, d))
    a = coefficient(b_c.to(lam.dtype), lam) if coefficient is not None else b_c
    # key-norm rescaling (module docstring): k~ = k / d, v~ = v / d, r~ = r / d, a~ = a d^2, d = max(||k||, 1)
    return DeltaProblem(q_c, k_c, v_c / d, r_c, (a * d2).to(cdt), g_c, S0, mode,
                        chunk_size, offsets, N, output_final_state, q.dtype, n, source)



def _deferred_prep(q_c, k_c, v_c, b_c, g_c, S0, l2, scale, mode, chunk_size, offsets, N, output_final_state,
                   out_dtype, source, backend) -> Optional[DeltaProblem]:
    """The fused call that the compiled CPU scan prepares itself (`DeltaProblem.prep`), or None: when `backend` takes
    the call to the compiled CPU kernels, the caller's rows go to the scan as they are, which prepares each where it
    reads it (the preparation pass's bits, spread over the scan's threads, never written out nor read back); with a
    gradient, the backward scan prepares each row again and returns the raw rows' gradients (the bits of the pass's
    backward; cpu.delta.delta_scan)."""
    if backend is None:
        return None
    from ..cpu.delta import PREP_L2, PREP_RAW

    prep = (PREP_RAW, float(scale), 0.0) if l2 is None else (PREP_L2, float(scale), float(L2NORM_EPS))
    p = DeltaProblem(q_c, k_c, v_c, None, b_c, g_c, S0, mode, chunk_size, offsets, N, output_final_state, out_dtype,
                     1, source, prep=prep)
    choice = choose_backend(backend, p)
    return p if choice.backend == "cpu" and choice.fallback is None else None


def _prepared_rows(p: DeltaProblem) -> DeltaProblem:
    """A `DeltaProblem.prep` call with its rows prepared (the pass that the compiled scan would have fused)."""
    from ..cpu.delta import prepare_rows

    rows = prepare_rows(p.q, p.k, p.v, p.a, p.prep)
    return replace(p, q=rows[0], k=rows[1], v=rows[2], a=rows[3], prep=None)


def _fused_prep(cdt: torch.dtype, device: torch.device, l2: Optional[str], coefficient, r, n: int) -> bool:
    """Whether prepare_delta's compiled preprocessing covers the call (its `fused` argument)."""
    if l2 == "clamp" or (l2 is not None and coefficient is not None) or r is not None or n != 1 \
            or device.type != "cpu":
        return False
    from ..cpu.delta import prep_available

    return prep_available(cdt)


def key_norms(k: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """lam = ||k||^2 [..] (what EFLA's coefficient reads), d2 = max(lam, 1) (detached) and d = sqrt(d2)
    [.., 1] in k's dtype, for k [.., K] (the compute dtype). lam and d2 are fp64 for fp32 keys: ||k||^2
    overflows fp32 from ||k|| ~ 1.8e19, fp64 never for a finite fp32 key; the rows where the fp32 sum
    overflowed are summed in fp64 (`l2norm.select_rows`), the others are the fp32 sum, exactly widened (so
    d2 and a d2 round to the fp32 values of the plain formula). d <= sqrt(K) * 3.4e38 is taken back to fp32
    only after the square root. fp64 keys: exact below ||k|| ~ 1e154."""
    lam = (k * k).sum(-1)                                             # [B, T, H]
    if k.dtype == torch.float32:
        lam = select_rows(lam.double(), ~torch.isfinite(lam.detach()),
                           lambda rows: (lambda kw: (kw * kw).sum(-1))((k if rows is None else k[rows]).double()))
    d2 = lam.detach().clamp_min(1.0)
    return lam, d2, d2.sqrt().unsqueeze(-1).to(k.dtype)


def check_tensor_like(x, name: str, q: torch.Tensor) -> None:
    """An extra per-token key with the shape, dtype and device of q."""
    if not isinstance(x, torch.Tensor):
        raise LinattnTypeError(f"{name} must be a torch.Tensor of shape [B, T, H, K] = {tuple(q.shape)}, "
                               f"got {type(x).__name__}")
    if tuple(x.shape) != tuple(q.shape):
        raise LinattnError(f"{name} must have the shape of q [B, T, H, K] = {tuple(q.shape)}, got {tuple(x.shape)}")
    if x.dtype != q.dtype:
        raise LinattnTypeError(f"{name} must have the dtype of q ({q.dtype}), got {x.dtype}")
    check_same_device(x, name, q)


# ----------------------------------------------------------------------------------------------
# Run
# ----------------------------------------------------------------------------------------------

def _run_torch(p: DeltaProblem):
    B, T, H, V = p.v.shape
    K = p.q.shape[-1]

    def bht(x):  # [B, T, H, *] -> [B, H, T, *], contiguous once, so that the chunk blocks are plain views
        return x.transpose(1, 2).contiguous() if x is not None else None

    q, k, r = p.value_head_qkr()
    q, k, v, r, b, g = (bht(x) for x in (q, k, p.v, r, p.a, p.g))
    S0 = p.S0 if p.S0 is not None else torch.zeros(p.N, H, K, V, dtype=q.dtype, device=q.device)

    def run(q, k, v, b, r, g, S):
        if p.mode == "recurrent":
            return _recurrent(q, k, v, b, r, g, S)
        C = q.shape[2] if p.mode == "parallel" else p.chunk_size_used("torch")
        return _chunk(q, k, v, b, r, g, S, C)

    if p.offsets is None:
        o, S = run(q, k, v, b, r, g, S0)
    else:
        o, S = run_varlen(p.offsets, lambda i, sl: run(
            q[:, :, sl], k[:, :, sl], v[:, :, sl], b[:, :, sl], r[:, :, sl] if r is not None else None,
            g[:, :, sl] if g is not None else None, S0[i:i + 1]), dim=2)
    return o.transpose(1, 2), S


def _run_cpu(p: DeltaProblem) -> Tuple[torch.Tensor, torch.Tensor]:
    """cpu_delta, the decays and layouts around the scan on one thread (`cpu.torch_on_one_thread` says why)."""
    if torch.compiler.is_compiling():
        return cpu_delta(p)
    from ..cpu import torch_on_one_thread

    with torch_on_one_thread():
        o, S = cpu_delta(p)
        return o.to(p.out_dtype), S


def run_delta(p: DeltaProblem, backend: str = "auto") -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run a prepared call on `backend` -> (o [B, T, H, V] in the input dtype, final state or None)."""
    chosen = select_backend(backend, p)
    if not p.prepared and chosen != "fla":
        raise LinattnError(f"this delta problem was prepared for fla's kernels (prepare_delta(backend=...)) and "
                           f"cannot run on backend {chosen!r}; prepare it without backend=")
    if p.prep is not None and chosen != "cpu":
        p = _prepared_rows(p)
    if chosen == "fla":
        o, S = fla_delta(p)
    elif chosen == "triton":
        o, S = triton_delta(p)
    elif chosen == "cpu":
        o, S = _run_cpu(p)
    else:
        # the forms compute in the prepared compute dtype (fp32 for half inputs): autocast must not take their
        # products back to bf16/fp16 (the CPU's triangular solve has no bf16 kernel; the states stay fp32)
        with torch.autocast(p.q.device.type, enabled=False):
            o, S = _run_torch(p)
    return o.to(p.out_dtype), (S if p.output_final_state else None)
