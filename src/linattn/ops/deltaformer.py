"""DeltaFormer (Zhong et al. 2025): the softmax version of DeltaNet (seed eq. 23-24).

    u_t = v_t - beta_t sum_{j<t} softmax_{j<t}(scale r_t . k_j) u_j,      o = causal_softmax(scale Q K^T) U,

with r = k (stage1_query="k", the seed's form: U = (I + diag(beta) B)^{-1} V with B the strictly causal
softmax of K K^T) or r = q (stage1_query="q", as a public implementation does). The first token has
no earlier key: u_0 = v_0. Stage two is ordinary causal softmax attention with the values U.

Three forms that agree to floating-point precision:

* `parallel`  - the strictly causal T x T softmax P, one unit lower-triangular solve
                (I + diag(beta) P) U = V, then T x T causal attention;
* `chunk`     - stage one block by block (`_DeltaStage1`): for block b the scores of its C rows
                against every earlier key and its own block come from one matmul ([C, (b+1) C]: the
                softmax normaliser of each row is exact over all its keys at once, no running max
                needed); the earlier blocks' pseudo-values enter through one matmul P_inter U_<b, the
                block's own ones through a triangular solve (I + diag(beta) P_bb) U_b = V_b -
                diag(beta) P_inter U_<b. Stage two is the blockwise online-softmax attention of
                `_flash.py`. Memory O(T * block) in forward and backward;
* `recurrent` - decoding with (k, u) in the cache (`deltaformer_step`).

Backward of stage one (custom autograd.Function, no T x T tensor): with M = I + diag(beta) P and
u = M^{-1} v, the adjoint lambda = M^{-T} du is a reverse-time recurrence
lambda_t = du_t - sum_{i>t} beta_i P_it lambda_i, solved block by block in reverse (one matmul with
the later rows' P columns, recomputed from the saved row log-sum-exp, and one upper-triangular solve);
then dv = lambda, dbeta_t = -lambda_t . r_t with r = P u, and the scores' gradient
dS_tj = -P_tj (rho_t . u_j - rho_t . r_t), rho = beta * lambda, is FlashAttention's backward with
values U, output r and output gradient -rho.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional

import torch

from ..errors import LinattnError, LinattnTypeError
from ._common import check_finite_output, check_qkv, check_scale, compute_dtype, pad_time, run_varlen
from ._flash import (
    NEG_INF,
    base2,
    causal_mask,
    check_block_size,
    check_mode,
    check_per_token,
    check_scale_state_packing,
    flash_attention,
    from_heads_first,
    kv_cache_attend,
    masked_softmax,
    to_heads_first,
)
from .registry import randn, register_op, uniform

STAGE1_QUERIES = ("k", "q")


class DeltaFormerState(NamedTuple):
    """The decoding state of `deltaformer`: the cached keys and pseudo-values (compute dtype).

    Stage one of a new token reads (k, u); stage two attends them.

    Attributes:
        k: `[B, L, H, K]`, the cached keys.
        u: `[B, L, H, V]`, the cached pseudo-values.
    """
    k: torch.Tensor
    u: torch.Tensor


# ----------------------------------------------------------------------------------------------
# Stage one, blockwise, with its own backward. Layout [N, Tp, D], Tp = n * C; r (the stage-one
# queries) already scaled.
# ----------------------------------------------------------------------------------------------

def _row_stats(S: torch.Tensor, ex, lg):
    """log-sum-exp of each row (-inf for a row with no entry) and P = softmax (zeros for such a row),
    in the units of `base2` (S already multiplied by its factor)."""
    mx = S.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
    e = ex(S - mx)
    z = e.sum(-1, keepdim=True)
    lse = (mx + lg(z)).squeeze(-1)
    return lse, e.div_(torch.where(z > 0, z, torch.ones_like(z)))


def _probs(S: torch.Tensor, lse: torch.Tensor, ex) -> torch.Tensor:
    """P from a saved log-sum-exp (rows with lse = -inf and masked entries give 0)."""
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    return ex(S.sub_(lse.unsqueeze(-1)))


class _DeltaStage1(torch.autograd.Function):
    """r (scaled), k [N, Tp, K], v [N, Tp, V], beta [N, Tp] -> u [N, Tp, V]."""

    @staticmethod
    def forward(ctx, r, k, v, beta, C: int):
        N, Tp, _ = k.shape
        V = v.shape[-1]
        n = Tp // C
        strict = causal_mask(C, k.device, strict=True)
        factor, ex, lg = base2(k.dtype)
        rf = r * factor
        U = v.new_zeros(N, Tp, V)
        R = v.new_zeros(N, Tp, V)               # r_t = sum_j P_tj u_j
        LSE = v.new_zeros(N, Tp)
        for b in range(n):
            lo, hi = b * C, (b + 1) * C
            S = rf[:, lo:hi] @ k[:, :hi].transpose(-1, -2)            # [N, C, (b+1) C]
            S[..., lo:].masked_fill_(~strict, NEG_INF)
            lse, P = _row_stats(S, ex, lg)
            r_inter = P[..., :lo] @ U[:, :lo]
            bb = beta[:, lo:hi].unsqueeze(-1)
            Pd = P[..., lo:]
            u = torch.linalg.solve_triangular(bb * Pd, v[:, lo:hi] - bb * r_inter, upper=False, unitriangular=True)
            U[:, lo:hi] = u
            R[:, lo:hi] = r_inter + Pd @ u
            LSE[:, lo:hi] = lse
        ctx.save_for_backward(r, k, beta, U, R, LSE)
        ctx.C = C
        return U

    @staticmethod
    def backward(ctx, dU):
        r, k, beta, U, R, LSE = ctx.saved_tensors
        C = ctx.C
        N, Tp, _ = k.shape
        n = Tp // C
        dU = dU.to(U.dtype)
        strict = causal_mask(C, k.device, strict=True)
        factor, ex, _ = base2(k.dtype)
        rf = r * factor
        lam = torch.zeros_like(U)
        rho = torch.zeros_like(U)
        delta = U.new_zeros(N, Tp)              # rho_t . r_t
        dr = torch.zeros_like(r)
        dk = torch.zeros_like(k)
        for c in reversed(range(n)):
            lo, hi = c * C, (c + 1) * C
            S = rf[:, lo:] @ k[:, lo:hi].transpose(-1, -2)            # rows >= block c, columns of block c
            S[:, :C].masked_fill_(~strict, NEG_INF)
            P = _probs(S, LSE[:, lo:], ex)
            rhs = dU[:, lo:hi] - P[:, C:].transpose(-1, -2) @ rho[:, hi:]
            A = beta[:, lo:hi].unsqueeze(-1) * P[:, :C]               # beta_i P_it, i > t inside the block
            lam_c = torch.linalg.solve_triangular(A.transpose(-1, -2), rhs, upper=True, unitriangular=True)
            lam[:, lo:hi] = lam_c
            rho[:, lo:hi] = beta[:, lo:hi].unsqueeze(-1) * lam_c
            delta[:, lo:hi] = (rho[:, lo:hi] * R[:, lo:hi]).sum(-1)
            dS = -P * (rho[:, lo:] @ U[:, lo:hi].transpose(-1, -2) - delta[:, lo:].unsqueeze(-1))
            dk[:, lo:hi] = dS.transpose(-1, -2) @ r[:, lo:]
            dr[:, lo:] += dS @ k[:, lo:hi]
        dbeta = -(lam * R).sum(-1)
        return dr, dk, lam, dbeta, None


def _stage1_chunk(r, k, v, beta, block_size: int) -> torch.Tensor:
    """[N, T, *] -> u [N, T, V]; padding tokens (beta = 0, v = 0, after every real token) change nothing."""
    T = k.shape[1]
    C = min(block_size, T)
    rp, kp, vp = (pad_time(x, C, dim=1).contiguous() for x in (r, k, v))
    bp = pad_time(beta, C, dim=1).contiguous()
    return _DeltaStage1.apply(rp, kp, vp, bp, C)[:, :T]


def _stage1_parallel(r, k, v, beta) -> torch.Tensor:
    T = k.shape[1]
    P = masked_softmax(r @ k.transpose(-1, -2), causal_mask(T, k.device, strict=True))
    A = beta.unsqueeze(-1) * P
    return torch.linalg.solve_triangular(A, v, upper=False, unitriangular=True)


# ----------------------------------------------------------------------------------------------
# Validate and prepare once, then run
# ----------------------------------------------------------------------------------------------

@dataclass
class _Problem:
    q: torch.Tensor       # [B, T, H, K] compute dtype, scaled
    k: torch.Tensor
    v: torch.Tensor
    beta: torch.Tensor    # [B, T, H]
    r: torch.Tensor       # the stage-one queries, scaled (k * scale or q * scale)
    mode: str
    block_size: int
    offsets: Optional[List[int]]
    output_final_state: bool
    out_dtype: torch.dtype


def _check_stage1_query(stage1_query) -> str:
    if stage1_query not in STAGE1_QUERIES:
        raise LinattnError(f"stage1_query must be 'k' (the seed's form: keys score keys) or 'q' (queries score "
                           f"keys), got {stage1_query!r}")
    return stage1_query


def _prepare(q, k, v, beta, stage1_query, scale, mode, block_size, cu_seqlens, output_final_state) -> _Problem:
    B, T, H, K, V = check_qkv(q, k, v)
    check_mode(mode)
    check_block_size(block_size)
    _check_stage1_query(stage1_query)
    check_per_token(beta, "beta", B, T, H, q, nonneg=False)
    scale, offsets = check_scale_state_packing(scale, K, output_final_state, cu_seqlens, B, T)
    cdt = compute_dtype(q.dtype)
    qc, kc = q.to(cdt), k.to(cdt)
    r = (kc if stage1_query == "k" else qc) * scale
    return _Problem(qc * scale, kc, v.to(cdt), beta.to(cdt), r, mode, block_size, offsets, output_final_state,
                    q.dtype)


def _step_loop(q, k, v, beta, r, state: Optional[DeltaFormerState]):
    """Token by token over [B, T, H, *] (scaled, compute dtype) -> (o, u, state)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    kc, uc = state if state is not None else (k.new_zeros(B, 0, H, K), v.new_zeros(B, 0, H, V))
    outs, us = [], []
    for t in range(T):
        if kc.shape[1]:
            p = torch.softmax(torch.einsum("bhk,blhk->blh", r[:, t], kc), dim=1)
            u_t = v[:, t] - beta[:, t].unsqueeze(-1) * torch.einsum("blh,blhv->bhv", p, uc)
        else:
            u_t = v[:, t]
        o_t, kc, uc, _, _ = kv_cache_attend(q[:, t], k[:, t:t + 1], u_t.unsqueeze(1), None, kc, uc, None, None)
        outs.append(o_t)
        us.append(u_t)
    return torch.stack(outs, dim=1), torch.stack(us, dim=1), DeltaFormerState(kc, uc)


