"""The test-time-training family: `ttt` (TTT-Linear and TTT-MLP, Sun et al. 2024; the seed's eq. 11) and
`titans` (TTT with momentum and weight decay, Behrouz et al. 2025).

The state is the weights W of a small inner model, trained online on the pairs (k_t, v_t) by gradient
steps on the reconstruction loss, and read with the query:

    f(x; W) = x + LN(m(x; W))          (residual=True, the TTT paper's form; residual=False: LN(m(x; W)))
    m(x; W) = x W + b                  inner="linear": W = (W [K, V], b [V])
    m(x; W) = gelu(x W1 + b1) W2 + b2   inner="mlp":    W = (W1 [K, Dh], b1 [Dh], W2 [Dh, V], b2 [V])
    LN(z)   = ln_weight * (z - mean(z)) / sqrt(var(z) + eps) + ln_bias   (over V; ln_weight/ln_bias [H, V] are
                                         outer parameters, never updated by the inner loop; None: 1 and 0)
    l(W; k, v) = 1/2 ||f(k; W) - v||^2,     o_t = f(W_t; scale * q_t)  (scale=None means K**-0.5).

gelu is the exact (erf) GELU. residual=True needs K == V.

Mini-batch TTT (the "dual form" of the TTT paper). The tokens are cut into mini-batches of `mini_batch`
tokens; every gradient in a mini-batch is taken at the weights W_0 the mini-batch started from, and
token t reads the weights updated by the tokens s <= t of its mini-batch:

    ttt:     W_t = W_{t-1} - eta_t u_t,                      u_t = grad_W l(W_0; k_t, v_t)
    titans:  S_t = eta_t S_{t-1} - theta_t u_t,  W_t = (1 - alpha_t) W_{t-1} + S_t

(the momentum S carries across mini-batches; W_0 <- W_t at the end of every mini-batch). Per token:
eta `[B, T, H]` >= 0 (ttt's learning rate), and for titans theta >= 0 (learning rate), alpha in [0, 1]
(weight decay), eta in [0, 1] (momentum), all `[B, T, H]`. With alpha = eta = 0, titans is ttt with
eta = theta. mini_batch=1 is plain online gradient descent (eq. 11).

Conventions of other implementations, in these terms (u_s = grad l(W_0; k_s, v_s), t and s counted from
1 inside a mini-batch, z_t = m(scale q_t; W_t) the inner model's output before its LayerNorm):

* Here the rate belongs to the writing token: every reader t >= s sees u_s with the same factor eta_s,
  W_t = W_0 - sum_{s<=t} eta_s u_s, and o_t = scale q_t + LN(z_t) (residual=True, the paper's f(x)).
* The TTT paper's code averages inside a mini-batch: W_t = W_0 - (1/t) sum_{s<=t} eta_s u_s. The 1/t
  belongs to the reading position t, not to the writing token s (reader t sees u_s with eta_s / t, a
  later reader with less), so no choice of per-token rates eta_s reproduces it; it is not implemented.
  mini_batch=1 has t = 1 and matches it.
* flash-linear-attention's TTT reads the rate at the reading token: W_t = W_0 - eta_t sum_{s<=t} u_s,
  and a mini-batch ends with the rate of its last token; it returns z_t + LN(z_t). Where eta is
  constant inside every mini-batch (one value per mini-batch, or a constant), its W_t is ours with the
  same eta, and its output is ours with residual=True once scale q_t is replaced by z_t; otherwise
  neither convention can express the other (its 1/t-free rate also differs from the paper's average).

Forms (`mode`):

* "chunk" (training): one mini-batch at a time, everything inside it batched (the dual form): the
  gradients of all its tokens at W_0 in closed form (the LayerNorm's backward written out), then
  every query's output without forming a per-token W_t: with u_s = (k_s^T gz_s, gz_s) for the linear
  model, x_t W_t + b_t = A_t (x_t W_prev + b_prev) + B_t (x_t S_W + S_b) - sum_{s<=t} M_ts (x_t . k_s + 1) gz_s,
  where A_t, B_t and M_ts are the products of (1 - alpha), eta, theta the recurrences give (for ttt:
  A = 1, B = 0, M_ts = eta_s); the MLP applies this layer by layer (its second layer with the hidden
  activations at W_0 in place of the keys). Only the weights at each mini-batch end are kept.
* "recurrent" (decoding): token by token, the gradient at W_0 and the update of the current weights
  (the primal form). Constant memory.

There is no "parallel" form: the weights at a mini-batch end depend nonlinearly on the previous ones.
Both forms are tested against a token-by-token fp64 loop that takes the inner gradients by autograd
(`ops.reference.ttt_ref`).

State (`TTTState`): the weights at the start of the current mini-batch (the gradient point), the
current weights, Titans' momentum, and how many tokens of the current mini-batch were consumed (per
sequence). A call may end inside a mini-batch; the next call (any mode) continues it, so prefill +
token-by-token decoding equals one long call exactly, in constant memory (no buffered tokens: token t's
update needs only W_0 and the running weights). `initial_state` is a `TTTState`, or just the initial
inner weights `(W, b)` / `(W1, b1, W2, b2)`, each `[H, ...]` (shared by every sequence: a layer's
learnable initial weights) or `[N, H, ...]`; None means zeros (linear only: a zero MLP has no gradient).
Weights are fp32 (fp64 for fp64 inputs).

Gradients: plain autograd in both forms (outer gradients flow through the inner gradients, i.e. second
order through LN and GELU); the chunk form keeps O(T/mini_batch) weight copies and O(T * mini_batch)
intermediates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..errors import LinattnError, LinattnTypeError
from ._common import (
    FLOAT_DTYPES,
    check_cu_seqlens,
    check_finite_output,
    check_qkv,
    check_same_device,
    check_scale,
    check_values,
    compute_dtype,
    run_varlen,
)
from .registry import randn, register_op, uniform

INNER = ("linear", "mlp")
TTT_MODES = ("chunk", "recurrent")
_SQRT1_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


class TTTState(NamedTuple):
    """The recurrent state of `ttt` / `titans` (module docstring).

    Tensors `[N, H, ...]`, fp32 (fp64 for fp64 inputs); N = B, or the number of sequences in cu_seqlens.

    Attributes:
        start: Inner weights at the start of the current mini-batch (where gradients are taken).
        current: Inner weights after the last token.
        momentum: Titans' S, shaped like the weights (None for ttt).
        position: Per sequence, the tokens of the current mini-batch already consumed (0 .. mini_batch-1).
    """
    start: Tuple[torch.Tensor, ...]
    current: Tuple[torch.Tensor, ...]
    momentum: Optional[Tuple[torch.Tensor, ...]]
    position: Tuple[int, ...]


# ----------------------------------------------------------------------------------------------
# The inner model. Layout [R, L, D] (R = rows: sequences x heads); weights [R, ...]; ln [R, 1, V].
# ----------------------------------------------------------------------------------------------

def _gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x * _SQRT1_2))


def _gelu_grad(x):
    return 0.5 * (1.0 + torch.erf(x * _SQRT1_2)) + x * torch.exp(-0.5 * x * x) * _INV_SQRT_2PI


def _ln(z, w, b, eps):
    """(LN(z), z_hat, 1/sigma).

    LN is scale-invariant, but its variance squares z and overflows for |z| > ~1e19 in fp32, which turned
    a finite LN(z) into 0 or NaN. So each row is divided by a power of two s >= 1 near its
    largest |z| first: LN(z) = (z/s - mean) / sqrt(var(z/s) + eps/s^2). Dividing by a power of two is
    exact, so for every row where nothing overflows the results have the same bits as without it. s is a
    constant for autograd (LN does not depend on it)."""
    with torch.no_grad():
        amax = z.abs().amax(-1, keepdim=True)
        s = torch.exp2(torch.floor(torch.log2(amax)))
        s = torch.where(torch.isfinite(s) & (s > 1), s, torch.ones_like(s))
    zs = z / s
    zc = zs - zs.mean(-1, keepdim=True)
    var = (zc * zc).mean(-1, keepdim=True)
    # a row of equal values has var = 0 and 1/sigma = eps^-1/2, where eps / s^2 may have underflowed to 0:
    # that case is taken apart (and kept finite in the branch not taken, so that no NaN reaches a gradient)
    flat = var > 0
    rstd_s = torch.rsqrt(torch.where(flat, var, torch.ones_like(var)) + eps / (s * s))
    zhat = torch.where(flat, zc * rstd_s, zc * (s * eps ** -0.5))
    rstd = torch.where(flat, rstd_s / s, torch.full_like(var, eps ** -0.5))   # 1/sigma of z itself
    return zhat * w + b, zhat, rstd


def _ln_loss_grad(z, x, target, w, b, eps, residual):
    """dl/dz of l = 1/2 ||[x +] LN(z) - target||^2, the LayerNorm's backward written out."""
    y, zhat, rstd = _ln(z, w, b, eps)
    e = y - target + x if residual else y - target
    gh = e * w
    return (gh - gh.mean(-1, keepdim=True) - zhat * (gh * zhat).mean(-1, keepdim=True)) * rstd


