"""The chunk forms of `linear_attention` in log-space: exp-type feature maps (Hadamard Exp, FAVOR+) and
diagonal (GLA) gates.

Two algorithms, both causal to the bit (every stabiliser a row uses depends only on tokens up to it):

* the block form (`chunk_log_form`), every exponent <= 0: blocks of `LOG_BLOCK` tokens, explicit
  [s, s, K_phi] log-weights inside a block taken relative to each row's maximum, a state carried in
  log-scale form (S, mu) across blocks, the two merged like flash-attention merges tiles;
* the matmul path of the log-space maps with no gate or a scalar gate (`log_chunk_matmul_form`, CPU
  tensors in eager mode): features shifted per chunk by the chunk's first key, rows scaled by a
  running maximum, and a row-local test of which rows that represents exactly (the others, rare, come
  from the block form).

Layout and return type: `linear_common.py`.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._common import causal_matmul, pad_time
from .linear_common import LOG_BLOCK, NEG, FormResult, row_scale, split_ones, with_ones

# A row of a log-space map may take the matmul path when its keys lie less than this many nats above
# its chunk's shift and its diagonal term less than this below its row log-scale (see `_shift_plan`):
# its features then lie in [e^-80, e^40], far from fp32's limits (e^-87 .. e^88).
SAFE_SPAN = 40.0


def chunk_log_form(fq, fk, v, g, S, mu, s: int, log_space: bool) -> FormResult:
    """Causal chunk form in log-space, for exp-type feature maps and for diagonal gates; blocks of s tokens.
    fq, fk [B, H, T, K_phi] (log-features when log_space), v [B, H, T, V], g, S, mu as in `linear_common.py`."""
    o, c, S, mu = _chunk_log(fq, fk, with_ones(v), g, S, mu, s, log_space)
    return split_ones(o, c, S, mu)


def log_chunk_matmul_form(fq, fk, v, g, S, mu, C: int) -> Optional[FormResult]:
    """The log-space matmul path, with every row it cannot represent taken from the block path
    (rows are chosen by a causal, row-local test, see `_shift_plan`); None when no row qualifies."""
    plan = _shift_plan(fq, fk, g, mu, C)
    if not bool(plan.valid.any()):
        return None
    r = _chunk_shifted(plan, v, S)
    if not bool(plan.valid.all()):  # rare: huge spans of key log-features, or non-finite keys
        b = chunk_log_form(fq, fk, v, g, S, mu, min(C, LOG_BLOCK), True)
        ok = plan.valid
        r = r._replace(num=torch.where(ok.unsqueeze(-1), r.num, b.num), den=torch.where(ok, r.den, b.den),
                       c=torch.where(ok, r.c, b.c))
    return r


class _ShiftPlan(NamedTuple):
    """What the log-space matmul path needs, all causal (see `_shift_plan`); [B, H, n, C, *] blocks."""
    lq: torch.Tensor
    lk: torch.Tensor
    G: Optional[torch.Tensor]        # the gate's cumulative sum inside each chunk [B, H, n, C], or None
    mu_start: torch.Tensor           # the state's log-scale before each chunk [B, H, n, Kf]
    mu_next: torch.Tensor            # ... and after it
    mu_final: torch.Tensor           # [B, H, Kf]
    c: torch.Tensor                  # row log-scale [B, H, n, C]
    M: torch.Tensor                  # per-chunk feature shift: the chunk's first key [B, H, n, Kf]
    valid: torch.Tensor              # rows the shifted features represent exactly [B, H, T]



def _shift_plan(lq, lk, g, mu, C) -> _ShiftPlan:
    """The stabilisers of the log-space matmul path and the rows it represents exactly.

    Every quantity a row i uses depends only on tokens <= i, so no later token can change its bits:
    the state's log-scale before each chunk (the running maximum of the decayed key log-features of
    the earlier chunks, as in the block path), the feature shift M of a chunk (its *first* key, which
    every row of the chunk has seen), and the row log-scale c_i = max_d (lq_id + max(cm_id, mu_d + G_i)),
    with cm_i the running maximum of the chunk's keys up to i: an upper bound on every log-weight
    row i sees, so phi = exp(lq + M - c) <= 1. A row is valid when its keys stay within SAFE_SPAN nats
    above the shift (psi = exp(lk - M) <= e^SAFE_SPAN) and its own diagonal term is within SAFE_SPAN
    of c_i (so the row's sum is >= e^-SAFE_SPAN and phi >= e^-2 SAFE_SPAN at the feature that carries
    it): then nothing overflows or becomes subnormal in the terms that matter, and the row is exact.
    Non-finite keys make the rows from theirs on invalid (those go to the block path).
    """
    B, H, T, Kf = lq.shape
    lq = pad_time(lq, C, dim=2).contiguous()
    lk = pad_time(lk, C, dim=2, value=NEG).contiguous()  # padding keys weigh exactly 0
    n = lq.shape[2] // C
    lq, lk = lq.view(B, H, n, C, Kf), lk.view(B, H, n, C, Kf)
    G = None if g is None else pad_time(g[..., 0], C, dim=2).view(B, H, n, C).cumsum(-1)
    with torch.no_grad():
        b = lk if G is None else lk + (G[..., -1:] - G).unsqueeze(-1)  # keys' log-weights at their chunk's end
        bmax = b.amax(3)  # [B, H, n, Kf]
        G_end = G[..., -1:].unbind(2) if G is not None else [None] * n  # each [B, H, 1]
        mus, m = [], mu.detach()
        for bm, ge in zip(bmax.unbind(2), G_end):
            mus.append(m)
            m = torch.maximum(m if ge is None else m + ge, bm)
        mu_start = torch.stack(mus, dim=2)
        mu_next = torch.stack(mus[1:] + [m], dim=2)
        lqd, lkd = lq.detach(), lk.detach()
        cm = lkd.cummax(3).values  # running maximum of the chunk's keys, up to each row
        x_state = lqd + mu_start.unsqueeze(3)
        if G is not None:
            x_state = x_state + G.detach().unsqueeze(-1)
        c = torch.maximum((lqd + cm).amax(-1), x_state.amax(-1))  # [B, H, n, C]
        M = lkd[:, :, :, 0]
        diag = (lqd + lkd).amax(-1)
        valid = ((cm - M.unsqueeze(3)).amax(-1) < SAFE_SPAN) & ((c - diag) < SAFE_SPAN)
    return _ShiftPlan(lq, lk, G, mu_start, mu_next, m, c, M, valid.view(B, H, n * C)[:, :, :T])



def _chunk_shifted(plan: _ShiftPlan, v, S) -> FormResult:
    """Log-space maps with no gate or a scalar gate on the matmul path (CPU tensors in eager mode).

    Within a chunk, w_ij = sum_d exp(lq_id + lk_jd - c_i) (times exp(G_i - G_j) with a gate) is the
    matmul of phi = exp(lq + M - c_i) and psi = exp(lk - M), M the chunk's first key (`_shift_plan`);
    across chunks the state is carried in log-scale form exactly like the block path's. Rows that are
    not `plan.valid` are wrong here and must be taken from the block path.
    """
    lq, lk, G, mu_start, mu_next = plan.lq, plan.lk, plan.G, plan.mu_start, plan.mu_next
    B, H, n, C, Kf = lq.shape
    T, V = v.shape[2], v.shape[-1]
    v = pad_time(v, C, dim=2).contiguous().view(B, H, n, C, V)
    mask = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    # the state before each chunk (every factor exp(<= 0))
    b = lk if G is None else lk + (G[..., -1:] - G).unsqueeze(-1)
    k_end = torch.exp(b - mu_next.unsqueeze(3))  # [B, H, n, C, Kf]
    U = torch.cat([k_end.transpose(-1, -2) @ v, k_end.sum(3).unsqueeze(-1)], dim=-1)  # [B, H, n, Kf, V + 1]
    carry = mu_start - mu_next if G is None else mu_start + G[..., -1:] - mu_next
    starts = []
    for U_i, f_i in zip(U.unbind(2), torch.exp(carry).unsqueeze(-1).unbind(2)):
        starts.append(S)
        S = f_i * S + U_i
    starts = torch.stack(starts, dim=2)
    # inside each chunk: phi psi^T (times the decay), masked by selection
    c = plan.c.unsqueeze(-1)
    fq = torch.exp(lq + plan.M.unsqueeze(3) - c)
    fk = torch.exp(lk - plan.M.unsqueeze(3))
    A = fq @ fk.transpose(-1, -2)  # [B, H, n, C, C]
    x_state = lq + mu_start.unsqueeze(3)
    if G is not None:
        A = A * torch.exp((G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~mask, float("-inf")))
        x_state = x_state + G.unsqueeze(-1)
    A = A.masked_fill(~mask, 0.0)
    q_state = torch.exp(x_state - c)  # <= 1
    kv_prev, z_prev = starts[..., :V], starts[..., V]
    num = causal_matmul(A.flatten(0, 2), v.flatten(0, 2), input=(q_state @ kv_prev).flatten(0, 2))
    den = A.sum(-1) + (q_state * z_prev.unsqueeze(3)).sum(-1)
    c = plan.c.reshape(B, H, n * C)[:, :, :T]
    return FormResult(num.view(B, H, n * C, V)[:, :, :T], den.view(B, H, n * C)[:, :, :T], c, S, plan.mu_final)



def _chunk_log(fq, fk, v, g, S, mu, s, log_space):
    """`chunk_log_form` on v with its ones column -> (o [B, H, T, V + 1], c, S, mu).

    With a = lq + G and b = lk - G (G the gate's cumulative sum inside a block of s tokens), the
    weight is w_ij = sum_d fq_id fk_jd exp(a_id + b_jd). Inside a block it is computed explicitly
    relative to the row's own maximum; across blocks through the state (S, mu), whose every
    rescaling factor is exp(<= 0). The two parts are merged like flash-attention merges tiles.
    """
    B, H, T, Kf = fq.shape
    fq = pad_time(fq, s, dim=2)
    fk = pad_time(fk, s, dim=2, value=NEG if log_space else 0.0)  # padding keys weigh exactly 0
    v = pad_time(v, s, dim=2)
    n = fq.shape[2] // s
    V1 = v.shape[-1]
    fq, fk, v = fq.view(B, H, n, s, Kf), fk.view(B, H, n, s, Kf), v.view(B, H, n, s, V1)
    if g is not None:
        G = pad_time(g, s, dim=2).view(B, H, n, s, g.shape[-1]).cumsum(3)
    else:
        G = torch.zeros(B, H, n, s, 1, dtype=v.dtype, device=v.device)
    a = (fq if log_space else 0.0) + G
    b = (fk if log_space else 0.0) - G

    # intra-block: explicit [s, s, Kf] weights per block
    mask = torch.ones(s, s, dtype=torch.bool, device=v.device).tril()
    x = (a.unsqueeze(4) + b.unsqueeze(3)).masked_fill(~mask[..., None], NEG)  # [B, H, n, s, s, Kf]
    c_in = row_scale(x, (-2, -1)) if log_space else None
    E = torch.exp(x - c_in[..., None, None]) if log_space else torch.exp(x)
    if not log_space:
        E = E * fq.unsqueeze(4) * fk.unsqueeze(3)
    W = E.sum(-1)
    if not log_space:
        W = W.masked_fill(~mask, 0.0)  # the masked exp(NEG) = 0 times an inf feature is NaN
    o_in = causal_matmul(W, v)  # [B, H, n, s, V1]

    # inter-block: carry (S, mu) through the blocks; keep the state at each block's start
    G_end = G[:, :, :, -1]  # [B, H, n, 1 or Kf]
    starts, mus = [], []
    # per-block tensors by unbind (indexing would give every step a full-size backward)
    if mu is None:
        k_end = fk * torch.exp(G_end.unsqueeze(3) - G)  # keys decayed to their block's end
        for k_i, v_i, ge_i in zip(k_end.unbind(2), v.unbind(2), torch.exp(G_end).unbind(2)):
            starts.append(S)
            S = ge_i.unsqueeze(-1) * S + k_i.transpose(-1, -2) @ v_i
    else:
        b_end = b + G_end.unsqueeze(3)  # keys' log-weights at their block's end
        for b_i, v_i, ge_i in zip(b_end.unbind(2), v.unbind(2), G_end.unbind(2)):
            starts.append(S)
            mus.append(mu)
            decayed = mu + ge_i
            new_mu = torch.maximum(decayed, b_i.amax(2)).detach()
            S = torch.exp(decayed - new_mu).unsqueeze(-1) * S \
                + torch.exp(b_i - new_mu.unsqueeze(2)).transpose(-1, -2) @ v_i
            mu = new_mu
    starts = torch.stack(starts, dim=2)  # [B, H, n, Kf, V1]
    if mu is None:
        o = o_in + (fq * torch.exp(G)) @ starts
        c = None
    else:
        x_st = a + torch.stack(mus, dim=2).unsqueeze(3)  # [B, H, n, s, Kf]
        c_st = row_scale(x_st, -1)
        c = torch.maximum(c_in, c_st)
        o = o_in * torch.exp(c_in - c).unsqueeze(-1) \
            + (torch.exp(x_st - c.unsqueeze(-1)) @ starts)
        c = c.reshape(B, H, n * s)[:, :, :T]
    return o.reshape(B, H, n * s, V1)[:, :, :T], c, S, mu  # explicit sizes: B may be 0