def _run(p: _Problem):
    B, _, H, _ = p.q.shape

    def one(q, k, v, beta, r):
        """[B, Ti, H, *] -> (o, u)."""
        if p.mode == "recurrent":
            o, u, _ = _step_loop(q, k, v, beta, r, None)
            return o, u
        qh, kh, vh, rh = (to_heads_first(x, x.dtype) for x in (q, k, v, r))
        bh = to_heads_first(beta, beta.dtype)
        if p.mode == "parallel":
            u = _stage1_parallel(rh, kh, vh, bh)
            Ti = q.shape[1]
            o = masked_softmax(qh @ kh.transpose(-1, -2), causal_mask(Ti, q.device)) @ u
        else:
            u = _stage1_chunk(rh, kh, vh, bh, p.block_size)
            o = flash_attention(qh, kh, u, None, p.block_size)
        return from_heads_first(o, B, H), from_heads_first(u, B, H)

    if p.offsets is None:
        o, u = one(p.q, p.k, p.v, p.beta, p.r)
    else:
        (o, u), _ = run_varlen(p.offsets, lambda i, s: (one(p.q[:, s], p.k[:, s], p.v[:, s], p.beta[:, s], p.r[:, s]),
                                                        None))
    o = o.to(p.out_dtype)
    if p.output_final_state:
        return o, DeltaFormerState(p.k.detach(), u.detach())
    return o


