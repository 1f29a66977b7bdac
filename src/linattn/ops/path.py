"""PaTH attention (Yang et al. 2025): position encoding by accumulated Householder-like transforms
(seed eq. 25-29), optionally with FoX's forget gate.

    A_ij = q_i^T R_ij k_j,   R_ij = H_i H_{i-1} ... H_{j+1},   H_s = I - beta_s w_s w_s^T   (R_ii = I),
    o_i  = sum_{j <= i} softmax_j(scale A_ij + G_i - G_j) v_j,   G = cumsum(g) (g=None: no gate).

The layer gives ||w|| = 1 and beta in (0, 2) (every H_s then has norm <= 1); the operator accepts
any w and beta >= 0.

UT algebra (seed eq. 26-29, with beta). For a block of tokens with rows W, the unit lower-triangular
L = I + diag(beta) (W W^T * M^-) gives J = L^{-1} diag(beta), and for any j < i inside the block
R_ij = I - W_(j,i]^T J_(j,i] W_(j,i], where J_(j,i] is simply the sub-block of J (the inverse of a
triangular matrix restricted to a contiguous diagonal block is that block's inverse: eq. 27). Hence,
with one triangular solve per block, [Y | X] = L^{-1} [diag(beta) W | diag(beta) (W K^T * M^-)]:

    intra-block scores   A = Q K^T - (Q W^T * M) X                 (eq. 29, i >= j)
    queries to the block start   Q^ = Q - (Q W^T * M) Y            (q_i^T H_i ... H_first)
    keys to the block end        K^ = K - X^T W                    (H_last ... H_{j+1} k_j)
    the whole block              P = H_last ... H_first = I - W^T Y.

Across blocks, A_ij = q^_i^T P_{b-1} ... P_{c+1} k^_j for i in block b, j in block c < b: nothing
per token pair, only block transforms P applied to block-sized matrices.

Three forms that agree to floating-point precision:

* `parallel`  - eq. 29 over the whole sequence (one block of T tokens: T x T);
* `chunk`     - a sweep over query blocks with a cache of every earlier key carried to the current
                block's start (`_PaTHSweep`): step b scores Q^_b against the cache (one matmul, plus
                the block's own intra scores), takes the row softmax over all of a row's keys at once,
                then moves the cache across block b (K~ <- K~ - (K~ Y_b^T) W_b, i.e. k <- P_b k) and
                appends K^_b. Forward memory O(T * (block + K)); no T x T matrix and no T x T x D tensor;
* `recurrent` - decoding: every cached key is multiplied by the new token's factor,
                k <- k - beta (k . w) w, then one ordinary attention step (`path_attention_step`).

Backward of the sweep (custom autograd.Function). The cache is a chain (K~ at block b+1 depends on
K~ at block b through P_b), so its adjoint runs backwards in block order while the caches are
produced forwards; P_b need not be invertible (beta = 1 with ||w|| = 1 is a projector), so caches
cannot be recovered by running the chain backwards, and storing them all would cost T^2 K / (2 block).
Instead the backward groups the n = T / block blocks into segments of s = ceil(sqrt(n)) blocks and
first keeps, per segment, its keys carried to its own end (T x K numbers over all segments) and its
whole transform as one K x K matrix. Walking the segments last first, the cache at a segment's start
is rebuilt from those (each earlier segment's keys times the product of the later segments' K x K
transforms), and the cache at block b inside the segment is that times the K x K transform from the
segment's start to b, next to the segment's own few keys. Each step then runs FlashAttention-2's
backward for its row block (dS = P * (dO V^T - D) from the saved log-sum-exp, dQ^_b = dS K~; the cache
adjoint gets dS^T Q^_b) and the update's backward (gradients for W_b, Y_b, K^_b). Memory O(T * (K +
block)): a handful of T x K buffers, one [block, T] score row, K x K matrices; extra compute: one
[bC, K] x [K, K] product per block to rebuild its cache (half a cache update) and O(T K^2) per segment.
The intra-block pieces
(Q^, K^, Y, the intra scores) are ordinary autograd on [n, C, C] tensors. Packed sequences
(`cu_seqlens`) run one sequence at a time, so no transform crosses a document boundary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple

import torch

from ..errors import LinattnError, LinattnTypeError
from ._common import (
    check_finite_output,
    check_log_gate,
    check_qkv,
    check_scale,
    compute_dtype,
    pad_time,
    run_varlen,
)
from ._flash import (
    NEG_INF,
    FlaSoftmaxCall,
    anchored,
    base2,
    causal_mask,
    check_block_size,
    check_finite_gate,
    check_mode,
    check_per_token,
    check_scale_state_packing,
    cumulative_gate,
    empty_kv_cache,
    from_heads_first,
    gate_bias,
    kv_cache_attend,
    masked_softmax,
    to_heads_first,
)
from .backend import fla_path_attention, select_backend
from .delta_core import check_tensor_like
from .registry import randn, register_op, uniform, unit

FLA_PATH_DIMS = (16, 32, 64, 128)   # the head sizes fla's parallel_path_attn takes (its assert)


class PaTHState(NamedTuple):
    """The decoding state of `path_attention`. Compute dtype.

    Attributes:
        k: `[B, L, H, K]`, the cached keys, each already multiplied by every later token's factor
            (k_j -> R_tj k_j after token t).
        v: `[B, L, H, V]`, the cached values.
        G: `[B, L, H]` fp64, cumulative log-gates (None without g).
        G_now: `[B, H]` fp64, the last token's (None without g).
    """
    k: torch.Tensor
    v: torch.Tensor
    G: Optional[torch.Tensor]
    G_now: Optional[torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Intra-block UT algebra (autograd). Blocks [..., C, D], beta [..., C]; q already scaled.
# ----------------------------------------------------------------------------------------------

def _intra(q, k, w, beta):
    """-> (Q^ to the block start, K^ to the block end, Y = J W, intra scores A [.., C, C] valid for i >= j)."""
    C, D = w.shape[-2], w.shape[-1]
    incl = causal_mask(C, w.device)
    strict = causal_mask(C, w.device, strict=True)
    b = beta.unsqueeze(-1)
    L = (b * (w @ w.transpose(-1, -2))).masked_fill(~strict, 0.0)        # diag(beta) (W W^T * M^-)
    WK = (w @ k.transpose(-1, -2)).masked_fill(~strict, 0.0)              # w_r . k_j for r > j
    X = torch.linalg.solve_triangular(L, torch.cat([b * w, b * WK], dim=-1), upper=False, unitriangular=True)
    Y, Xk = X[..., :D], X[..., D:]
    QW = (q @ w.transpose(-1, -2)).masked_fill(~incl, 0.0)                # q_i . w_s for s <= i
    qh = q - QW @ Y
    kh = k - Xk.transpose(-1, -2) @ w
    A = q @ k.transpose(-1, -2) - QW @ Xk
    return qh, kh, Y, A


# ----------------------------------------------------------------------------------------------
# The sweep over query blocks with a key cache. Layout [N, Tp, D], Tp = n * C.
# ----------------------------------------------------------------------------------------------

def _advance(buf, b: int, C: int, W, Y, kh) -> None:
    """Move the cache buf[:, :bC] (keys at the start of block b) across block b, append K^_b."""
    lo, hi = b * C, (b + 1) * C
    if lo:
        old = buf[:, :lo]
        old.sub_((old @ Y[:, lo:hi].transpose(-1, -2)) @ W[:, lo:hi])
    buf[:, lo:hi] = kh[:, lo:hi]


def _apply_block(M, Wb, Yb):
    """P_b M for a K x K matrix M, P_b = I - W_b^T Y_b (the block's whole transform)."""
    return M - Wb.transpose(-1, -2) @ (Yb @ M)


def _inter_bias(G, anchor, gq, b: int, C: int, cdt, factor: float):
    """(G_i - G_j) * factor for rows of block b and keys j < bC, [N, C, bC], rounded relative to block
    b's anchor (gq: the rows' gates relative to it, already times factor)."""
    gk = ((G[:, : b * C] - anchor[:, b:b + 1]) * factor).to(cdt)
    return gq[:, b].unsqueeze(-1) - gk.unsqueeze(-2)


def _sweep_gates(G, N, n, C, cdt, factor):
    if G is None:
        return None, None
    anchor, gq = anchored(G.view(N, n, C), torch.float64)
    return anchor, (gq * factor).to(cdt)


class _PaTHSweep(torch.autograd.Function):
    """qh, kh, W, Y [N, Tp, K], A [N, n, C, C] (intra scores: scaled, biased, -inf above the diagonal),
    v [N, Tp, V], G [N, Tp] fp64 or None -> o [N, Tp, V]."""

    @staticmethod
    def forward(ctx, qh, kh, W, Y, A, v, G, C: int):
        N, Tp, K = qh.shape
        V = v.shape[-1]
        n = Tp // C
        cdt = qh.dtype
        factor, ex, lg = base2(cdt)
        anchor, gq = _sweep_gates(G, N, n, C, cdt, factor)
        qf, Af = qh * factor, A * factor
        buf = qh.new_zeros(N, Tp, K)
        o = v.new_empty(N, Tp, V)
        lse = v.new_empty(N, Tp)
        for b in range(n):
            lo, hi = b * C, (b + 1) * C
            Sx = qf[:, lo:hi] @ buf[:, :lo].transpose(-1, -2)           # [N, C, bC]
            if G is not None and lo:
                Sx = Sx + _inter_bias(G, anchor, gq, b, C, cdt, factor)
            S = torch.cat([Sx, Af[:, b]], dim=-1)                         # [N, C, (b+1) C]
            m = S.amax(-1, keepdim=True)                                  # finite: the diagonal is there
            e = ex(S.sub_(m))
            z = e.sum(-1, keepdim=True)
            o[:, lo:hi] = (e @ v[:, :hi]).div_(z)
            lse[:, lo:hi] = (m + lg(z)).squeeze(-1)
            _advance(buf, b, C, W, Y, kh)
        ctx.save_for_backward(qh, kh, W, Y, A, v, G, o, lse)
        ctx.C = C
        return o

    @staticmethod
    def backward(ctx, do):
        qh, kh, W, Y, A, v, G, o, lse = ctx.saved_tensors
        C = ctx.C
        N, Tp, K = qh.shape
        n = Tp // C
        cdt = qh.dtype
        factor, ex, _ = base2(cdt)
        do = do.to(cdt)
        Dsum = (do * o).sum(-1)                                           # [N, Tp]
        anchor, gq = _sweep_gates(G, N, n, C, cdt, factor)
        qf, Af = qh * factor, A * factor
        # segments of s blocks; pass 1: each segment's keys carried to its own end and its whole
        # transform as a K x K matrix (T K + (n / s) K^2 numbers in all)
        s = max(1, math.ceil(math.sqrt(n)))
        segs = [(a, min(a + s, n)) for a in range(0, n, s)]
        eye = torch.eye(K, dtype=cdt, device=qh.device).expand(N, K, K)
        ends, transforms = [], []
        for a, z in segs:
            loc = qh.new_zeros(N, (z - a) * C, K)
            M = eye
            for b in range(a, z):
                _advance(loc, b - a, C, W[:, a * C:z * C], Y[:, a * C:z * C], kh[:, a * C:z * C])
                M = _apply_block(M, W[:, b * C:(b + 1) * C], Y[:, b * C:(b + 1) * C])
            ends.append(loc)
            transforms.append(M)
        dqh, dkh = torch.zeros_like(qh), torch.zeros_like(kh)
        dW, dY = torch.zeros_like(W), torch.zeros_like(Y)
        dA, dv = torch.zeros_like(A), torch.zeros_like(v)
        dG = qh.new_zeros(N, Tp) if G is not None else None
        adj = qh.new_zeros(N, Tp, K)      # adjoint of the cache after the step being undone
        for j in reversed(range(len(segs))):
            start, stop = segs[j]
            # the cache at the segment's start: each earlier segment's keys times the later transforms
            S0 = qh.new_empty(N, start * C, K)
            Tm = eye
            for i in reversed(range(j)):
                S0[:, segs[i][0] * C:segs[i][1] * C] = ends[i] @ Tm.transpose(-1, -2)
                Tm = Tm @ transforms[i]
            # inside the segment: the transform from its start to block b, and the local caches
            Ms, locs = [], []
            loc = qh.new_zeros(N, (stop - start) * C, K)
            M = eye
            sl = slice(start * C, stop * C)
            for b in range(start, stop):
                Ms.append(M)
                locs.append(loc[:, : (b - start) * C].clone())
                _advance(loc, b - start, C, W[:, sl], Y[:, sl], kh[:, sl])
                M = _apply_block(M, W[:, b * C:(b + 1) * C], Y[:, b * C:(b + 1) * C])
            for b in reversed(range(start, stop)):
                lo, hi = b * C, (b + 1) * C
                # keys < bC at the start of block b
                Kc = torch.cat([S0 @ Ms.pop().transpose(-1, -2), locs.pop()], dim=1)
                Wb, Yb = W[:, lo:hi], Y[:, lo:hi]
                dkh[:, lo:hi] += adj[:, lo:hi]
                if lo:   # undo the update K~' = [K~ - Z W_b ; K^_b], Z = K~ Y_b^T
                    g_old = adj[:, :lo]
                    dZ = -(g_old @ Wb.transpose(-1, -2))                  # [N, bC, C]
                    dW[:, lo:hi] -= (Kc @ Yb.transpose(-1, -2)).transpose(-1, -2) @ g_old
                    dY[:, lo:hi] += dZ.transpose(-1, -2) @ Kc
                    dKc = g_old + dZ @ Yb
                else:
                    dKc = torch.zeros_like(Kc)             # no earlier keys
                # the scores of block b
                q_b = qh[:, lo:hi]
                Sx = qf[:, lo:hi] @ Kc.transpose(-1, -2)
                if G is not None and lo:
                    Sx = Sx + _inter_bias(G, anchor, gq, b, C, cdt, factor)
                P = ex(torch.cat([Sx, Af[:, b]], dim=-1).sub_(lse[:, lo:hi].unsqueeze(-1)))
                do_b = do[:, lo:hi]
                dv[:, :hi] += P.transpose(-1, -2) @ do_b
                dS = (do_b @ v[:, :hi].transpose(-1, -2)).sub_(Dsum[:, lo:hi].unsqueeze(-1)).mul_(P)
                dSx = dS[..., :lo]
                dA[:, b] = dS[..., lo:]
                dqh[:, lo:hi] = dSx @ Kc
                dKc = dKc + dSx.transpose(-1, -2) @ q_b
                if dG is not None and lo:
                    dG[:, lo:hi] += dSx.sum(-1)
                    dG[:, :lo] -= dSx.sum(-2)
                adj[:, :lo] = dKc
        return (dqh, dkh, dW, dY, dA, dv, dG.to(G.dtype) if dG is not None else None, None)


def _final_keys(kh, W, Y, C: int) -> torch.Tensor:
    """Every key carried to the end of the sequence (the decoding cache after a prefill)."""
    buf = torch.zeros_like(kh)
    for b in range(kh.shape[1] // C):
        _advance(buf, b, C, W, Y, kh)
    return buf


def _chunk(q, k, v, w, beta, g, block_size: int, want_keys: bool):
    """[N, T, *] (q scaled) -> (o [N, T, V], keys carried to the end [N, T, K] or None)."""
    N, T, K = q.shape
    C = min(block_size, T)
    qp, kp, vp, wp = (pad_time(x, C, dim=1).contiguous() for x in (q, k, v, w))   # padding: w = 0, H = I
    bp = pad_time(beta, C, dim=1).contiguous()
    Tp = qp.shape[1]
    n = Tp // C
    cdt = q.dtype
    qh, kh, Y, A = _intra(*(x.view(N, n, C, K) for x in (qp, kp, wp)), bp.view(N, n, C))
    G = cumulative_gate(pad_time(g, C, dim=1)) if g is not None else None
    if G is not None:
        _, gq = anchored(G.view(N, n, C), cdt)
        A = A + (gq.unsqueeze(-1) - gq.unsqueeze(-2))
    A = A.masked_fill(~causal_mask(C, q.device), NEG_INF)
    qh, kh, Y = (x.reshape(N, Tp, K) for x in (qh, kh, Y))
    o = _PaTHSweep.apply(qh, kh, wp, Y, A, vp, G, C)[:, :T]
    keys = None
    if want_keys:
        with torch.no_grad():
            keys = _final_keys(kh.detach(), wp.detach(), Y.detach(), C)[:, :T]
    return o, keys


def _parallel(q, k, v, w, beta, g):
    """[N, T, *]: eq. 29 over the whole sequence (T x T)."""
    T = q.shape[1]
    _, _, _, A = _intra(q, k, w, beta)
    if g is not None:
        A = A + gate_bias(g.double().cumsum(-1), q.dtype)
    return masked_softmax(A, causal_mask(T, q.device)) @ v


def _step_loop(q, k, v, w, beta, g, state: Optional[PaTHState]):
    """Token by token over [B, T, H, *] (q scaled, compute dtype) -> (o, state)."""
    kc, vc, Gc, G_now = state if state is not None else empty_kv_cache(k, v, g is not None)
    outs = []
    for t in range(q.shape[1]):
        w_t = w[:, t].unsqueeze(1)                                       # [B, 1, H, K]
        kc = kc - (beta[:, t].unsqueeze(1) * (kc * w_t).sum(-1)).unsqueeze(-1) * w_t
        o_t, kc, vc, Gc, G_now = kv_cache_attend(q[:, t], k[:, t:t + 1], v[:, t:t + 1],
                                                 g[:, t] if g is not None else None, kc, vc, Gc, G_now)
        outs.append(o_t)
    return torch.stack(outs, dim=1), PaTHState(kc, vc, Gc, G_now)


# ----------------------------------------------------------------------------------------------
# Validate and prepare once, then run
# ----------------------------------------------------------------------------------------------

@dataclass
class _Problem(FlaSoftmaxCall):
    q: torch.Tensor            # [B, T, H, K] compute dtype, scaled
    k: torch.Tensor
    v: torch.Tensor
    w: torch.Tensor
    beta: torch.Tensor         # [B, T, H]
    g: Optional[torch.Tensor]
    mode: str
    block_size: int
    offsets: Optional[List[int]]
    output_final_state: bool
    out_dtype: torch.dtype
    #: the caller's q, k, v and the resolved scale (what fla's kernel takes)
    source: Tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]

    fla_kernel = "parallel_path_attn"

    def fla_head_dims(self) -> Optional[str]:
        K, V = self.q.shape[-1], self.v.shape[-1]
        if K not in FLA_PATH_DIMS or V not in FLA_PATH_DIMS:
            return f"fla's PaTH kernel takes head sizes K, V in {FLA_PATH_DIMS}, got K = {K}, V = {V}"
        return None


def _check_w_beta_g(q, w, beta, g, B, T, H):
    check_tensor_like(w, "w", q)
    check_per_token(beta, "beta", B, T, H, q, nonneg=True)
    if g is not None:
        check_log_gate(g, "g", B, T, H, ref=q)
        check_finite_gate(g)


def _prepare(q, k, v, w, beta, g, scale, mode, block_size, cu_seqlens, output_final_state) -> _Problem:
    B, T, H, K, V = check_qkv(q, k, v)
    check_mode(mode)
    check_block_size(block_size)
    _check_w_beta_g(q, w, beta, g, B, T, H)
    scale, offsets = check_scale_state_packing(scale, K, output_final_state, cu_seqlens, B, T)
    cdt = compute_dtype(q.dtype)
    return _Problem(q.to(cdt) * scale, k.to(cdt), v.to(cdt), w.to(cdt), beta.to(cdt),
                    g.to(cdt) if g is not None else None, mode, block_size, offsets, output_final_state, q.dtype,
                    (q, k, v, scale))


def _run(p: _Problem):
    B, _, H, _ = p.q.shape
    want = p.output_final_state

    def one(q, k, v, w, beta, g):
        """[B, Ti, H, *] -> (o, state or None)."""
        if p.mode == "recurrent":
            o, st = _step_loop(q, k, v, w, beta, g, None)
            return o, (st if want else None)
        qh, kh, vh, wh = (to_heads_first(x, x.dtype) for x in (q, k, v, w))
        bh = to_heads_first(beta, beta.dtype)
        gh = to_heads_first(g, g.dtype) if g is not None else None
        keys = None
        if p.mode == "parallel":
            o = _parallel(qh, kh, vh, wh, bh, gh)
            if want:
                with torch.no_grad():
                    _, k_end, Y, _ = _intra(qh, kh, wh, bh)
                    keys = _final_keys(k_end, wh, Y, qh.shape[1])
        else:
            o, keys = _chunk(qh, kh, vh, wh, bh, gh, p.block_size, want)
        st = None
        if want:
            G = g.detach().double().cumsum(1) if g is not None else None
            st = PaTHState(from_heads_first(keys, B, H), v.detach(), G, G[:, -1] if G is not None else None)
        return from_heads_first(o, B, H), st

    if p.offsets is None:
        o, st = one(p.q, p.k, p.v, p.w, p.beta, p.g)
    else:
        o, _ = run_varlen(p.offsets, lambda i, s: (one(p.q[:, s], p.k[:, s], p.v[:, s], p.w[:, s], p.beta[:, s],
                                                       p.g[:, s] if p.g is not None else None)[0], None))
        st = None
    o = o.to(p.out_dtype)
    return (o, st) if want else o


def path_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, *,
                   g: Optional[torch.Tensor] = None, scale: Optional[float] = None, mode: str = "chunk",
                   block_size: int = 64, cu_seqlens: Optional[torch.Tensor] = None, output_final_state: bool = False,
                   backend: str = "auto"):
    """PaTH attention: position encoding by accumulated Householder-like transforms (module docstring).

    A_ij = q_i^T R_ij k_j with R_ij = H_i H_{i-1} ... H_{j+1}, H_s = I - beta_s w_s w_s^T, and
    o_i = sum_{j <= i} softmax_j(scale A_ij + G_i - G_j) v_j, G = cumsum(g) (g=None: no gate).

    Args:
        q: Queries `[B, T, H, K]`, any float dtype.
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]`.
        w: The Householder directions `[B, T, H, K]` (the layer gives ||w|| = 1).
        beta: Their strengths `[B, T, H]`, >= 0 (the layer gives (0, 2)).
        g: Log forget gates `[B, T, H]` (<= 0), FoX's, or None.
        scale: None means K**-0.5.
        mode: "parallel" | "chunk" | "recurrent"; they agree to floating-point precision.
        block_size: The chunk form's block length.
        cu_seqlens: int64 `[N+1]` offsets of packed sequences (B must be 1).
        output_final_state: Also return a `PaTHState` for `path_attention_step`.
        backend: "auto" (fla's `parallel_path_attn` for covered CUDA calls, PyTorch otherwise), "torch" or
            "fla" (see docs/backends.md); `linattn.explain` says which a call takes and why.

    Returns:
        o (torch.Tensor): The output `[B, T, H, V]` in the input dtype; returned alone unless
            output_final_state.
        final_state (PaTHState): With output_final_state, the decoding state; the call then returns the pair
            (o, final_state).

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from linattn import path_attention, path_attention_step
        >>> B, T, H, K = 1, 7, 2, 8
        >>> q, k, v = torch.randn(3, B, T, H, K).unbind(0)
        >>> w, beta = F.normalize(torch.randn(B, T, H, K), dim=-1), 2 * torch.rand(B, T, H)
        >>> o = path_attention(q, k, v, w, beta)
        >>> o.shape
        torch.Size([1, 7, 2, 8])
        >>> o6, state = path_attention(q[:, :6], k[:, :6], v[:, :6], w[:, :6], beta[:, :6], output_final_state=True)
        >>> o7, state = path_attention_step(q[:, 6:], k[:, 6:], v[:, 6:], w[:, 6:], beta[:, 6:], state)
        >>> torch.allclose(o7, o[:, 6:], atol=1e-5)
        True
    """
    p = _prepare(q, k, v, w, beta, g, scale, mode, block_size, cu_seqlens, output_final_state)
    result = fla_path_attention(p) if select_backend(backend, p) == "fla" else _run(p)
    return check_finite_output(result, "path_attention", q=q, k=k, v=v, w=w)