def _grads_at(W0, x, target, ln, eps, residual):
    """The factors of every token's gradient at W0: linear -> [(x, gz)], mlp -> [(x, gz1), (h, gz2)]: for each
    layer, u_W(s) = a_s^T g_s and u_b(s) = g_s."""
    if len(W0) == 2:
        W, b = W0
        z = torch.baddbmm(b.unsqueeze(1), x, W)
        return [(x, _ln_loss_grad(z, x, target, *ln, eps, residual))]
    W1, b1, W2, b2 = W0
    z1 = torch.baddbmm(b1.unsqueeze(1), x, W1)
    h = _gelu(z1)
    z2 = torch.baddbmm(b2.unsqueeze(1), h, W2)
    g2 = _ln_loss_grad(z2, x, target, *ln, eps, residual)
    g1 = (g2 @ W2.transpose(-1, -2)) * _gelu_grad(z1)
    return [(x, g1), (h, g2)]


def _read(z, x, ln, eps, residual):
    y = _ln(z, *ln, eps)[0]
    return x + y if residual else y


# ----------------------------------------------------------------------------------------------
# The forms. Rows R = N*H; q (scaled), k [R, T, K], v [R, T, V], rates [R, T]; weights tuples [R, ...].
# Each returns (o [R, T, V], start, current, momentum, position).
# ----------------------------------------------------------------------------------------------

