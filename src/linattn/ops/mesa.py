"""`mesa_net`: MesaNet (von Oswald et al. 2025; the seed's eq. 34-35), attention as the locally
optimal (regularised least-squares) fit of the values from the keys, renewed at every token.

Per head, with the statistics H_t `[K, K]` and G_t `[K, V]`,

    H_t = exp(g_t) H_{t-1} + beta_t k_t k_t^T,      G_t = exp(g_t) G_{t-1} + beta_t k_t v_t^T,
    o_t = scale * G_t^T (H_t + Diag(lam))^-1 q_t,

g a log-gate <= 0 `[B, T, H]` (None: no decay), beta >= 0 `[B, T, H]`, lam > 0 `[H, K]` (the ridge
that keeps H_t + Diag(lam) positive definite). The state is `MesaState(kk=H, kv=G)`.

Two solvers of (H_t + Diag(lam)) x_t = scale q_t, each in three forms (`mode`):

* solver="exact": a dense LU solve per token (`torch.linalg.solve_ex`): `recurrent` updates H, G token by
  token; `chunk` forms the chunk's H_t for its C tokens at once (C x K x K at a time) and solves them
  in one batched call; `parallel` is the chunk form with one chunk of T tokens. Exact to rounding; the
  reference form.
* solver="cg": Jacobi-preconditioned conjugate gradients, at most `max_iter` iterations per token,
  a token stops when ||r|| <= tol ||b||. The `chunk` form never materialises a per-token K x K matrix:
  inside a chunk, with Gam_t the gate's cumulative sum from the chunk start and H_0 the state at the
  chunk start (the only matrices kept: one K x K per chunk),

      (H_t + Diag(lam)) p_t = e^{Gam_t} H_0 p_t + sum_{i <= t} e^{Gam_t - Gam_i} beta_i k_i (k_i . p_t) + lam * p_t,

  applied to every token of every chunk at once (two [C, C] x [C, K] products and one [C, K] x [K, K]
  product per chunk and iteration; every exponent <= 0). The outputs then read G like linear attention
  with the solutions as queries: o_t = e^{Gam_t} G_0^T x_t + sum_{i <= t} e^{Gam_t - Gam_i} beta_i v_i (k_i . x_t).
  The `recurrent` form (decoding) runs the same iteration on the materialised state H_t.
  With the same max_iter and tol, the CG forms agree with each other to rounding (each token iterates
  on its own; a converged token is frozen, so no token's result depends on another's), and with
  solver="exact" to CG's convergence (see docs/results/test_time.md for the error against iterations).

Gradients. solver="exact": plain autograd through the solves. solver="cg": implicit differentiation,
not autograd through the iterations: for x = A^-1 b, the backward solves A y = dL/dx with the same CG
(A is symmetric), then dL/db = y and the gradient of every input of A (H_0 per chunk, keys, beta,
gates, lam) is that of -y^T A x, written out for one application of A (no autograd inside the backward,
so torch.compile traces it whole). Memory is that of one application (no per-iteration activations);
the gradient is exact for the solved system, so its error is that of the two CG solves. The chunk form
keeps one state per chunk for the backward, the recurrent form one K x K matrix per token (it is meant
for decoding). Double backward is not supported through solver="cg".

Numerics. H and G are always fp32 (fp64 for fp64 inputs), whatever the input dtype: with fp16
statistics H loses positive-definiteness (rounding, and overflow past 65504 on long sequences without
decay) and the solve produces NaN; fp16/bf16 inputs are tested at T = 4096. The preconditioner
diag(H_t) + lam > 0 and the starting guess x_0 = b / diag are those of the decoding step of FLA's
MesaNet; divisions by p^T A p and r^T z are guarded per token (a token whose residual is exactly 0 stops).

cu_seqlens (int64 `[N+1]`, B == 1) runs each packed sequence from its own initial state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch

from ..errors import LinattnError, LinattnTypeError
from ._common import (
    FLOAT_DTYPES,
    check_cu_seqlens,
    check_finite_output,
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
from .registry import randn, register_op, uniform, unit

SOLVERS = ("cg", "exact")
DEFAULT_TOL = {torch.float32: 1e-6, torch.float64: 1e-12}


class MesaState(NamedTuple):
    """The recurrent state of `mesa_net`, one row per sequence, fp32 (fp64 for fp64 inputs).

    Attributes:
        kk: `[N, H, K, K]`, H_t = sum_j decay * beta_j k_j k_j^T (symmetric positive semi-definite).
        kv: `[N, H, K, V]`, G_t = sum_j decay * beta_j k_j v_j^T.
    """
    kk: torch.Tensor
    kv: torch.Tensor


# ----------------------------------------------------------------------------------------------
# Conjugate gradients, batched over every leading dimension; implicit differentiation
# ----------------------------------------------------------------------------------------------

def _pcg(apply, b: torch.Tensor, diag: torch.Tensor, max_iter: int, tol: float, early_exit: bool) -> torch.Tensor:
    """Jacobi-preconditioned CG on A x = b for every vector b[..., :] at once (A symmetric positive
    definite, `apply(p)` -> A p, `diag` = diag(A) > 0). Each vector stops on its own when
    ||r|| <= tol ||b||, or when a division would be by a non-positive number; stopped vectors are frozen.
    `early_exit` (host reads allowed) ends the loop once every vector has stopped.

    CG squares its residuals (||r||^2 overflows fp32 for |b| > ~1e19, which stopped it at once with a
    wrong x), and x is linear in b: so each b is divided by a power of two s >= 1 near its
    largest entry, and x multiplied back. Powers of two scale exactly: where nothing overflowed, x has
    the same bits as without the scaling."""
    with torch.no_grad():
        s = torch.exp2(torch.floor(torch.log2(b.abs().amax(-1, keepdim=True))))
        s = torch.where(torch.isfinite(s) & (s > 1), s, torch.ones_like(s))
    return _pcg_unscaled(apply, b / s, diag, max_iter, tol, early_exit) * s


def _pcg_unscaled(apply, b: torch.Tensor, diag: torch.Tensor, max_iter: int, tol: float,
                  early_exit: bool) -> torch.Tensor:
    x = b / diag
    r = b - apply(x)
    thresh = (tol * tol) * (b * b).sum(-1)
    active = (r * r).sum(-1) > thresh
    z = r / diag
    p = z
    rz = (r * z).sum(-1)
    for _ in range(max_iter):
        if early_exit and not bool(active.any()):
            break
        Ap = apply(p)
        pAp = (p * Ap).sum(-1)
        ok = active & (pAp > 0) & (rz > 0)
        alpha = torch.where(ok, rz / torch.where(ok, pAp, torch.ones_like(pAp)), torch.zeros_like(pAp))
        x = torch.addcmul(x, alpha.unsqueeze(-1), p)
        r = torch.addcmul(r, alpha.unsqueeze(-1), Ap, value=-1.0)
        active = ok & ((r * r).sum(-1) > thresh)
        z = r / diag
        rz_new = (r * z).sum(-1)
        beta = torch.where(active, rz_new / torch.where(active, rz, torch.ones_like(rz)), torch.zeros_like(rz))
        p = torch.addcmul(z, beta.unsqueeze(-1), p)
        rz = rz_new
    return x


class _ChunkOperator:
    """A_t p_t for every token of every chunk: params (eG [.., C], H0 [.., K, K], k [.., C, K],
    D [.., C, C] = e^{Gam_t - Gam_i} beta_i (i <= t), lam [.., 1, K])."""

    @staticmethod
    def apply(params, p):
        eG, H0, k, D, lam = params
        return eG.unsqueeze(-1) * (p @ H0.transpose(-1, -2)) + ((p @ k.transpose(-1, -2)) * D) @ k + lam * p

    @staticmethod
    def diag(params):
        eG, H0, k, D, lam = params
        return eG.unsqueeze(-1) * torch.diagonal(H0, dim1=-2, dim2=-1).unsqueeze(-2) + D @ (k * k) + lam

    @staticmethod
    def vjp(params, x, u):
        """The gradient of u . (A(params) x) with respect to every param (written out: no autograd inside
        a backward, so torch.compile can trace it)."""
        eG, H0, k, D, lam = params
        xk, uk = x @ k.transpose(-1, -2), u @ k.transpose(-1, -2)             # [.., C, C]
        d_eG = (u * (x @ H0.transpose(-1, -2))).sum(-1)
        d_H0 = (u * eG.unsqueeze(-1)).transpose(-1, -2) @ x
        d_k = (uk * D).transpose(-1, -2) @ x + (xk * D).transpose(-1, -2) @ u
        return d_eG, d_H0, d_k, xk * uk, (u * x).sum_to_size(lam.shape)


class _StateOperator:
    """(H + Diag(lam)) p with the materialised state: params (H [.., K, K], lam [.., K])."""

    @staticmethod
    def apply(params, p):
        H, lam = params
        return (H @ p.unsqueeze(-1)).squeeze(-1) + lam * p

    @staticmethod
    def diag(params):
        H, lam = params
        return torch.diagonal(H, dim1=-2, dim2=-1) + lam

    @staticmethod
    def vjp(params, x, u):
        H, lam = params
        return u.unsqueeze(-1) * x.unsqueeze(-2), (u * x).sum_to_size(lam.shape)


class _CGSolve(torch.autograd.Function):
    """x = A(params)^-1 b by CG; backward by implicit differentiation (module docstring)."""

    @staticmethod
    def forward(ctx, op, max_iter, tol, early_exit, b, *params):
        with torch.no_grad():
            x = _pcg(lambda p: op.apply(params, p), b, op.diag(params), max_iter, tol, early_exit)
        ctx.op, ctx.opts = op, (max_iter, tol, early_exit)
        ctx.save_for_backward(x, *params)
        return x

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gx):
        x, *params = ctx.saved_tensors
        op, (max_iter, tol, early_exit) = ctx.op, ctx.opts
        y = _pcg(lambda p: op.apply(params, p), gx, op.diag(params), max_iter, tol, early_exit)
        need = ctx.needs_input_grad[5:]
        grads: List[Optional[torch.Tensor]] = [None] * len(params)
        if any(need):  # dL/dparam = -d(y . A x)/dparam
            grads = [d if n else None for d, n in zip(op.vjp(params, x, -y), need)]
        return (None, None, None, None, y if ctx.needs_input_grad[4] else None, *grads)


# ----------------------------------------------------------------------------------------------
# The forms. Layout [B, H, T, D]: q (scaled), k, v, b = beta [B, H, T], g [B, H, T] or None,
# lam [H, K], Hs [B, H, K, K], Gs [B, H, K, V]. Each returns (o [B, H, T, V], Hs, Gs).
# ----------------------------------------------------------------------------------------------

def _solve_exact(A: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """A x = rhs for rhs [..., K] (LU without the host-side error check: a singular A gives inf/NaN)."""
    return torch.linalg.solve_ex(A, rhs.unsqueeze(-1), check_errors=False)[0].squeeze(-1)


def _recurrent(q, k, v, b, g, lam, Hs, Gs, solver, max_iter, tol, early_exit):
    T = q.shape[2]
    lam_b = lam.unsqueeze(0)                                         # [1, H, K]
    gs = g.unbind(2) if g is not None else [None] * T
    outs = []
    for q_t, k_t, v_t, b_t, g_t in zip(q.unbind(2), k.unbind(2), v.unbind(2), b.unbind(2), gs):
        kb = (k_t * b_t.unsqueeze(-1)).unsqueeze(-1)                 # [B, H, K, 1]
        if g_t is not None:
            decay = torch.exp(g_t)[..., None, None]
            Hs, Gs = decay * Hs, decay * Gs
        Hs = Hs + kb * k_t.unsqueeze(-2)
        Gs = Gs + kb * v_t.unsqueeze(-2)
        if solver == "exact":
            x = _solve_exact(Hs + torch.diag_embed(lam_b.expand_as(q_t)), q_t)
        else:
            x = _CGSolve.apply(_StateOperator, max_iter, tol, early_exit, q_t, Hs, lam_b)
        outs.append(x.unsqueeze(-2) @ Gs)
    return torch.cat(outs, dim=2), Hs, Gs


def _chunk(q, k, v, b, g, lam, Hs, Gs, C, solver, max_iter, tol, early_exit):
    B, H, T, K = k.shape
    V = v.shape[-1]
    # padding tokens: beta = 0 (no write), g = 0 (no decay), q = 0 (x = 0): the state is unchanged
    q, k, v, b = (pad_time(x, C, dim=2) for x in (q, k, v, b))
    n = q.shape[2] // C
    BH = B * H

    def blocks(x):  # [B, H, n*C, *] -> [B*H, n, C, *]
        return x.reshape(BH, n, C, *x.shape[3:])

    qb, kb, vb, bb = blocks(q), blocks(k), blocks(v), blocks(b)
    if g is not None:
        Gam = blocks(pad_time(g, C, dim=2)).cumsum(-1)                # [BH, n, C], local to the chunk
    else:
        Gam = torch.zeros_like(bb)
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    D = torch.exp((Gam.unsqueeze(-1) - Gam.unsqueeze(-2)).masked_fill(~incl, float("-inf"))) * bb.unsqueeze(-2)
    eG = torch.exp(Gam)                                               # [BH, n, C]
    w_end = torch.exp(Gam[..., -1:] - Gam) * bb                       # each token's weight in the chunk's end state
    dec_end = torch.exp(Gam[..., -1])                                 # [BH, n]
    Hs, Gs = Hs.reshape(BH, K, K), Gs.reshape(BH, K, V)
    starts_H, starts_G = [], []
    for k_i, v_i, w_i, d_i in zip(kb.unbind(1), vb.unbind(1), w_end.unbind(1), dec_end.unbind(1)):
        starts_H.append(Hs)
        starts_G.append(Gs)
        kwT = (k_i * w_i.unsqueeze(-1)).transpose(-1, -2)             # [BH, K, C]
        d = d_i[:, None, None]
        Hs = torch.baddbmm(d * Hs, kwT, k_i)
        Gs = torch.baddbmm(d * Gs, kwT, v_i)
    H0, G0 = torch.stack(starts_H, dim=1), torch.stack(starts_G, dim=1)   # [BH, n, K, K], [BH, n, K, V]
    lam_b = lam.unsqueeze(0).expand(B, H, K).reshape(BH, 1, 1, K)
    if solver == "cg":
        x = _CGSolve.apply(_ChunkOperator, max_iter, tol, early_exit, qb, eG, H0, kb, D, lam_b)
    else:
        xs = []
        eye_lam = torch.diag_embed(lam_b.squeeze(1))                  # [BH, 1, K, K]
        # C x K x K at a time; per-chunk tensors by unbind (indexing gives each step a full-size backward)
        for eG_i, H0_i, D_i, kb_i, qb_i in zip(eG.unbind(1), H0.unbind(1), D.unbind(1), kb.unbind(1), qb.unbind(1)):
            A = (eG_i[:, :, None, None] * H0_i.unsqueeze(1)
                 + torch.einsum("bti,bid,bie->btde", D_i, kb_i, kb_i) + eye_lam)
            xs.append(_solve_exact(A, qb_i))
        x = torch.stack(xs, dim=1)
    o = eG.unsqueeze(-1) * (x @ G0) + ((x @ kb.transpose(-1, -2)) * D) @ vb
    o = o.reshape(B, H, n * C, V)[:, :, :T]
    return o, Hs.reshape(B, H, K, K), Gs.reshape(B, H, K, V)


# ----------------------------------------------------------------------------------------------
# Validate and prepare once
# ----------------------------------------------------------------------------------------------

@dataclass
class MesaProblem:
    """One validated `mesa_net` call in the compute dtype and the caller's layout [B, T, H, *]:
    q (scaled), k, v, beta [B, T, H], g [B, T, H] or None, lam [H, K], the initial state or None."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor
    g: Optional[torch.Tensor]
    lam: torch.Tensor
    state: Optional[MesaState]
    solver: str
    mode: str
    chunk_size: int
    max_iter: int
    tol: float
    offsets: Optional[List[int]]
    N: int
    output_final_state: bool
    out_dtype: torch.dtype

    def chunk_size_used(self, backend: str = "torch") -> int:
        if self.mode == "recurrent":
            return 1
        return self.q.shape[1] if self.mode == "parallel" else self.chunk_size