def path_attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                        state: Optional[PaTHState] = None, *, g: Optional[torch.Tensor] = None,
                        scale: Optional[float] = None):
    """Decode new tokens (usually one) after those summarised in `state`.

    Per token t: every cached key k~_j <- k~_j - beta_t (k~_j . w_t) w_t, append k_t, v_t (and
    G_t = G_{t-1} + g_t), then o_t = softmax_j(scale q_t . k~_j + G_t - G_j) v_j.

    Args:
        q: Queries `[B, T, H, K]` (usually T = 1).
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]`.
        w: The Householder directions `[B, T, H, K]`.
        beta: Their strengths `[B, T, H]`, >= 0.
        state: The state from `path_attention(..., output_final_state=True)` or a previous step; None: empty.
        g: Log forget gates `[B, T, H]` (<= 0), or None; a gated state needs g at every step.
        scale: None means K**-0.5.

    Returns:
        o (torch.Tensor): The output `[B, T, H, V]`, in the input dtype.
        state (PaTHState): The new state.

    Raises:
        LinattnError: An argument of the wrong shape or value, or a state that does not match the call.
        LinattnTypeError: state is not a `PaTHState`.

    Examples:
        >>> import torch
        >>> import torch.nn.functional as F
        >>> from linattn import path_attention, path_attention_step
        >>> q, k, v = torch.randn(3, 1, 4, 2, 8).unbind(0)
        >>> w, beta, g = F.normalize(torch.randn(1, 4, 2, 8), dim=-1), torch.rand(1, 4, 2), -torch.rand(1, 4, 2)
        >>> state, outs = None, []
        >>> for t in range(4):
        ...     s = slice(t, t + 1)
        ...     o_t, state = path_attention_step(q[:, s], k[:, s], v[:, s], w[:, s], beta[:, s], state, g=g[:, s])
        ...     outs.append(o_t)
        >>> torch.allclose(torch.cat(outs, 1), path_attention(q, k, v, w, beta, g=g), atol=1e-5)
        True
    """
    B, T, H, K, V = check_qkv(q, k, v)
    _check_w_beta_g(q, w, beta, g, B, T, H)
    scale = check_scale(scale, K ** -0.5)
    if state is not None:
        if not isinstance(state, PaTHState):
            raise LinattnTypeError(f"state must be a PaTHState (from output_final_state=True or a previous step), "
                                   f"got {type(state).__name__}")
        sk, sv, sG, _ = state
        if sk.dim() != 4 or sk.shape[0] != B or sk.shape[2:] != (H, K) or sv.shape[:3] != sk.shape[:3] \
                or sv.shape[3] != V:
            raise LinattnError(f"state.k must be [B, L, H, K] with B, H, K = {(B, H, K)} and state.v "
                               f"[B, L, H, {V}], got {tuple(sk.shape)} and {tuple(sv.shape)}")
        if (sG is None) != (g is None):
            raise LinattnError("state and call disagree about the gate: pass g at every step of a gated state "
                               "(and none for an ungated one)")
        if sk.device != q.device:
            raise LinattnError(f"state must be on the device of q ({q.device}), got {sk.device}")
    cdt = compute_dtype(q.dtype)
    o, state = _step_loop(q.to(cdt) * scale, k.to(cdt), v.to(cdt), w.to(cdt), beta.to(cdt),
                          g.to(cdt) if g is not None else None, state)
    return o.to(q.dtype), state


def _example(gen, B, T, H, K, V, dtype):
    """q, k, v, unit Householder directions w, beta in (0, 2), a forget gate (the registry's conformance tests)."""
    q, k, v = randn(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, V), dtype)
    args = (q, k, v, unit(gen, (B, T, H, K), dtype), uniform(gen, (B, T, H), dtype, 0.0, 2.0))
    return args, {"g": uniform(gen, (B, T, H), dtype, -0.5, 0.0)}


def _prepare_call(q, k, v, w, beta, *, g=None, scale=None, mode="chunk", block_size=64, cu_seqlens=None,
                  output_final_state=False, backend="auto"):
    """path_attention's prepared problem from its own arguments (the registry's `prepare`)."""
    return _prepare(q, k, v, w, beta, g, scale, mode, block_size, cu_seqlens, output_final_state)


register_op("path_attention", path_attention, prepare=_prepare_call, backends=True,
            forms=("parallel", "chunk", "recurrent"), chunk_arg="block_size",
            example=_example, reference="path_attention_ref",
            description="PaTH: softmax attention with accumulated Householder position encoding")


__all__ = ["path_attention", "path_attention_step", "PaTHState"]