def _recurrent(q, k, v, lr, alpha, mom, start, current, S, pos, mb, ln, eps, residual):
    outs = []
    T = q.shape[1]
    for t in range(T):
        x_t, q_t = k[:, t:t + 1], q[:, t:t + 1]
        factors = _grads_at(start, x_t, v[:, t:t + 1], ln, eps, residual)
        u = []
        for a, gz in factors:  # W: a^T g, b: g
            u += [a.transpose(-1, -2) @ gz, gz.squeeze(1)]
        th = lr[:, t]
        if S is None:
            current = tuple(w - _bc(th, w) * du for w, du in zip(current, u))
        else:
            S = tuple(_bc(mom[:, t], s) * s - _bc(th, s) * du for s, du in zip(S, u))
            current = tuple(_bc(1 - alpha[:, t], w) * w + s for w, s in zip(current, S))
        outs.append(_read(_apply(current, q_t), q_t, ln, eps, residual))
        pos += 1
        if pos == mb:
            start, pos = current, 0
    return torch.cat(outs, dim=1), start, current, S, pos


def _bc(c, w):
    """A per-row coefficient [R] shaped to scale w [R, ...]."""
    return c.reshape(c.shape[0], *([1] * (w.dim() - 1)))


def _apply(W, x):
    """m(x; W) for x [R, L, K]."""
    if len(W) == 2:
        return torch.baddbmm(W[1].unsqueeze(1), x, W[0])
    h = _gelu(torch.baddbmm(W[1].unsqueeze(1), x, W[0]))
    return torch.baddbmm(W[3].unsqueeze(1), h, W[2])


def _lower_products(x):
    """P[.., t, r] = prod_{j = r+1 .. t} x_j for r <= t, 0 above the diagonal (x [.., L])."""
    L = x.shape[-1]
    later = torch.ones(L, L, dtype=torch.bool, device=x.device).tril(-1)   # t > r
    X = torch.where(later, x.unsqueeze(-1), torch.ones_like(x).unsqueeze(-1))
    return torch.cumprod(X, dim=-2).tril()


def _segment(q, k, v, lr, alpha, mom, start, prev, S, ln, eps, residual):
    """One (piece of a) mini-batch in the dual form: tokens [R, L, *], gradients at `start`, the
    recurrence from `prev` (and momentum S) -> (o [R, L, V], weights after the segment, momentum)."""
    L = q.shape[1]
    factors = _grads_at(start, k, v, ln, eps, residual)
    if S is None:
        M = torch.ones(L, L, dtype=q.dtype, device=q.device).tril() * lr.unsqueeze(-2)   # M_ts = eta_s
        A = Bc = None
    else:
        La = _lower_products(1 - alpha)                                  # prod_{r<j<=t} (1 - alpha_j)
        Le = _lower_products(mom)                                        # prod_{s<j<=r} eta_j
        e_eta = torch.cumprod(mom, dim=-1)                               # prod_{j<=r} eta_j
        A = torch.cumprod(1 - alpha, dim=-1)                             # prod_{j<=t} (1 - alpha_j)
        Bc = (La @ e_eta.unsqueeze(-1)).squeeze(-1)                      # sum_r La[t, r] e_eta[r]
        M = (La @ Le) * lr.unsqueeze(-2)
        c_end = Le[:, -1] * lr                                           # momentum end weights
    last = M[:, -1]                                                      # [R, L]
    x = q
    new_prev, new_S = [], []
    layers = [(0, 1), (2, 3)][:len(factors)]
    for li, ((a, gz), (iw, ib)) in enumerate(zip(factors, layers)):
        W, b = prev[iw], prev[ib]
        z = torch.baddbmm(b.unsqueeze(1), x, W)
        if S is not None:
            z = A.unsqueeze(-1) * z + Bc.unsqueeze(-1) * torch.baddbmm(S[ib].unsqueeze(1), x, S[iw])
        attn = (torch.baddbmm(torch.ones_like(M), x, a.transpose(-1, -2))) * M    # (x_t . a_s + 1) M_ts
        z = z - attn @ gz
        # the weights at the segment's end
        dW = a.transpose(-1, -2) @ (gz * last.unsqueeze(-1))
        db = (gz * last.unsqueeze(-1)).sum(1)
        if S is None:
            new_prev += [W - dW, b - db]
        else:
            aL, bL = A[:, -1], Bc[:, -1]
            new_prev += [_bc(aL, W) * W + _bc(bL, W) * S[iw] - dW, _bc(aL, b) * b + _bc(bL, b) * S[ib] - db]
            eL = e_eta[:, -1]
            gc = gz * c_end.unsqueeze(-1)
            new_S += [_bc(eL, W) * S[iw] - a.transpose(-1, -2) @ gc, _bc(eL, b) * S[ib] - gc.sum(1)]
        if li + 1 < len(factors):
            x = _gelu(z)
    o = _read(z, q, ln, eps, residual)
    return o, tuple(new_prev), (tuple(new_S) if S is not None else None)