def _check_tensor(x, name: str, shape, layout: str, ref: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise LinattnTypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise LinattnTypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise LinattnError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(x.shape)}")
    check_same_device(x, name, ref)


def _check_state(state, N, H, K, V, device) -> None:
    if not isinstance(state, tuple) or len(state) != 2:
        raise LinattnTypeError(f"initial_state must be a MesaState(kk [N, H, K, K], kv [N, H, K, V]) as returned "
                               f"with output_final_state=True, got {type(state).__name__}")
    for name, x, shape in (("kk", state[0], (N, H, K, K)), ("kv", state[1], (N, H, K, V))):
        if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
            raise LinattnTypeError(f"initial_state.{name} must be a floating torch.Tensor, got "
                                   f"{getattr(x, 'dtype', type(x).__name__)}")
        if tuple(x.shape) != shape:
            raise LinattnError(f"initial_state.{name} must have shape {shape} (N = B, or the number of sequences "
                               f"in cu_seqlens), got {tuple(x.shape)}")
        if x.device != device:
            raise LinattnError(f"initial_state.{name} must be on the device of q ({device}), got {x.device}")


def _check_int(x, name: str, low: int) -> None:
    if not isinstance(x, int) or isinstance(x, bool) or x < low:
        raise LinattnError(f"{name} must be an int >= {low}, got {x!r}")


