"""Kernelized linear attention: o_i = sum_j w_ij v_j (/ sum_j w_ij), w_ij = phi(q_i) . psi(k_j) x decay.

Three forms that agree to floating-point precision:

* `parallel`  - the quadratic form with an explicit T x T weight matrix (the reference);
* `chunk`     - chunkwise: exact attention inside a chunk, a carried state between chunks (training);
* `recurrent` - one token at a time with a constant-size state (decoding).

A call is validated and prepared once (`prepare_linear_attention` -> `LinearProblem`: feature map
resolved, gates turned into one log-gate, scale, state and packed-sequence offsets checked), then
run by a backend: the PyTorch forms below, or the Triton kernels (`ops/backend.py`).

The normaliser is computed by appending a column of ones to V, so its state z = sum psi(k) decays
with the numerator by construction and every form shares the state S = [kv | z].

Log-space feature maps (Hadamard Exp, FAVOR+) keep a per-feature log-scale mu next to the state,
the running maximum of the (decayed) key log-features, exactly like online softmax keeps its
running max: the true state is exp(mu_d) * S_d. Each output row is computed relative to its own
maximum log-weight c_i, which cancels in the normalised output (and is multiplied back otherwise).
Chunkwise, those maps and diagonal (GLA) gates use the log-space block algorithm below, whose
every exponent is <= 0, with blocks of LOG_BLOCK tokens; the plain feature maps with no gate or a
scalar gate use pure matmuls (without a gate, in eager mode, through the fused form with a hand-written
backward in `ops/linear_chunk.py`). The log-space maps with no gate or a scalar gate also have a matmul
path, for CPU tensors in eager mode: features shifted per chunk by the chunk's first key, rows scaled
by a running maximum, and a row-local test of which rows that represents exactly (the others, rare,
come from the block path). On CUDA and under torch.compile the log-space maps always take the block
path: no host synchronisation and one graph, at the block path's cost. Every other choice depends only
on the map, the gate and the mode.

Causality, to the bit. Every stabiliser, shift and path choice a row uses depends only on tokens up to
that row, so changing later tokens never changes an earlier output, not even by rounding: in the chunk
and recurrent forms, running on a prefix x[:, :t] gives the bits of the first t outputs of the full
run. Masks act by selection, never by multiplying with 0 (0 * inf = NaN), and a later value never
enters an earlier row's product (`causal_matmul`): an inf or NaN at position t leaves every output
before t exactly as it was (it does reach later outputs, and through the carried state later chunks).

The normalised output of a log-space map divides by the *stabilised* denominator,
sum_j w_ij / exp(c_i) >= 1 for these strictly positive kernels, so eps never changes it and adding a
constant to every query entry leaves the output unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Tuple, Union

import torch

from ..cpu import MAX_CHUNK as CPU_MAX_CHUNK
from ..errors import LinattnError, LinattnTypeError
from ..feature_maps import FeatureMap, get_feature_map
from ..triton import triton_chunk_size
from ._common import (
    _reads_values,
    causal_matmul,
    check_cu_seqlens,
    check_finite_output,
    check_log_gate,
    check_mode,
    check_qkv,
    check_scale,
    check_values,
    compute_dtype,
    pad_time,
)
from .backend import cpu_linear_attention, requires_grad, select_backend, triton_linear_attention
from .delta_core import LOG_GATE_FLOOR
from .heads import value_groups
from .linear_chunk import FUSED, linear_chunk

# Log-scale of an empty state, and log-feature of a padding key: finite, so that differences
# of two such values never produce NaN, yet exp() of it is exactly 0.
NEG = -1e30
LOG_BLOCK = 16  # block size of the log-space chunk path (its intra-block work is O(T * 16 * K))
PARALLEL_WIDE_GATES_ABOVE = 64  # the parallel form sums fp32 gates in fp64 beyond this length (issue 33.7)
# A row of a log-space map may take the matmul path when its keys lie less than this many nats above
# its chunk's shift and its diagonal term less than this below its row log-scale (see `_shift_plan`):
# its features then lie in [e^-80, e^40], far from fp32's limits (e^-87 .. e^88).
SAFE_SPAN = 40.0


class LinearAttentionState(NamedTuple):
    """The recurrent state of `linear_attention`, one row per sequence.

    N = B, or the number of sequences in `cu_seqlens`. All tensors are fp32 (fp64 for fp64 inputs). It
    round-trips between the forms and between calls.

    Attributes:
        kv: `[N, H, K_phi, V]`, sum_j decay * psi(k_j) v_j^T.
        z: `[N, H, K_phi]`, sum_j decay * psi(k_j), the normaliser's state.
        log_scale: `[N, H, K_phi]`, log-space maps only (else None): kv and z are stored divided by
            exp(log_scale), per feature; -1e30 marks an empty state.
        offset: `[N]` int64, tokens consumed so far (positions continue from here).
    """
    kv: torch.Tensor
    z: torch.Tensor
    log_scale: Optional[torch.Tensor]
    offset: torch.Tensor


# ----------------------------------------------------------------------------------------------
# The three forms. Shared layout inside this module: [B, H, T, D]; v carries the extra ones
# column (V1 = V + 1); S [B, H, Kf, V1]; mu [B, H, Kf] (log-space maps) or None; g a log-gate,
# [B, H, T, 1] (scalar per head) or [B, H, T, Kf] (diagonal), or None.
# Each returns (o [B, H, T, V1], c [B, H, T] row log-scale or None, S_final, mu_final).
# ----------------------------------------------------------------------------------------------

def _row_scale(x: torch.Tensor, dims) -> torch.Tensor:
    return x.amax(dim=dims).detach()  # stabilisers carry no gradient: their effect cancels exactly


def _recurrent(fq, fk, v, g, S, mu):
    T = v.shape[2]
    outs, scales = [], []
    # per-step tensors by unbind: indexing [:, :, t] would give every step a full-size backward
    gs = g.unbind(2) if g is not None else [None] * T  # each [B, H, 1 or Kf]
    for q_t, k_t, v_t, gt in zip(fq.unbind(2), fk.unbind(2), v.unbind(2), gs):
        if mu is None:  # linear-space features
            if gt is not None:
                S = torch.exp(gt).unsqueeze(-1) * S
            S = S + k_t.unsqueeze(-1) * v_t.unsqueeze(-2)
            outs.append(torch.einsum("bhk,bhkv->bhv", q_t, S))
        else:  # log-space features: fq, fk are log-features; track the running max mu
            decayed = mu + gt if gt is not None else mu
            new_mu = torch.maximum(decayed, k_t).detach()
            S = torch.exp(decayed - new_mu).unsqueeze(-1) * S \
                + torch.exp(k_t - new_mu).unsqueeze(-1) * v_t.unsqueeze(-2)
            mu = new_mu
            logits = q_t + mu
            c = _row_scale(logits, -1)
            scales.append(c)
            outs.append(torch.einsum("bhk,bhkv->bhv", torch.exp(logits - c.unsqueeze(-1)), S))
    o = torch.stack(outs, dim=2)
    return o, (torch.stack(scales, dim=2) if mu is not None else None), S, mu


def _parallel(fq, fk, v, g, S, mu, causal, log_space):
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
        return _masked_product(W, v, causal) + q_state @ S, None, None, None
    # general case: w_ij = sum_d fq_id fk_jd exp(a_id + b_jd - c_i), explicit [T, T, Kf] tensor
    zeros = torch.zeros((), dtype=v.dtype, device=v.device)
    a = (fq if log_space else zeros) + (G if G is not None else zeros)
    b = (fk if log_space else zeros) - (G if G is not None else zeros)
    x = (a.unsqueeze(3) + b.unsqueeze(2)).masked_fill(~mask[..., None], NEG)  # [B, H, T, T, Kf]
    x_state = a + mu.unsqueeze(2) if mu is not None else None  # [B, H, T, Kf]
    if log_space:
        c = _row_scale(x, (-2, -1))
        if x_state is not None:
            c = torch.maximum(c, _row_scale(x_state, -1))
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
    return o, (c if log_space else None), None, None


def _masked_product(W, v, causal):
    """W @ v for the quadratic form: a causal W never lets a later (even non-finite) v reach a row."""
    return causal_matmul(W, v) if causal else W @ v


def _bidirectional(fq, fk, v, S, mu):
    """Non-causal: one global accumulation S += sum_j psi(k_j) v_j^T, then o_i = phi(q_i) S."""
    if mu is None:
        S = S + fk.transpose(-1, -2) @ v
        return fq @ S, None, S, None
    new_mu = torch.maximum(mu, fk.amax(2)).detach()
    S = torch.exp(mu - new_mu).unsqueeze(-1) * S + torch.exp(fk - new_mu.unsqueeze(2)).transpose(-1, -2) @ v
    logits = fq + new_mu.unsqueeze(2)
    c = _row_scale(logits, -1)
    return torch.exp(logits - c.unsqueeze(-1)) @ S, c, S, new_mu


def _chunk_matmul(fq, fk, v, g, S, C):
    """Causal chunk form for plain features with no gate or a scalar gate: only matmuls.

    fq, fk [B, H, T, Kf] and v [B, H, T, V] (no ones column: on this hot path the normaliser is
    computed beside the values, which keeps the matmuls 64 wide). Per chunk:
    o = (phi(Q) psi(K)^T * D) V + (phi(Q) * decay) S_prev, with D_ij = exp(G_i - G_j) from the
    gate's cumulative sum local to the chunk, so every exponent is <= 0. Backward keeps one
    state per chunk, never one per token.
    """
    B, H, T, Kf = fq.shape
    V = v.shape[-1]
    # one explicit copy into [B, H, n, C, D]: otherwise every bmm gathers its strided operands itself
    fq, fk, v = (pad_time(x, C, dim=2).contiguous() for x in (fq, fk, v))  # zero keys/values add nothing
    n = fq.shape[2] // C
    fq, fk, v = fq.view(B, H, n, C, Kf), fk.view(B, H, n, C, Kf), v.view(B, H, n, C, V)
    mask = torch.ones(C, C, dtype=torch.bool, device=v.device).tril()
    A = fq @ fk.transpose(-1, -2)  # [B, H, n, C, C]
    if g is None:
        A = A.masked_fill_(~mask, 0.0)  # in place: bmm's backward needs its inputs, not A
        U = torch.cat([fk.transpose(-1, -2) @ v, fk.sum(3).unsqueeze(-1)], dim=-1)  # each chunk's [kv | z]
        decay = None
        q_inter = fq
    else:
        G = pad_time(g[..., 0], C, dim=2).view(B, H, n, C).cumsum(-1)
        A = A * torch.exp((G.unsqueeze(-1) - G.unsqueeze(-2)).masked_fill(~mask, float("-inf")))
        A = A.masked_fill_(~mask, 0.0)  # by selection: an inf key would make the masked 0 * inf NaN
        G_end = G[..., -1:]  # [B, H, n, 1]
        k_dec = fk * torch.exp(G_end - G).unsqueeze(-1)  # keys decayed to the chunk's end
        U = torch.cat([k_dec.transpose(-1, -2) @ v, k_dec.sum(3).unsqueeze(-1)], dim=-1)
        decay = torch.exp(G_end).unsqueeze(-1)  # [B, H, n, 1, 1]
        q_inter = fq * torch.exp(G).unsqueeze(-1)
    # the state before each chunk; a Python loop (+ stack) is several times faster than cumsum
    # along this axis on CPU, and keeps exactly one state per chunk for backward
    # (unbind, not U[:, :, i]: indexing would give each step a backward that writes a full-size gradient)
    starts = []
    decays = decay.unbind(2) if decay is not None else None
    for i, U_i in enumerate(U.unbind(2)):
        starts.append(S)
        S = (S if decays is None else decays[i] * S) + U_i
    starts = torch.stack(starts, dim=2)
    kv_prev, z_prev = starts[..., :V], starts[..., V]
    num = causal_matmul(A.flatten(0, 2), v.flatten(0, 2), input=(q_inter @ kv_prev).flatten(0, 2))
    den = A.sum(-1) + (q_inter * z_prev.unsqueeze(3)).sum(-1)
    return (num.view(B, H, n * C, V)[:, :, :T], den.view(B, H, n * C)[:, :, :T]), None, S, None


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


def _chunk_shifted(plan: _ShiftPlan, v, S):
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
    return (num.view(B, H, n * C, V)[:, :, :T], den.view(B, H, n * C)[:, :, :T]), c, S, plan.mu_final


def _chunk_log(fq, fk, v, g, S, mu, s, log_space):
    """Causal chunk form in log-space, for exp-type feature maps and for diagonal gates.

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
    c_in = _row_scale(x, (-2, -1)) if log_space else None
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
        c_st = _row_scale(x_st, -1)
        c = torch.maximum(c_in, c_st)
        o = o_in * torch.exp(c_in - c).unsqueeze(-1) \
            + (torch.exp(x_st - c.unsqueeze(-1)) @ starts)
        c = c.reshape(B, H, n * s)[:, :, :T]
    return o.reshape(B, H, n * s, V1)[:, :, :T], c, S, mu  # explicit sizes: B may be 0