def _chunk(q, k, v, lr, alpha, mom, start, current, S, pos, mb, ln, eps, residual):
    T = q.shape[1]
    lengths, t, p = [], 0, pos   # the segments: the rest of the open mini-batch, then whole ones
    while t < T:
        lengths.append(min(mb - p, T - t))
        t, p = t + lengths[-1], (p + lengths[-1]) % mb
    # one split per input (not a slice per segment: each slice's backward would write a full-size
    # gradient, O(T^2 / mb) memory traffic in all)
    pieces = [x.split(lengths, dim=1) if x is not None else [None] * len(lengths)
              for x in (q, k, v, lr, alpha, mom)]
    outs = []
    for L, (q_i, k_i, v_i, lr_i, alpha_i, mom_i) in zip(lengths, zip(*pieces)):
        o, current, S = _segment(q_i, k_i, v_i, lr_i, alpha_i, mom_i, start, current, S, ln, eps, residual)
        outs.append(o)
        pos += L
        if pos == mb:
            start, pos = current, 0
    return torch.cat(outs, dim=1), start, current, S, pos


# ----------------------------------------------------------------------------------------------
# Validate and prepare once
# ----------------------------------------------------------------------------------------------

@dataclass
class TTTProblem:
    """One validated `ttt` / `titans` call in the compute dtype, layout [B, T, H, *]: q (scaled), k, v,
    lr (eta for ttt, theta for titans), alpha and momentum (titans) [B, T, H]; the initial state with
    weights [N, H, ...]; ln (weight, bias) [H, V]."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    lr: torch.Tensor
    alpha: Optional[torch.Tensor]
    momentum: Optional[torch.Tensor]
    state: TTTState
    ln: Tuple[torch.Tensor, torch.Tensor]
    inner: str
    residual: bool
    eps: float
    mini_batch: int
    mode: str
    offsets: Optional[List[int]]
    N: int
    output_final_state: bool
    out_dtype: torch.dtype

    def chunk_size_used(self, backend: str = "torch") -> int:
        return 1 if self.mode == "recurrent" else self.mini_batch


def _check_rate(x, name: str, B, T, H, ref, upper: Optional[float]) -> None:
    layout = "[B, T, H]"
    if not isinstance(x, torch.Tensor):
        raise LinattnTypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise LinattnTypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if tuple(x.shape) != (B, T, H):
        raise LinattnError(f"{name} must have shape {layout} = {(B, T, H)}, got {tuple(x.shape)}")
    check_same_device(x, name, ref)
    if check_values(x):
        ok = (x >= 0).all() if upper is None else ((x >= 0) & (x <= upper)).all()
        if not bool(ok):
            if torch.isnan(x).any():
                raise LinattnError(f"{name} contains NaN")
            rng = ">= 0" if upper is None else f"in [0, {upper:g}]"
            raise LinattnError(f"{name} must be {rng} everywhere, got values in "
                               f"[{x.min().item():.4g}, {x.max().item():.4g}]")
        if upper is None and not bool(torch.isfinite(x).all()):
            raise LinattnError(f"{name} must be finite")


def _weight_shapes(inner: str, K: int, V: int, Dh: Optional[int]) -> List[Tuple[str, Tuple[int, ...]]]:
    if inner == "linear":
        return [("W", (K, V)), ("b", (V,))]
    return [("W1", (K, Dh)), ("b1", (Dh,)), ("W2", (Dh, V)), ("b2", (V,))]


def _as_weights(ws, what: str, inner: str, N, H, K, V, device, cdt) -> Tuple[torch.Tensor, ...]:
    n_expected = 2 if inner == "linear" else 4
    names = "(W, b)" if inner == "linear" else "(W1, b1, W2, b2)"
    if not isinstance(ws, (tuple, list)) or len(ws) != n_expected or \
            not all(isinstance(w, torch.Tensor) for w in ws):
        raise LinattnTypeError(f"{what} must be a tuple of {n_expected} tensors {names} for inner={inner!r}, "
                               f"got {type(ws).__name__}" + (f" of length {len(ws)}" if isinstance(ws, (tuple, list))
                                                             else ""))
    Dh = ws[0].shape[-1] if inner == "mlp" else None
    out = []
    for (name, shape), w in zip(_weight_shapes(inner, K, V, Dh), ws):
        if w.dtype not in FLOAT_DTYPES:
            raise LinattnTypeError(f"{what}: {name} must be a floating tensor, got {w.dtype}")
        if tuple(w.shape) == (H, *shape):
            w = w.unsqueeze(0).expand(N, H, *shape)
        elif tuple(w.shape) != (N, H, *shape):
            raise LinattnError(f"{what}: {name} must have shape [H, ...] = {(H, *shape)} or [N, H, ...] = "
                               f"{(N, H, *shape)} (N = B, or the number of sequences in cu_seqlens), "
                               f"got {tuple(w.shape)}")
        if w.device != device:
            raise LinattnError(f"{what}: {name} must be on the device of q ({device}), got {w.device}")
        out.append(w.to(cdt))
    return tuple(out)


def _prepare_state(initial_state, inner, titans, mb, N, H, K, V, device, cdt) -> TTTState:
    if initial_state is None:
        if inner == "mlp":
            raise LinattnError("inner='mlp' needs initial_state: the initial weights (W1, b1, W2, b2) (with zero "
                               "weights the inner MLP has no gradient and never learns)")
        w = (torch.zeros(N, H, K, V, dtype=cdt, device=device), torch.zeros(N, H, V, dtype=cdt, device=device))
        mom = tuple(torch.zeros_like(x) for x in w) if titans else None
        return TTTState(w, w, mom, (0,) * N)
    if isinstance(initial_state, TTTState):
        start = _as_weights(initial_state.start, "initial_state.start", inner, N, H, K, V, device, cdt)
        current = _as_weights(initial_state.current, "initial_state.current", inner, N, H, K, V, device, cdt)
        pos = initial_state.position
        if not isinstance(pos, tuple) or len(pos) != N or \
                not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < mb for i in pos):
            raise LinattnError(f"initial_state.position must be a tuple of N = {N} ints in [0, mini_batch) = "
                               f"[0, {mb}), got {pos!r} (a state from a call with another mini_batch?)")
        if titans:
            if initial_state.momentum is None:
                mom = tuple(torch.zeros_like(x) for x in current)
            else:
                mom = _as_weights(initial_state.momentum, "initial_state.momentum", inner, N, H, K, V, device, cdt)
        else:
            if initial_state.momentum is not None:
                raise LinattnError("initial_state has a momentum (a titans state); ttt takes none")
            mom = None
        return TTTState(start, current, mom, pos)
    w = _as_weights(initial_state, "initial_state", inner, N, H, K, V, device, cdt)
    mom = tuple(torch.zeros_like(x) for x in w) if titans else None
    return TTTState(w, w, mom, (0,) * N)


def prepare_ttt(q, k, v, lr, alpha=None, momentum=None, *, inner: str = "linear", mini_batch: int = 16,
                ln_weight=None, ln_bias=None, residual: bool = True, scale=None, eps: float = 1e-6,
                mode: str = "chunk", initial_state=None, output_final_state: bool = False,
                cu_seqlens=None, lr_name: str = "eta") -> TTTProblem:
    """Every check of `ttt` / `titans` (titans: alpha and momentum given), once."""
    B, T, H, K, V = check_qkv(q, k, v)
    titans = alpha is not None
    if mode not in TTT_MODES:
        extra = (" (there is no 'parallel' form: each mini-batch starts from the weights the previous one "
                 "ended with)") if mode == "parallel" else ""
        raise LinattnError(f"mode must be one of {TTT_MODES}, got {mode!r}{extra}")
    if inner not in INNER:
        raise LinattnError(f"inner must be one of {INNER}, got {inner!r}")
    if not isinstance(mini_batch, int) or isinstance(mini_batch, bool) or mini_batch < 1:
        raise LinattnError(f"mini_batch must be a positive int, got {mini_batch!r}")
    for name, flag in (("residual", residual), ("output_final_state", output_final_state)):
        if not isinstance(flag, bool):
            raise LinattnTypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if V == 0:  # LN(z) normalises over the V features: a mean and variance of nothing
        raise LinattnError(f"v must have shape [B, T, H, V] with V >= 1 (the LayerNorm is over V), "
                           f"got {tuple(v.shape)}")
    if residual and K != V:
        raise LinattnError(f"residual=True (f(x) = x + LN(m(x))) needs K == V, got K = {K}, V = {V}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise LinattnError(f"eps must be a number > 0, got {eps!r}")
    _check_rate(lr, lr_name, B, T, H, q, None)
    if titans:
        _check_rate(alpha, "alpha", B, T, H, q, 1.0)
        _check_rate(momentum, "eta", B, T, H, q, 1.0)
    scale = check_scale(scale, K ** -0.5)
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    N = B if offsets is None else len(offsets) - 1
    cdt = compute_dtype(q.dtype)
    ln = []
    for name, x, fill in (("ln_weight", ln_weight, 1.0), ("ln_bias", ln_bias, 0.0)):
        if x is None:
            ln.append(torch.full((H, V), fill, dtype=cdt, device=q.device))
            continue
        if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
            raise LinattnTypeError(f"{name} must be a floating torch.Tensor [H, V] or None, got "
                                   f"{getattr(x, 'dtype', type(x).__name__)}")
        if tuple(x.shape) != (H, V):
            raise LinattnError(f"{name} must have shape [H, V] = {(H, V)}, got {tuple(x.shape)}")
        check_same_device(x, name, q)
        ln.append(x.to(cdt))
    state = _prepare_state(initial_state, inner, titans, mini_batch, N, H, K, V, q.device, cdt)

    def c(x):
        return x.to(cdt) if x is not None else None

    return TTTProblem(q.to(cdt) * scale, k.to(cdt), v.to(cdt), lr.to(cdt), c(alpha), c(momentum), state,
                      (ln[0], ln[1]), inner, residual, float(eps), mini_batch, mode, offsets, N,
                      output_final_state, q.dtype)


def _empty_run(p: TTTProblem) -> Tuple[torch.Tensor, Optional[TTTState]]:
    """`run_ttt` for B = 0 or H = 0: every weight tensor is empty, so only the positions advance. The
    output is joined to the inputs' graph (a sum over nothing is 0) so that backward works as elsewhere."""
    B, T, H, _ = p.q.shape
    link = p.q.sum() + p.k.sum() + p.v.sum() + p.lr.sum()
    o = (p.q.new_zeros(B, T, H, p.v.shape[-1]) + 0 * link).to(p.out_dtype)
    if not p.output_final_state:
        return o, None
    lengths = [T] * p.N if p.offsets is None else [b - a for a, b in zip(p.offsets[:-1], p.offsets[1:])]
    pos = tuple((s + n) % p.mini_batch for s, n in zip(p.state.position, lengths))
    return o, TTTState(p.state.start, p.state.current, p.state.momentum, pos)