def prepare_mesa_net(q, k, v, beta, g, lam, *, solver: str = "cg", max_iter: int = 30, tol=None, scale=None,
                     mode: str = "chunk", chunk_size: int = 64, initial_state=None, output_final_state: bool = False,
                     cu_seqlens=None) -> MesaProblem:
    """Every check of `mesa_net`, once, and the conversion to the compute dtype."""
    B, T, H, K, V = check_qkv(q, k, v)
    check_mode(mode, chunk_size)
    if solver not in SOLVERS:
        raise LinattnError(f"solver must be one of {SOLVERS}, got {solver!r}")
    _check_int(max_iter, "max_iter", 0)
    cdt = compute_dtype(q.dtype)
    if tol is None:
        tol = DEFAULT_TOL[cdt]
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise LinattnError(f"tol must be a number >= 0 (the relative residual at which a token stops), got {tol!r}")
    _check_tensor(beta, "beta", (B, T, H), "[B, T, H]", q)
    if check_values(beta) and not bool((beta >= 0).all()):
        raise LinattnError("beta contains NaN" if torch.isnan(beta).any() else
                           f"beta must be >= 0 everywhere, got a minimum of {beta.min().item():.4g}")
    if g is not None:
        check_log_gate(g, "g", B, T, H, ref=q)
        if check_values(g) and not bool(torch.isfinite(g).all()):
            raise LinattnError("g must be finite (use a large negative value rather than -inf)")
    _check_tensor(lam, "lam", (H, K), "[H, K]", q)
    if check_values(lam) and not bool((lam > 0).all() and torch.isfinite(lam).all()):
        raise LinattnError(f"lam must be > 0 and finite everywhere (it keeps H_t + Diag(lam) positive definite), "
                           f"got a minimum of {lam.min().item():.4g}")
    if not isinstance(output_final_state, bool):
        raise LinattnTypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")
    scale = check_scale(scale, K ** -0.5)
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    N = B if offsets is None else len(offsets) - 1
    state = None
    if initial_state is not None:
        _check_state(initial_state, N, H, K, V, q.device)
        state = MesaState(initial_state[0].to(cdt), initial_state[1].to(cdt))
    return MesaProblem(q.to(cdt) * scale, k.to(cdt), v.to(cdt), beta.to(cdt), g.to(cdt) if g is not None else None,
                       lam.to(cdt), state, solver, mode, chunk_size, max_iter, float(tol), offsets, N,
                       output_final_state, q.dtype)