def deltaformer(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
                stage1_query: str = "k", scale: Optional[float] = None, mode: str = "chunk", block_size: int = 64,
                cu_seqlens: Optional[torch.Tensor] = None, output_final_state: bool = False):
    """DeltaFormer: softmax attention over pseudo-values written by a delta rule (module docstring).

    Stage one computes u_t = v_t - beta_t softmax(scale r_t . k_<t) u_<t (r = k or q); stage two attends
    o_t = softmax(scale q_t . k_<=t) u_<=t.

    Args:
        q: Queries `[B, T, H, K]`, any float dtype.
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]`.
        beta: Write strengths `[B, T, H]`, any finite values (usually in [0, 1]; fla's DeltaFormer passes its
            projection unbounded: stage one's triangular solve has a unit diagonal for any beta).
        stage1_query: "k" (the seed's form) or "q": what stage one reads the cache with.
        scale: None means K**-0.5 (both stages).
        mode: "parallel" | "chunk" | "recurrent"; they agree to floating-point precision.
        block_size: The chunk form's block length.
        cu_seqlens: int64 `[N+1]` offsets of packed sequences (B must be 1).
        output_final_state: Also return a `DeltaFormerState` (k, u) for `deltaformer_step`.

    Returns:
        o (torch.Tensor): The output `[B, T, H, V]` in the input dtype; returned alone unless
            output_final_state.
        final_state (DeltaFormerState): With output_final_state, the cached keys and pseudo-values; the call
            then returns the pair (o, final_state).

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it).

    Examples:
        >>> import torch
        >>> from linattn import deltaformer, deltaformer_step
        >>> B, T, H, K = 1, 7, 2, 8
        >>> q, k, v = torch.randn(3, B, T, H, K).unbind(0)
        >>> beta = torch.rand(B, T, H)
        >>> o = deltaformer(q, k, v, beta)
        >>> o.shape
        torch.Size([1, 7, 2, 8])
        >>> o6, state = deltaformer(q[:, :6], k[:, :6], v[:, :6], beta[:, :6], output_final_state=True)
        >>> o7, state = deltaformer_step(q[:, 6:], k[:, 6:], v[:, 6:], beta[:, 6:], state)
        >>> torch.allclose(o7, o[:, 6:], atol=1e-5)
        True
    """
    return check_finite_output(_run(_prepare(q, k, v, beta, stage1_query, scale, mode, block_size, cu_seqlens,
                                             output_final_state)), "deltaformer", q=q, k=k, v=v)