def run_ttt(p: TTTProblem) -> Tuple[torch.Tensor, Optional[TTTState]]:
    """Run a prepared call -> (o [B, T, H, V] in the input dtype, final TTTState or None)."""
    B, T, H, K = p.q.shape
    V = p.v.shape[-1]
    form = _chunk if p.mode == "chunk" else _recurrent
    if B * H == 0:  # no row to train or read: an empty output, and the state only moves on
        return _empty_run(p)

    def rows(x):  # [b, t, H, *] -> [b*H, t, *]
        return x.transpose(1, 2).reshape(x.shape[0] * H, x.shape[1], *x.shape[3:]) if x is not None else None

    def wrows(ws, sl):  # weights [N, H, ...] -> [n*H, ...]
        return tuple(w[sl].reshape(-1, *w.shape[2:]) for w in ws) if ws is not None else None

    def run_group(sl_n: slice, sl_t: slice, b_sl: slice):
        """sequences sl_n (state rows), tokens sl_t of batch rows b_sl; all at one position."""
        n = len(range(*sl_n.indices(p.N)))
        ln = tuple(x.unsqueeze(0).expand(n, H, V).reshape(n * H, 1, V) for x in p.ln)
        st = p.state
        pos = st.position[sl_n.start]
        o, start, current, S, pos = form(
            rows(p.q[b_sl, sl_t]), rows(p.k[b_sl, sl_t]), rows(p.v[b_sl, sl_t]), rows(p.lr[b_sl, sl_t]),
            rows(p.alpha[b_sl, sl_t] if p.alpha is not None else None),
            rows(p.momentum[b_sl, sl_t] if p.momentum is not None else None),
            wrows(st.start, sl_n), wrows(st.current, sl_n), wrows(st.momentum, sl_n), pos, p.mini_batch,
            ln, p.eps, p.residual)
        o = o.reshape(-1, H, o.shape[1], V).transpose(1, 2)

        def unrows(ws):
            return tuple(w.reshape(n, H, *w.shape[1:]) for w in ws) if ws is not None else None

        return o, (unrows(start), unrows(current), unrows(S), (pos,) * n)

    if p.offsets is not None:  # states: one per sequence, as they come
        o, states = run_varlen(p.offsets, lambda i, s: run_group(slice(i, i + 1), s, slice(0, 1)), list)
    elif len(set(p.state.position)) == 1:
        o, state = run_group(slice(0, p.N), slice(0, T), slice(0, B))
        states = [state]
    else:  # rows at different positions inside their mini-batch: one at a time
        groups = [run_group(slice(i, i + 1), slice(0, T), slice(i, i + 1)) for i in range(B)]
        o, states = torch.cat([g[0] for g in groups], dim=0), [g[1] for g in groups]
    if not p.output_final_state:
        return o.to(p.out_dtype), None

    def cat(j):
        if states[0][j] is None:
            return None
        return tuple(torch.cat([s[j][w] for s in states]) for w in range(len(states[0][j])))

    state = TTTState(cat(0), cat(1), cat(2), tuple(i for s in states for i in s[3]))
    return o.to(p.out_dtype), state