def run_mesa_net(p: MesaProblem) -> Tuple[torch.Tensor, Optional[MesaState]]:
    """Run a prepared call -> (o [B, T, H, V] in the input dtype, final MesaState or None)."""
    B, T, H, K = p.q.shape
    V = p.v.shape[-1]

    def bht(x):
        return x.transpose(1, 2).contiguous() if x is not None else None

    q, k, v, b, g = (bht(x) for x in (p.q, p.k, p.v, p.beta, p.g))
    if p.state is not None:
        H0, G0 = p.state
    else:
        H0 = q.new_zeros(p.N, H, K, K)
        G0 = q.new_zeros(p.N, H, K, V)
    early_exit = check_values(q)

    def run(q, k, v, b, g, Hs, Gs):
        if p.mode == "recurrent":
            return _recurrent(q, k, v, b, g, p.lam, Hs, Gs, p.solver, p.max_iter, p.tol, early_exit)
        return _chunk(q, k, v, b, g, p.lam, Hs, Gs, p.chunk_size_used(), p.solver, p.max_iter, p.tol, early_exit)

    if p.offsets is None:
        o, Hs, Gs = run(q, k, v, b, g, H0, G0)
    else:
        def one(i, sl):
            o_i, H_i, G_i = run(q[:, :, sl], k[:, :, sl], v[:, :, sl], b[:, :, sl],
                                g[:, :, sl] if g is not None else None, H0[i:i + 1], G0[i:i + 1])
            return o_i, (H_i, G_i)

        o, (Hs, Gs) = run_varlen(p.offsets, one, dim=2)
    # H_t sums squares of keys: it can overflow (to inf, which the solves turn into a finite 0) while o stays
    # finite, so the statistics are checked too
    return check_finite_output((o.transpose(1, 2).to(p.out_dtype), MesaState(Hs, Gs) if p.output_final_state else None),
                               "mesa_net", also=(Hs, Gs), **{"scale*q": p.q, "k": p.k, "v": p.v})


