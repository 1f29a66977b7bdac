"""The parallel (quadratic) form of `linear_attention`, the reference the other forms agree with, and the
bidirectional (non-causal) form.

Parallel: an explicit T x T weight matrix, w_ij = phi(q_i) . psi(k_j) x exp(G_i - G_j) (G the gate's
cumulative sum), masked by selection; a carried state enters every row through phi(q_i) exp(G_i) S.
Log-space maps and diagonal gates build the [T, T, K_phi] tensor of log-weights and take each row
relative to its own maximum. The quadratic form has no state of its own: the final state, when asked
for, comes from the block recurrence (`linear_chunk_log.py` / `linear_chunk.py`).

Bidirectional: one global accumulation S += sum_j psi(k_j) v_j^T, then o_i = phi(q_i) S.
Layout and return type: `linear_common.py`.
"""
from __future__ import annotations

import torch

from ._common import causal_matmul
from .linear_chunk import chunk_matmul_form
from .linear_chunk_log import chunk_log_form
from .linear_common import LOG_BLOCK, NEG, FormResult, row_scale, split_ones, with_ones

PARALLEL_WIDE_GATES_ABOVE = 64  # the parallel form sums fp32 gates in fp64 beyond this length


def parallel_form(fq, fk, v, g, S, mu, causal: bool, log_space: bool, final_state: bool) -> FormResult:
    """fq, fk [B, H, T, K_phi], v [B, H, T, V], g, S, mu as in `linear_common.py`; the final state (and its
    log-scale) only when `final_state`, else None."""
    v1 = with_ones(v)
    o, c = _quadratic(fq, fk, v1, g, S, mu, causal, log_space)
    if not final_state:
        S, mu = None, None
    elif causal:
        S, mu = _final_state(fk, v, g, S, mu, log_space)
    else:
        S, mu = bidirectional_form(fq, fk, v, S, mu)[3:]
    return split_ones(o, c, S, mu)


def bidirectional_form(fq, fk, v, S, mu) -> FormResult:
    """Non-causal: one global accumulation S += sum_j psi(k_j) v_j^T, then o_i = phi(q_i) S."""
    v = with_ones(v)
    if mu is None:
        S = S + fk.transpose(-1, -2) @ v
        return split_ones(fq @ S, None, S, None)
    new_mu = torch.maximum(mu, fk.amax(2)).detach()
    S = torch.exp(mu - new_mu).unsqueeze(-1) * S + torch.exp(fk - new_mu.unsqueeze(2)).transpose(-1, -2) @ v
    logits = fq + new_mu.unsqueeze(2)
    c = row_scale(logits, -1)
    return split_ones(torch.exp(logits - c.unsqueeze(-1)) @ S, c, S, new_mu)


def _quadratic(fq, fk, v, g, S, mu, causal, log_space):
    """(o [B, H, T, V + 1], c [B, H, T] or None) for v with its ones column."""
    B, H, T, _ = v.shape
    dt = v.dtype
    mask = torch.ones(T, T, dtype=torch.bool, device=v.device)
    if causal:
        mask = mask.tril()
    if g is not None and T > PARALLEL_WIDE_GATES_ABOVE and g.dtype == torch.float32:
        # the whole sequence's gate sum in fp32 (~ -400 with fast gates) carries an absolute error ~3e-5 into
        # every exp(G_i - G_j), even for neighbours: sum in fp64, take the exponentials there, cast back
        g = g.double()
    G = g.cumsum(2) if g is not None else None
    if not log_space and (g is None or g.shape[-1] == 1):
        # plain features, no gate or a scalar gate: W = (phi(Q) psi(K)^T) * exp(G_i - G_j)
        W = fq @ fk.transpose(-1, -2)
        if G is not None:
            Gs = G[..., 0]
            W = W * torch.exp((Gs.unsqueeze(-1) - Gs.unsqueeze(-2)).masked_fill(~mask, 0.0)).to(dt)
        W = W.masked_fill(~mask, 0.0)
        q_state = fq * torch.exp(G).to(dt) if G is not None else fq
        return _masked_product(W, v, causal) + q_state @ S, None
    # general case: w_ij = sum_d fq_id fk_jd exp(a_id + b_jd - c_i), explicit [T, T, Kf] tensor
    zeros = torch.zeros((), dtype=v.dtype, device=v.device)
    a = (fq if log_space else zeros) + (G if G is not None else zeros)
    b = (fk if log_space else zeros) - (G if G is not None else zeros)
    x = (a.unsqueeze(3) + b.unsqueeze(2)).masked_fill(~mask[..., None], NEG)  # [B, H, T, T, Kf]
    x_state = a + mu.unsqueeze(2) if mu is not None else None  # [B, H, T, Kf]
    if log_space:
        c = row_scale(x, (-2, -1))
        if x_state is not None:
            c = torch.maximum(c, row_scale(x_state, -1))
    else:
        c = torch.zeros(B, H, T, dtype=x.dtype, device=v.device)
    E = torch.exp(x - c[..., None, None]).to(dt)   # x is fp64 after a long gate sum (above); c stays fp64
    if not log_space:
        E = E * fq.unsqueeze(3) * fk.unsqueeze(2)
    W = E.sum(-1)
    if not log_space and causal:
        W = W.masked_fill(~mask, 0.0)  # the masked exp(NEG) = 0 times an inf feature is NaN
    o = _masked_product(W, v, causal)
    if x_state is not None:
        q_state = torch.exp(x_state - c.unsqueeze(-1)).to(dt)
    else:  # plain features, diagonal gate
        q_state = fq * torch.exp(G).to(dt)
    o = o + q_state @ S
    return o, (c if log_space else None)


def _masked_product(W, v, causal):
    """W @ v for the quadratic form: a causal W never lets a later (even non-finite) v reach a row."""
    return causal_matmul(W, v) if causal else W @ v


def _final_state(fk, v, g, S, mu, log_space):
    """Final state of a sequence, by the block recurrence (zero queries: only the state is used)."""
    if log_space or (g is not None and g.shape[-1] > 1):
        r = chunk_log_form(torch.zeros_like(fk), fk, v, g, S, mu, LOG_BLOCK, log_space)
        return r.S, r.mu
    return chunk_matmul_form(torch.zeros_like(fk), fk, v, g, S, 64).S, None