def ttt(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, eta: torch.Tensor, *,
    inner: str = "linear",
    mini_batch: int = 16,
    ln_weight: Optional[torch.Tensor] = None,
    ln_bias: Optional[torch.Tensor] = None,
    residual: bool = True,
    scale: Optional[float] = None,
    eps: float = 1e-6,
    mode: str = "chunk",
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[TTTState]]:
    """TTT-Linear / TTT-MLP: a small inner model trained online on (k_t, v_t), read with the query.

    Mini-batch gradient descent on l = 1/2 ||[k +] LN(m(k; W)) - v||^2, every gradient of a mini-batch
    taken at its start weights; o_t = [scale q_t +] LN(m(scale q_t; W_t)) (module docstring).

    Args:
        q: Queries `[B, T, H, K]`, any float dtype.
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]` (residual=True needs K == V).
        eta: The inner learning rate per token `[B, T, H]`, >= 0.
        inner: "linear" (m = x W + b) or "mlp" (m = gelu(x W1 + b1) W2 + b2).
        mini_batch: Tokens per mini-batch (every gradient of a mini-batch is taken at its start weights);
            1 is plain online gradient descent.
        ln_weight: The inner LayerNorm's weight `[H, V]` (an outer parameter; None: 1).
        ln_bias: The inner LayerNorm's bias `[H, V]` (None: 0).
        residual: f(x) = x + LN(m(x; W)) (the TTT paper's form); False: LN(m(x; W)).
        scale: The query scale; None means K**-0.5.
        eps: The inner LayerNorm's epsilon.
        mode: "chunk" (the dual form, training) or "recurrent" (token by token, decoding); both continue a
            mini-batch a previous call ended inside. There is no "parallel" form.
        initial_state (TTTState | tuple | None): A `TTTState`, or the initial weights `(W, b)` /
            `(W1, b1, W2, b2)` as `[H, ...]` or `[N, H, ...]` (None: zeros, linear only).
        output_final_state: Also return the state after the last token.
        cu_seqlens: int64 `[N+1]` offsets of N packed sequences (B == 1), each with its own state.

    Returns:
        o: The output `[B, T, H, V]`, in the input dtype.
        final_state: With output_final_state, a `TTTState` (tensors `[N, H, ...]`, fp32, fp64 for fp64
            inputs); otherwise None.

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> from linattn import ttt
        >>> B, T, H, K = 1, 20, 2, 8
        >>> q, k, v = torch.randn(3, B, T, H, K).unbind(0)
        >>> eta = torch.full((B, T, H), 0.1)
        >>> o, state = ttt(q, k, v, eta, mini_batch=8, output_final_state=True)
        >>> o.shape, state.position       # 20 = 2 * 8 + 4: 4 tokens into the third mini-batch
        (torch.Size([1, 20, 2, 8]), (4,))
        >>> o_rec, _ = ttt(q, k, v, eta, mini_batch=8, mode="recurrent")
        >>> torch.allclose(o, o_rec, atol=1e-5)
        True
    """
    p = prepare_ttt(q, k, v, eta, inner=inner, mini_batch=mini_batch, ln_weight=ln_weight, ln_bias=ln_bias,
                    residual=residual, scale=scale, eps=eps, mode=mode, initial_state=initial_state,
                    output_final_state=output_final_state, cu_seqlens=cu_seqlens, lr_name="eta")
    return check_finite_output(run_ttt(p), "ttt", q=q, k=k, v=v)