def _final_state(fk, vt, glog, S, mu, log_space):
    """Final state of a sequence, by the block recurrence (used by the parallel form)."""
    if log_space or (glog is not None and glog.shape[-1] > 1):
        _, _, S, mu = _chunk_log(torch.zeros_like(fk), fk, vt, glog, S, mu, LOG_BLOCK, log_space)
        return S, mu
    _, _, S, _ = _chunk_matmul(torch.zeros_like(fk), fk, vt[..., :-1], glog, S, 64)
    return S, None


# ----------------------------------------------------------------------------------------------
# Validate and prepare once
# ----------------------------------------------------------------------------------------------

@dataclass
class LinearProblem:
    """One validated `linear_attention` call, ready for a backend. Tensors q, k, v are the caller's
    ([B, T, H, *], any float dtype); `log_gate` is the decay as one log-gate in the compute dtype,
    [B, T, H] (scalar per head, also for a constant gamma) or [B, T, H, K_phi] (diagonal), or None."""
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    fmap: FeatureMap
    causal: bool
    normalize: bool
    log_gate: Optional[torch.Tensor]
    scale: float
    mode: str
    chunk_size: int
    eps: float
    offsets: Optional[List[int]]
    N: int
    Kf: int
    state: Optional[LinearAttentionState]
    offset0: torch.Tensor
    output_final_state: bool
    #: grouped value heads (`prepare_linear_attention`): the caller's v had HV = value_groups * H heads; folded:
    #: they are folded into the value width here (v [B, T, H, n V], `finish` unfolds), else q, k (and a gate
    #: given per q/k head) were repeated to HV heads
    value_groups: int = 1
    folded: bool = False

    @property
    def diagonal_gate(self) -> bool:
        return self.log_gate is not None and self.log_gate.dim() == 4

    cpu_kernel = "linear"  # the compiled CPU library (linattn/cpu/csrc/linear.c)

    def cpu_unsupported(self) -> Optional[str]:
        """Why the compiled CPU kernels do not cover this call (None when they do): the causal chunk form of the
        linear-space maps with no gate or a scalar one; any float dtype (computed in fp32, fp64 for fp64)."""
        if self.q.device.type != "cpu":
            return f"the compiled kernels run on CPU tensors, not {self.q.device.type}"
        if self.mode != "chunk":
            return f"mode={self.mode!r} has no compiled CPU kernel (chunk has)"
        if not self.causal:
            return "causal=False has no compiled CPU kernel"
        if self.fmap.log_space:
            return f"log-space feature maps ({self.fmap.name}) have no compiled CPU kernel"
        if self.diagonal_gate:
            return "diagonal gates g [B, T, H, K] (GLA) have no compiled CPU kernel"
        if self.chunk_size > CPU_MAX_CHUNK:
            return f"chunk_size > {CPU_MAX_CHUNK} has no compiled CPU kernel"
        return None

    def triton_unsupported(self) -> Optional[str]:
        """Why the Triton kernels do not cover this call (None when they do)."""
        if self.q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"the kernels take fp16 / bf16 / fp32 inputs, not {self.q.dtype}"
        if self.mode not in ("chunk", "recurrent"):
            return f"mode={self.mode!r} has no Triton kernel (chunk and recurrent do)"
        if not self.causal:
            return "causal=False has no Triton kernel"
        if self.fmap.log_space:
            return f"log-space feature maps ({self.fmap.name}) have no Triton kernel"
        if self.diagonal_gate and self.mode != "recurrent":  # the decoding kernel takes them
            return "diagonal gates g [B, T, H, K] (GLA) have no Triton chunk kernel"
        if self.mode == "recurrent" and requires_grad(self.q, self.k, self.v, self.log_gate, *self._state_tensors()):
            return "the fused recurrent kernel is forward-only (decoding) and an input requires grad"
        return None

    def positions(self) -> torch.Tensor:
        """Absolute token positions [B or 1, T] (positional maps; a carried state continues them)."""
        T, dev = self.q.shape[1], self.q.device
        if self.offsets is None:
            return self.offset0.view(self.N, 1) + torch.arange(T, device=dev)
        return torch.cat([self.offset0[i] + torch.arange(b - a, device=dev)
                          for i, (a, b) in enumerate(zip(self.offsets[:-1], self.offsets[1:]))]).view(1, T)

    def features(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """phi(scale q) and psi(k) in `dtype`, [B, T, H, K_phi] (shared by both backends)."""
        q_c, k_c = self.q.to(dtype), self.k.to(dtype)
        if self.scale != 1.0:
            q_c = q_c * self.scale
        pos = self.positions() if self.fmap.positional else None
        fq, fk = self.fmap.phi(q_c, pos), self.fmap.psi(k_c, pos)
        B, T, H = self.q.shape[:3]
        if fq.shape != (B, T, H, self.Kf) or fk.shape != (B, T, H, self.Kf):
            raise LinattnError(f"feature map {self.fmap!r} must map [B, T, H, K] to [B, T, H, K_phi] for both "
                               f"phi and psi (K_phi = {self.Kf}); got {tuple(fq.shape)} and {tuple(fk.shape)}")
        return fq, fk

    def _state_tensors(self):
        return () if self.state is None else (self.state.kv, self.state.z)

    def chunk_size_used(self, backend: str) -> int:
        """The chunk length a backend really uses for this call (recurrent: 1, parallel: T)."""
        if self.mode == "recurrent":
            return 1
        if self.mode == "parallel" or not self.causal:
            return self.q.shape[1]
        if backend == "triton":
            return triton_chunk_size(self.chunk_size)
        if self.fmap.log_space or self.diagonal_gate:
            return min(self.chunk_size, LOG_BLOCK)
        return self.chunk_size


def _gate_to_log(gamma, g, B, T, H, Kf, dtype, device) -> Optional[torch.Tensor]:
    """gamma (float or [H]) or g ([B, T, H] / [B, T, H, Kf]) -> one log-gate [B, T, H(, Kf)], or None."""
    if gamma is not None:
        if isinstance(gamma, torch.Tensor):
            if gamma.dim() != 1 or gamma.shape[0] != H:
                raise LinattnError(f"gamma must be a float or a per-head tensor of shape [H] = [{H}], "
                                   f"got shape {tuple(gamma.shape)}")
            gam = gamma.to(device=device, dtype=dtype)
            if check_values(gam) and not bool(((gam > 0) & (gam <= 1)).all()):
                raise LinattnError(f"gamma is a decay and must lie in (0, 1], got {gam.tolist()}")
        elif isinstance(gamma, (int, float)) and not isinstance(gamma, bool):
            if not 0 < gamma <= 1:
                raise LinattnError(f"gamma is a decay and must lie in (0, 1], got {gamma}")
            gam = torch.full((H,), float(gamma), dtype=dtype, device=device)
        else:
            raise LinattnTypeError(f"gamma must be a float or a tensor of shape [H], got {type(gamma).__name__}")
        return torch.log(gam).view(1, 1, H).expand(B, T, H)
    if g is not None:
        check_log_gate(g, "g", B, T, H, Kf, allow_diagonal=True)
        if check_values(g) and not bool(torch.isfinite(g).all()):
            raise LinattnError("g must be finite (a log-gate of -inf would erase the state; use a large "
                               "negative value), as in delta_rule")
        # per-token log-gates below -LOG_GATE_FLOOR give exp() = 0 in every dtype either way; the floor keeps a
        # cumulative sum of gates near the dtype's lowest value from reaching -inf (then -inf - -inf = NaN)
        return g.to(device=device, dtype=dtype).clamp_min(-LOG_GATE_FLOOR)
    return None


def _check_state(state, N, H, Kf, V, log_space, device) -> None:
    if not isinstance(state, LinearAttentionState):
        raise LinattnTypeError(f"initial_state must be a linattn.LinearAttentionState (as returned with "
                               f"output_final_state=True), got {type(state).__name__}")
    if tuple(state.kv.shape) != (N, H, Kf, V):
        raise LinattnError(f"initial_state.kv must have shape [N, H, K_phi, V] = {(N, H, Kf, V)}, "
                           f"got {tuple(state.kv.shape)}")
    if tuple(state.z.shape) != (N, H, Kf):
        raise LinattnError(f"initial_state.z must have shape [N, H, K_phi] = {(N, H, Kf)}, "
                           f"got {tuple(state.z.shape)}")
    if log_space != (state.log_scale is not None):
        raise LinattnError("initial_state.log_scale must be a [N, H, K_phi] tensor for log-space feature maps "
                           "(hadamard_exp, favor+) and None for the others")
    if log_space and tuple(state.log_scale.shape) != (N, H, Kf):
        raise LinattnError(f"initial_state.log_scale must have shape [N, H, K_phi] = {(N, H, Kf)}, "
                           f"got {tuple(state.log_scale.shape)}")
    if tuple(state.offset.shape) != (N,):
        raise LinattnError(f"initial_state.offset must have shape [N] = [{N}], got {tuple(state.offset.shape)}")
    for name in ("kv", "z", "log_scale", "offset"):
        t = getattr(state, name)
        if t is not None and t.device != device:
            raise LinattnError(f"initial_state.{name} must be on the device of q ({device}), got {t.device}")


def prepare_linear_attention(q, k, v, *, feature_map="elu+1", causal=True, normalize=True, gamma=None, g=None,
                             scale=None, mode="chunk", chunk_size=64, initial_state=None,
                             output_final_state=False, cu_seqlens=None, eps=1e-6) -> LinearProblem:
    """Every check of `linear_attention`, once; returns the prepared call (see `LinearProblem`)."""
    n = value_groups(q, v)
    folded = False
    if n > 1:
        # grouped value heads: a gate shared by the n value heads of a q/k head (none, g [B, T, H(, K_phi)],
        # a float or [H] gamma) leaves one weight matrix per q/k head, so the n value heads are folded into the
        # value width (no copy of q or k; the normaliser is per q/k head anyway). A gate per value head, or a
        # carried state (whose z, log_scale are kept per value head), repeats q and k to HV heads instead.
        H = q.shape[2]
        shared = ((g is None or (isinstance(g, torch.Tensor) and g.dim() >= 3 and g.shape[2] == H))
                  and (not isinstance(gamma, torch.Tensor) or tuple(gamma.shape) == (H,)))
        if shared and initial_state is None:
            v, folded = v.reshape(*v.shape[:2], H, n * v.shape[3]), True
        else:
            q, k = q.repeat_interleave(n, dim=2), k.repeat_interleave(n, dim=2)
            if isinstance(g, torch.Tensor) and g.dim() >= 3 and g.shape[2] == H:
                g = g.repeat_interleave(n, dim=2)
            if isinstance(gamma, torch.Tensor) and tuple(gamma.shape) == (H,):
                gamma = gamma.repeat_interleave(n)
    B, T, H, K, V = check_qkv(q, k, v)
    if V == 0:
        raise LinattnError(f"v must have shape [B, T, H, V] with V >= 1, got {tuple(v.shape)}")
    check_mode(mode, chunk_size)
    fmap = get_feature_map(feature_map, K)
    if not causal:
        if gamma is not None or g is not None:
            raise LinattnError("forget gates (gamma, g) need causal=True: a decay is defined along the causal order")
        if mode == "recurrent":
            raise LinattnError("mode='recurrent' needs causal=True; use 'chunk' or 'parallel' for "
                               "bidirectional attention")
    if gamma is not None and g is not None:
        raise LinattnError("pass either gamma (constant decay) or g (data-dependent log-gate), not both")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0:
        raise LinattnError(f"eps must be a non-negative float, got {eps!r}")
    scale = check_scale(scale, 1.0)
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    N = B if offsets is None else len(offsets) - 1
    Kf = fmap.feature_dim(K)
    log_gate = _gate_to_log(gamma, g, B, T, H, Kf, compute_dtype(q.dtype), q.device)
    if initial_state is not None:
        _check_state(initial_state, N, H, Kf, V, fmap.log_space, q.device)
        offset0 = initial_state.offset.to(torch.int64)
    else:
        offset0 = torch.zeros(N, dtype=torch.int64, device=q.device)
    return LinearProblem(q, k, v, fmap, bool(causal), bool(normalize), log_gate, scale, mode, chunk_size,
                         float(eps), offsets, N, Kf, initial_state, offset0, bool(output_final_state), n, folded)


# ----------------------------------------------------------------------------------------------
# The PyTorch backend
# ----------------------------------------------------------------------------------------------

def _with_ones(x):
    return torch.cat([x, torch.ones_like(x[..., :1])], dim=-1)


def _run_form(p: LinearProblem, fq, fk, vt, glog, S, mu):
    """One sequence (or a batch of equal-length ones) in the [B, H, T, D] layout -> (o, c, S, mu);
    o is (num, den) on the matmul path and [.., V + 1] (numerator | denominator) otherwise."""
    log_space = p.fmap.log_space
    if p.causal and p.mode == "chunk" and not p.diagonal_gate:
        if not log_space:
            return _chunk_matmul(fq, fk, vt, glog, S, p.chunk_size)
        if not fk.is_cuda and not torch.compiler.is_compiling():  # as before: a CPU, eager-mode path
            shifted = _log_chunk_matmul(fq, fk, vt, glog, S, mu, p.chunk_size)
            if shifted is not None:
                return shifted
    vt = _with_ones(vt)
    if p.mode == "parallel":
        o, c, _, _ = _parallel(fq, fk, vt, glog, S, mu, p.causal, log_space)
        # the quadratic form has no state of its own: compute it only when asked for
        if not p.output_final_state:
            S, mu = None, None
        elif p.causal:
            S, mu = _final_state(fk, vt, glog, S, mu, log_space)
        else:
            S, mu = _bidirectional(fq, fk, vt, S, mu)[2:]
        return o, c, S, mu
    if not p.causal:
        return _bidirectional(fq, fk, vt, S, mu)
    if p.mode == "recurrent":
        return _recurrent(fq, fk, vt, glog, S, mu)
    return _chunk_log(fq, fk, vt, glog, S, mu, min(p.chunk_size, LOG_BLOCK), log_space)


def _log_chunk_matmul(fq, fk, vt, glog, S, mu, C):
    """The log-space matmul path, with every row it cannot represent taken from the block path
    (rows are chosen by a causal, row-local test, see `_shift_plan`); None when no row qualifies."""
    plan = _shift_plan(fq, fk, glog, mu, C)
    if not bool(plan.valid.any()):
        return None
    (num, den), c, S_out, mu_out = _chunk_shifted(plan, vt, S)
    if not bool(plan.valid.all()):  # rare: huge spans of key log-features, or non-finite keys
        o, c_b, _, _ = _chunk_log(fq, fk, _with_ones(vt), glog, S, mu, min(C, LOG_BLOCK), True)
        V = vt.shape[-1]
        ok = plan.valid
        num = torch.where(ok.unsqueeze(-1), num, o[..., :V])
        den, c = torch.where(ok, den, o[..., V]), torch.where(ok, c, c_b)
    return (num, den), c, S_out, mu_out


def _fast_chunk(p: LinearProblem) -> bool:
    """Whether the call takes the fast chunk form (ops/linear_chunk.py): causal, chunk mode, linear-space
    features, no gate, eager mode (under torch.compile the autograd form traces into one graph)."""
    return (p.causal and p.mode == "chunk" and p.log_gate is None and not p.fmap.log_space
            and not torch.compiler.is_compiling())


def _run_fast_chunk(p: LinearProblem, cdt):
    """`_run_torch` on the fast chunk form; the maps with an in-kernel form are applied inside it."""
    V = p.v.shape[-1]
    fused = p.fmap.fused_kernel if (p.fmap.fused_kernel in FUSED and not p.fmap.positional) else None
    if fused is not None:
        xq, xk = p.q.to(cdt), p.k.to(cdt)
        if p.scale != 1.0:
            xq = xq * p.scale
    else:
        xq, xk = p.features(cdt)
    v = p.v.to(cdt)
    H = p.q.shape[2]
    if p.state is not None:
        S0 = torch.cat([p.state.kv, p.state.z.unsqueeze(-1)], dim=-1).to(cdt)
    else:
        S0 = torch.zeros(p.N, H, p.Kf, V + 1, dtype=cdt, device=p.q.device)
    if p.offsets is None:
        (num, den), S = linear_chunk(xq, xk, v, S0, p.chunk_size, fused)
        return num, den, None, S, None
    nums, dens, Ss = [], [], []
    for i, (a, b) in enumerate(zip(p.offsets[:-1], p.offsets[1:])):
        (num, den), S = linear_chunk(xq[:, a:b], xk[:, a:b], v[:, a:b], S0[i:i + 1], p.chunk_size, fused)
        nums.append(num), dens.append(den), Ss.append(S)
    return torch.cat(nums, dim=2), torch.cat(dens, dim=2), None, torch.cat(Ss), None


def _run_torch(p: LinearProblem):
    """-> (num [B, H, T, V], den [B, H, T], c [B, H, T] or None, S [N, H, Kf, V + 1], mu)."""
    cdt = compute_dtype(p.q.dtype)
    V = p.v.shape[-1]
    if _fast_chunk(p):
        return _run_fast_chunk(p, cdt)
    fq, fk = p.features(cdt)
    fq, fk, vt = fq.transpose(1, 2), fk.transpose(1, 2), p.v.to(cdt).transpose(1, 2)
    glog = None
    if p.log_gate is not None:  # [B, T, H(, Kf)] -> [B, H, T, 1 or Kf]
        glog = p.log_gate.unsqueeze(-1) if p.log_gate.dim() == 3 else p.log_gate
        glog = glog.transpose(1, 2)
    if p.state is not None:
        S0 = torch.cat([p.state.kv, p.state.z.unsqueeze(-1)], dim=-1).to(cdt)
        mu0 = p.state.log_scale.to(cdt) if p.fmap.log_space else None
    else:
        S0 = torch.zeros(p.N, fq.shape[1], p.Kf, V + 1, dtype=cdt, device=fq.device)
        mu0 = torch.full((p.N, fq.shape[1], p.Kf), NEG, dtype=cdt, device=fq.device) if p.fmap.log_space else None

    def split(o):
        return o if isinstance(o, tuple) else (o[..., :V], o[..., V])

    if p.offsets is None:
        o, c, S, mu = _run_form(p, fq, fk, vt, glog, S0, mu0)
        num, den = split(o)
        return num, den, c, S, mu
    nums, dens, cs, Ss, mus = [], [], [], [], []
    for i, (a, b) in enumerate(zip(p.offsets[:-1], p.offsets[1:])):
        o, c, S, mu = _run_form(p, fq[:, :, a:b], fk[:, :, a:b], vt[:, :, a:b],
                                glog[:, :, a:b] if glog is not None else None,
                                S0[i:i + 1], mu0[i:i + 1] if mu0 is not None else None)
        num, den = split(o)
        nums.append(num), dens.append(den), cs.append(c), Ss.append(S), mus.append(mu)
    c = torch.cat(cs, dim=2) if p.fmap.log_space else None
    S = torch.cat(Ss) if p.output_final_state else None
    mu = torch.cat(mus) if (p.output_final_state and p.fmap.log_space) else None
    return torch.cat(nums, dim=2), torch.cat(dens, dim=2), c, S, mu


def _divide_finite_part(num, den):
    """num / den, whose backward stays finite where num is inf or NaN but its gradient is 0 (rows after
    a non-finite token that the loss does not use): autograd's d/d den = -grad * num / den^2 would be
    0 * NaN there and would carry NaN into every earlier key through den. The same values as num / den."""
    if _reads_values(num) and bool(torch.isfinite(num.sum())):
        return num / den
    safe = torch.nan_to_num(num, nan=0.0, posinf=0.0, neginf=0.0)
    return safe / den + (num - safe)


def _den_floor(den, eps: float):
    """den floored to |den| >= eps keeping its sign (relu features, magnitude_direction's signed weights)."""
    floor = torch.as_tensor(eps, dtype=den.dtype, device=den.device)
    return torch.where(den < 0, torch.minimum(den, -floor), torch.maximum(den, floor))


class _FlooredDivide(torch.autograd.Function):
    """o = num / floor(den) with a lean backward for finite num (the compiled CPU path's outputs under autograd):
    d num = do / den', d den = -(do . o) / den' where |den| > eps (the floor's own slope), 3 passes over the
    output instead of autograd's ~7 for num / den'. The same forward bits as `finish`'s division."""

    @staticmethod
    def forward(ctx, num, den, eps):
        d = _den_floor(den, eps).unsqueeze(-1)
        out = num / d
        ctx.save_for_backward(out, d, (den > eps) | (den < -eps))
        return out

    @staticmethod
    def backward(ctx, do):
        out, d, mask = ctx.saved_tensors
        dnum = do / d
        dden = (dnum * out).sum(-1).neg_().masked_fill_(~mask, 0)
        return dnum, dden, None


def finish(p: LinearProblem, num, den, c, kv, z, mu, divided: bool = False,
           lean_grad: bool = False) -> Tuple[torch.Tensor, Optional[LinearAttentionState]]:
    """Outputs [B, T, H, V] in the input dtype from num [B, T, H, V] and den [B, T, H] (both taken
    relative to the row log-scale c [B, T, H] for log-space maps), and the final state. divided: num is already
    the normalised output (the compiled CPU kernel's lin_divide does this division, bit for bit). lean_grad:
    divide finite num through `_FlooredDivide` (the compiled path; the PyTorch forms keep autograd's division)."""
    if p.normalize and divided:
        out = num
    elif p.normalize:
        if c is not None:
            # log-space maps: den is the stabilised denominator (>= 1 for their positive kernels), so eps
            # acts on it and the output is invariant to a shift of the queries
            den = den.clamp_min(p.eps)
        else:  # a floor on |den| that keeps its sign (relu features, magnitude_direction's signed weights)
            if lean_grad and _reads_values(num) and bool(torch.isfinite(num.detach().sum())):
                out = _FlooredDivide.apply(num, den, p.eps)
                den = None
            else:
                den = _den_floor(den, p.eps)
        if den is not None:
            out = _divide_finite_part(num, den.unsqueeze(-1))
    else:
        # exp(c) alone may overflow fp32 where the product does not: rescale in fp64
        out = num if c is None else (num.double() * torch.exp(c.double()).unsqueeze(-1)).to(num.dtype)
    state = None
    if p.output_final_state:
        T = p.q.shape[1]
        seq_lens = (torch.tensor([b - a for a, b in zip(p.offsets[:-1], p.offsets[1:])], device=p.q.device)
                    if p.offsets is not None else T)
        state = LinearAttentionState(kv=kv, z=z, log_scale=mu, offset=p.offset0 + seq_lens)
    if p.folded:  # back to the caller's HV = n H value heads (`prepare_linear_attention`)
        n = p.value_groups
        out = out.reshape(*out.shape[:2], out.shape[2] * n, out.shape[3] // n)
        if state is not None:
            N, H, Kf, nV = state.kv.shape
            kv = state.kv.reshape(N, H, Kf, n, nV // n).transpose(2, 3).reshape(N, H * n, Kf, nV // n)
            state = state._replace(kv=kv, z=state.z.repeat_interleave(n, dim=1),
                                   log_scale=None if mu is None else mu.repeat_interleave(n, dim=1))
    return out.to(p.q.dtype), state


def run_linear_attention(p: LinearProblem, backend: str = "auto"):
    """Run a prepared call on `backend` ("auto", "torch", "triton" or "cpu")."""
    chosen = select_backend(backend, p)
    if chosen == "cpu":  # without autograd the kernel divides by the normaliser itself (one pass less)
        num, den, kv, z, divided = cpu_linear_attention(p, eps=p.eps if p.normalize else None)
        return finish(p, num, den, None, kv, z, None, divided=divided, lean_grad=True)
    if chosen == "triton":
        num, den, kv, z = triton_linear_attention(p)
        return finish(p, num, den, None, kv, z, None)
    # the forms compute in the prepared compute dtype (fp32 for half inputs): autocast must not take their
    # products back to bf16/fp16 (nor meet the fast form's in-place products)
    with torch.autocast(p.q.device.type, enabled=False):
        num, den, c, S, mu = _run_torch(p)
        V = p.v.shape[-1]
        kv, z = (S[..., :V], S[..., V]) if S is not None else (None, None)
        num, den = num.transpose(1, 2), den.transpose(1, 2)  # [B, H, T, *] -> [B, T, H, *]
        return finish(p, num, den, c.transpose(1, 2) if c is not None else None, kv, z, mu)


def linear_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    feature_map: Union[str, FeatureMap, None] = "elu+1",
    causal: bool = True,
    normalize: bool = True,
    gamma: Union[float, torch.Tensor, None] = None,
    g: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    mode: str = "chunk",
    chunk_size: int = 64,
    initial_state: Optional[LinearAttentionState] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    backend: str = "auto",
) -> Tuple[torch.Tensor, Optional[LinearAttentionState]]:
    """Kernelized linear attention, optionally gated (RetNet, Mamba2 / simple GLA, GLA), causal or not.

    Weights w_ij = k(scale * q_i, k_j) = phi(scale * q_i) . psi(k_j), times the decay
    prod_{t=j+1..i} exp(g_t) when a gate is given (RetNet: constant `gamma` in (0, 1], a float
    or per-head `[H]`; Mamba2 / simple GLA: `g` `[B, T, H]`; GLA: `g` `[B, T, H, K_phi]`, a
    log-gate <= 0 per feature). Gates are causal only; the normaliser decays with the numerator.

    normalize=True: o_i = sum_j w_ij v_j / den_i with den_i = sum_j w_ij; eps is a floor on |den|
    (sign kept): outputs are the exact ratio whenever |den| >= eps and stay finite when it
    vanishes (relu features before any active key, or magnitude_direction's negative weights).
    For log-space maps (hadamard_exp, favor+) eps floors the stabilised denominator, which is >= 1,
    so the output is the exact ratio and does not change when a constant is added to the queries.
    normalize=False: the plain sum (it overflows only when the true value exceeds the dtype).

    Grouped value heads (Mamba2's groups, GVA): v `[B, T, HV, V]` with HV = n * H; value head j reads q/k head
    j // n (transformers' repeat_interleave). A gate may be per q/k head (g `[B, T, H(, K_phi)]`, gamma a float
    or `[H]`: shared by the group) or per value head (`[B, T, HV(, K_phi)]`, `[HV]`). The state is per value head,
    kv `[N, HV, K_phi, V]`, z and log_scale `[N, HV, K_phi]`. With a shared gate and no initial state the n value
    heads are folded into the value width (q, k are not copied); otherwise q and k are repeated to HV heads.

    Inputs of any float dtype; accumulation in fp32 (fp64 for fp64 inputs); output in the input dtype.

    Args:
        q: Queries `[B, T, H, K]`, any float dtype (fp16, bf16, fp32, fp64).
        k: Keys `[B, T, H, K]`, the dtype of q.
        v: Values `[B, T, H, V]` (or `[B, T, HV, V]`, grouped value heads).
        feature_map: The kernel's phi/psi pair: a name in `FEATURE_MAP_NAMES` (e.g. "elu+1", "relu",
            "hadamard_exp", "favor+"), a `FeatureMap` instance, or None (identity).
        causal: Attend to earlier keys only (j <= i). Gates and mode="recurrent" need causal=True.
        normalize: Divide by the kernel's row sum (above); False: the plain weighted sum.
        gamma: RetNet's constant decay in (0, 1]: a float, or per head `[H]` (or `[HV]`).
        g: A log-gate (<= 0): `[B, T, H]` per head (Mamba2 / simple GLA) or `[B, T, H, K_phi]` per feature
            (GLA); or None.
        scale: The query scale; None means 1 (the kernel of the raw queries; pass K**-0.5 for softmax-like
            temperature).
        mode: The form: "chunk" (training), "recurrent" (decoding; causal only), "parallel" (quadratic
            reference). They compute the same function (to rounding).
        chunk_size: The chunk length of the chunk form, in tokens (see `chunk_size_used`).
        initial_state: A `LinearAttentionState` to start from (a previous call's, from any mode), or None.
        output_final_state: Also return the state after the last token.
        cu_seqlens: int64 `[N+1]` offsets of N packed independent sequences (B == 1); the state then has N rows.
        eps: The floor on |den| (above).
        backend: "auto" (Triton kernels for CUDA tensors when Triton is installed and covers the call, the
            compiled CPU kernels for CPU tensors when they build and cover it, PyTorch otherwise), "torch",
            "triton" (on CPU only under TRITON_INTERPRET=1; see docs/triton.md) or "cpu" (see
            docs/cpu_kernels.md).

    Returns:
        o: The output `[B, T, H, V]` (or `[B, T, HV, V]`), in the input dtype.
        final_state: With output_final_state, the `LinearAttentionState` after the last token (fp32, fp64 for
            fp64 inputs; N rows), which round-trips between modes and calls; otherwise None.

    Raises:
        LinattnError: An argument of the wrong shape, dtype or value (the message names it), or finite inputs
            whose kernel values or sums exceed the dtype.

    Examples:
        >>> import torch
        >>> from linattn import linear_attention
        >>> B, T, H, K, V = 2, 10, 4, 16, 32
        >>> q, k, v = torch.randn(B, T, H, K), torch.randn(B, T, H, K), torch.randn(B, T, H, V)
        >>> o, state = linear_attention(q, k, v, feature_map="elu+1", output_final_state=True)
        >>> o.shape, state.kv.shape, state.z.shape
        (torch.Size([2, 10, 4, 32]), torch.Size([2, 4, 16, 32]), torch.Size([2, 4, 16]))

        The forms agree, and a state carries a sequence across calls:

        >>> o_rec, _ = linear_attention(q, k, v, mode="recurrent")
        >>> torch.allclose(o, o_rec, atol=1e-5)
        True
        >>> o1, s1 = linear_attention(q[:, :4], k[:, :4], v[:, :4], output_final_state=True)
        >>> o2, _ = linear_attention(q[:, 4:], k[:, 4:], v[:, 4:], initial_state=s1)
        >>> torch.allclose(torch.cat([o1, o2], 1), o, atol=1e-5)
        True

        RetNet's decay, and GLA's per-feature gate:

        >>> o, _ = linear_attention(q, k, v, feature_map="identity", normalize=False, gamma=0.9, scale=K ** -0.5)
        >>> o, _ = linear_attention(q, k, v, g=-torch.rand(B, T, H, K))
    """
    p = prepare_linear_attention(q, k, v, feature_map=feature_map, causal=causal, normalize=normalize, gamma=gamma,
                                 g=g, scale=scale, mode=mode, chunk_size=chunk_size, initial_state=initial_state,
                                 output_final_state=output_final_state, cu_seqlens=cu_seqlens, eps=eps)
    # finite inputs whose kernel values or sums exceed the dtype: a clear error, not NaN (issue 33.4)
    return check_finite_output(run_linear_attention(p, backend), "linear_attention", q=q, k=k, v=v)