def mesa_net(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: Optional[torch.Tensor],
    lam: torch.Tensor, *,
    solver: str = "cg",
    max_iter: int = 30,
    tol: Optional[float] = None,
    scale: Optional[float] = None,
    mode: str = "chunk",
    chunk_size: int = 64,
    initial_state: Optional[MesaState] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[MesaState]]:
    """MesaNet: attention as the regularised least-squares fit of the values from the keys, at every token.

    H_t = exp(g_t) H_{t-1} + beta_t k_t k_t^T, G_t = exp(g_t) G_{t-1} + beta_t k_t v_t^T,
    o_t = scale * G_t^T (H_t + Diag(lam))^-1 q_t; scale=None means K**-0.5.

    Gradients: autograd ("exact"), implicit differentiation through the solve ("cg"); see the module
    docstring.

    Args:
        q: Queries `[B, T, H, K]`, any float dtype.
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]`.
        beta: Write strengths `[B, T, H]`, >= 0.
        g: A log-gate `[B, T, H]` (<= 0), or None (no decay).
        lam: The ridge `[H, K]` (> 0) that keeps H_t + Diag(lam) positive definite.
        solver: "cg" (conjugate gradients, at most `max_iter` iterations per token, a token stops at a
            relative residual `tol`) or "exact" (a dense solve per token).
        max_iter: CG's iteration cap per token.
        tol: CG's relative residual; None means 1e-6, or 1e-12 for fp64 inputs.
        scale: The query scale; None means K**-0.5.
        mode: The form: "chunk" (training; the CG chunk form never forms a per-token K x K matrix),
            "recurrent" (decoding), "parallel" (the chunk form with one chunk).
        chunk_size: The chunk length of the chunk form, in tokens.
        initial_state: A `MesaState` to start from, or None (zeros).
        output_final_state: Also return the state after the last token.
        cu_seqlens: int64 `[N+1]` offsets of N packed sequences (B == 1), each with its own state.

    Returns:
        o: The output `[B, T, H, V]`, in the input dtype.
        final_state: With output_final_state, `MesaState(kk [N, H, K, K], kv [N, H, K, V])`, fp32 (fp64 for
            fp64 inputs) for every input dtype, which round-trips between modes and calls (N = B, or the
            number of sequences in cu_seqlens); otherwise None.

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from linattn import mesa_net
        >>> B, T, H, K, V = 1, 10, 2, 8, 8
        >>> q, k = torch.randn(B, T, H, K), F.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> v, beta, g = torch.randn(B, T, H, V), torch.rand(B, T, H), -torch.rand(B, T, H)
        >>> lam = torch.ones(H, K)
        >>> o, state = mesa_net(q, k, v, beta, g, lam, output_final_state=True)
        >>> o.shape, state.kk.shape, state.kv.shape
        (torch.Size([1, 10, 2, 8]), torch.Size([1, 2, 8, 8]), torch.Size([1, 2, 8, 8]))
        >>> o_exact, _ = mesa_net(q, k, v, beta, g, lam, solver="exact")    # CG agrees to its tolerance
        >>> torch.allclose(o, o_exact, atol=1e-4)
        True
    """
    p = prepare_mesa_net(q, k, v, beta, g, lam, solver=solver, max_iter=max_iter, tol=tol, scale=scale,
                         mode=mode, chunk_size=chunk_size, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return run_mesa_net(p)


def _example(gen, B, T, H, K, V, dtype):
    """Unit q and k, beta in (0, 1), a decay, lam > 0, the exact solver (the registry's conformance tests)."""
    q, k, v = unit(gen, (B, T, H, K), dtype), unit(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, V), dtype)
    args = (q, k, v, uniform(gen, (B, T, H), dtype), uniform(gen, (B, T, H), dtype, -0.3, 0.0),
            uniform(gen, (H, K), dtype, 0.5, 1.5))
    return args, {"solver": "exact"}


def _reference(q, k, v, beta, g, lam, *, solver=None, scale=None):
    from .reference import mesa_net_ref
    return mesa_net_ref(q, k, v, beta, g, lam, scale=scale)


register_op("mesa_net", mesa_net, prepare=prepare_mesa_net, forms=("parallel", "chunk", "recurrent"),
            example=_example, reference=_reference, state=True,
            description="MesaNet: the ridge-regression read (H + Diag(lam))^-1 q per token, CG or exact solves")


__all__ = ["mesa_net", "MesaState", "prepare_mesa_net", "run_mesa_net", "MesaProblem", "SOLVERS"]