def titans(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: torch.Tensor, alpha: torch.Tensor,
    eta: torch.Tensor, *,
    inner: str = "linear",
    mini_batch: int = 16,
    ln_weight: Optional[torch.Tensor] = None,
    ln_bias: Optional[torch.Tensor] = None,
    residual: bool = True,
    scale: Optional[float] = None,
    eps: float = 1e-6,
    mode: str = "chunk",
    initial_state=None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[TTTState]]:
    """Titans' neural memory: TTT with momentum and weight decay.

    theta (learning rate, >= 0), alpha (weight decay, in [0, 1]) and eta (momentum, in [0, 1]), all `[B, T, H]`:

        S_t = eta_t S_{t-1} - theta_t grad l(W_0; k_t, v_t),   W_t = (1 - alpha_t) W_{t-1} + S_t,

    W_0 the weights at the start of the token's mini-batch; everything else as `ttt` (the state also
    carries S). alpha = eta = 0 gives ttt with eta = theta.

    Args:
        q: Queries `[B, T, H, K]`, any float dtype.
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]` (residual=True needs K == V).
        theta: The learning rate per token `[B, T, H]`, >= 0.
        alpha: The weight decay per token `[B, T, H]`, in [0, 1].
        eta: The momentum per token `[B, T, H]`, in [0, 1].
        inner: "linear" or "mlp", as `ttt`.
        mini_batch: Tokens per mini-batch, as `ttt`.
        ln_weight: The inner LayerNorm's weight `[H, V]` (None: 1).
        ln_bias: The inner LayerNorm's bias `[H, V]` (None: 0).
        residual: f(x) = x + LN(m(x; W)); False: LN(m(x; W)).
        scale: The query scale; None means K**-0.5.
        eps: The inner LayerNorm's epsilon.
        mode: "chunk" (training) or "recurrent" (decoding).
        initial_state (TTTState | tuple | None): A `TTTState` (with the momentum), or the initial weights
            as `ttt`'s; None: zeros (linear only).
        output_final_state: Also return the state after the last token.
        cu_seqlens: int64 `[N+1]` offsets of N packed sequences (B == 1), each with its own state.

    Returns:
        o: The output `[B, T, H, V]`, in the input dtype.
        final_state: With output_final_state, a `TTTState` whose `momentum` holds S; otherwise None.

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> from linattn import titans, ttt
        >>> B, T, H, K = 1, 12, 2, 8
        >>> q, k, v = torch.randn(3, B, T, H, K).unbind(0)
        >>> theta = torch.full((B, T, H), 0.1)
        >>> alpha, eta = torch.full((B, T, H), 0.01), torch.full((B, T, H), 0.9)
        >>> o, state = titans(q, k, v, theta, alpha, eta, mini_batch=4, output_final_state=True)
        >>> o.shape, state.momentum is not None
        (torch.Size([1, 12, 2, 8]), True)

        Without weight decay and momentum it is `ttt`:

        >>> zero = torch.zeros(B, T, H)
        >>> o1, _ = titans(q, k, v, theta, zero, zero, mini_batch=4)
        >>> o2, _ = ttt(q, k, v, theta, mini_batch=4)
        >>> torch.allclose(o1, o2, atol=1e-5)
        True
    """
    p = prepare_ttt(q, k, v, theta, alpha, eta, inner=inner, mini_batch=mini_batch, ln_weight=ln_weight,
                    ln_bias=ln_bias, residual=residual, scale=scale, eps=eps, mode=mode,
                    initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                    lr_name="theta")
    return check_finite_output(run_ttt(p), "titans", q=q, k=k, v=v)