def deltaformer_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
                     state: Optional[DeltaFormerState] = None, *, stage1_query: str = "k",
                     scale: Optional[float] = None):
    """Decode new tokens (usually one) after those summarised in `state`.

    Per token: u_t = v_t - beta_t softmax(scale r_t . k_<t) u_<t from the cache, append (k_t, u_t),
    then o_t = softmax(scale q_t . k_<=t) u_<=t.

    Args:
        q: Queries `[B, T, H, K]` (usually T = 1).
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]`.
        beta: Write strengths `[B, T, H]`, any finite values (usually in [0, 1]; fla's DeltaFormer passes its
            projection unbounded: stage one's triangular solve has a unit diagonal for any beta).
        state: The state from `deltaformer(..., output_final_state=True)` or a previous step; None: empty.
        stage1_query: "k" or "q", as in `deltaformer` (the same as the prefill's).
        scale: None means K**-0.5.

    Returns:
        o (torch.Tensor): The output `[B, T, H, V]`, in the input dtype.
        state (DeltaFormerState): The new state.

    Raises:
        LinattnError: An argument of the wrong shape or value, or a state that does not match the call.
        LinattnTypeError: state is not a `DeltaFormerState`.

    Examples:
        >>> import torch
        >>> from linattn import deltaformer, deltaformer_step
        >>> q, k, v = torch.randn(3, 1, 4, 2, 8).unbind(0)
        >>> beta = torch.rand(1, 4, 2)
        >>> state, outs = None, []
        >>> for t in range(4):
        ...     s = slice(t, t + 1)
        ...     o_t, state = deltaformer_step(q[:, s], k[:, s], v[:, s], beta[:, s], state)
        ...     outs.append(o_t)
        >>> torch.allclose(torch.cat(outs, 1), deltaformer(q, k, v, beta), atol=1e-5)
        True
    """
    B, T, H, K, V = check_qkv(q, k, v)
    _check_stage1_query(stage1_query)
    check_per_token(beta, "beta", B, T, H, q, nonneg=False)
    scale = check_scale(scale, K ** -0.5)
    if state is not None:
        if not isinstance(state, DeltaFormerState):
            raise LinattnTypeError(f"state must be a DeltaFormerState (from output_final_state=True or a previous "
                                   f"step), got {type(state).__name__}")
        sk, su = state
        if sk.dim() != 4 or sk.shape[0] != B or sk.shape[2:] != (H, K) or su.shape[:3] != sk.shape[:3] \
                or su.shape[3] != V:
            raise LinattnError(f"state.k must be [B, L, H, K] with B, H, K = {(B, H, K)} and state.u "
                               f"[B, L, H, {V}], got {tuple(sk.shape)} and {tuple(su.shape)}")
        if sk.device != q.device:
            raise LinattnError(f"state must be on the device of q ({q.device}), got {sk.device}")
    cdt = compute_dtype(q.dtype)
    qc, kc = q.to(cdt), k.to(cdt)
    r = (kc if stage1_query == "k" else qc) * scale
    o, _, state = _step_loop(qc * scale, kc, v.to(cdt), beta.to(cdt), r, state)
    return o.to(q.dtype), state


def _example(gen, B, T, H, K, V, dtype):
    """q, k, v and beta in (0, 1) (the registry's conformance tests)."""
    q, k, v = randn(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, V), dtype)
    return (q, k, v, uniform(gen, (B, T, H), dtype)), {}


register_op("deltaformer", deltaformer, forms=("parallel", "chunk", "recurrent"), chunk_arg="block_size",
            example=_example, reference="deltaformer_ref",
            description="DeltaFormer: softmax attention over delta-rule pseudo-values")


__all__ = ["deltaformer", "deltaformer_step", "DeltaFormerState", "STAGE1_QUERIES"]