def mlp_weight_shapes(K: int, V: int, hidden: int) -> Sequence[Tuple[int, ...]]:
    """Shapes of the inner MLP's weights per head: W1 [K, hidden], b1 [hidden], W2 [hidden, V], b2 [V]."""
    return [s for _, s in _weight_shapes("mlp", K, V, hidden)]


def _example(gen, B, T, H, K, V, dtype, titan=False):
    """TTT-Linear's inputs (K == V: the inner model's residual), learning rates in (0, 0.3), mini-batches of 2,
    drawn initial weights (the registry's conformance tests); titans adds alpha and momentum."""
    q, k, v = (randn(gen, (B, T, H, K), dtype) for _ in range(3))
    args = (q, k, v, uniform(gen, (B, T, H), dtype, 0.0, 0.3))
    if titan:
        args += (uniform(gen, (B, T, H), dtype, 0.0, 0.2), uniform(gen, (B, T, H), dtype))
    weights = (0.3 * randn(gen, (B, H, K, K), dtype), 0.1 * randn(gen, (B, H, K), dtype))
    return args, {"initial_state": weights, "mini_batch": 2}


def _example_titans(gen, B, T, H, K, V, dtype):
    return _example(gen, B, T, H, K, V, dtype, titan=True)


def _reference(q, k, v, lr, *gates, initial_state, mini_batch):
    from .reference import ttt_ref
    alpha, momentum = gates if gates else (None, None)
    return ttt_ref(q, k, v, lr, initial_state, mini_batch=mini_batch, alpha=alpha, momentum=momentum)


def _prepare(*args, **kwargs):
    return prepare_ttt(*args, **kwargs)


register_op("ttt", ttt, prepare=_prepare, forms=TTT_MODES, chunk_arg=None, example=_example, reference=_reference,
            state=True, description="TTT-Linear / TTT-MLP: an inner model trained by mini-batch gradient descent")
register_op("titans", titans, prepare=_prepare, forms=TTT_MODES, chunk_arg=None, example=_example_titans,
            reference=_reference, state=True, description="Titans: TTT with momentum and weight decay")


__all__ = ["ttt", "titans", "TTTState", "prepare_ttt", "run_ttt", "TTTProblem", "INNER", "mlp_weight_shapes"]
