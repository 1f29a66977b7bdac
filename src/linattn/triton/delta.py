"""Triton kernels for the delta rule (`delta_rule`: DeltaNet, Gated DeltaNet, EFLA): the chunk form
with the WY / UT representation (forward and backward) and a fused recurrent form for decoding
(forward only).

The operator's preprocessing (qk_l2norm, scale, the EFLA coefficient and the key-norm rescaling
k~ = k/d, v~ = v/d, a~ = a d^2) runs once in PyTorch, differentiably, in `ops/delta_core.py`, for
both backends; the kernels take the resulting q, k~, v~, a~ (called b here) and the scalar log-gate g. Layout [TT, H, D]
as in `linear.py` (packed sequences, chunks of BT tokens that never cross a sequence boundary).

Per chunk, with G the gate's cumulative sum local to the chunk, Gam_ij = exp(G_i - G_j) and h the
state entering the chunk (see the algebra in ops/delta.py):

    A     = tril_-1(diag(b) (K K^T * Gam)),   Tm = (I + A)^-1           (`_wy_fwd`: forward substitution)
    U~    = Tm diag(b) V,  W~ = Tm diag(b e^G) K                         (`_wy_fwd`, tl.dot)
    U     = U~ - W~ h                                                      (`_delta_fwd_h`, sequential
    h'    = e^{G_l} h + (K e^{G_l - G})^T U                                 over the chunks, h materialised)
    O     = (Q e^G) h + (Q K^T * Gam * M) U                                (common.py's `_fwd_o`, parallel)

Backward (recomputing Tm, U~, W~, h and U): dU_local = (Q K^T * Gam * M)^T dO (common.py's `_bwd_dv`);
`_delta_bwd_dh` walks the chunks in reverse: dU = dU_local + K_dec dh', dh = e^{G_l} dh' + (Q e^G)^T dO
- W~^T dU; `_delta_bwd_dqkw` gives dq, the attention part of dk, dW~ = -dU h^T and the gate terms;
`_wy_bwd` back-propagates through the UT transform (dTm -> dA = -Tm^T dTm Tm^T) to dv, db, the rest
of dk and of the gate gradient, then takes the chunk-local reverse cumulative sum of dG.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import triton_chunk_size
from .common import (
    FMAP_IDENTITY,
    KernelConfig,
    absent,
    block,
    chunk_bwd_dv,
    chunk_fwd_o,
    chunk_tokens,
    dot_precision,
    dummy,
    full_block,
    group_sum,
    heads,
    prepare_chunks,
)

# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _wy_fwd(k, v, b, g, Tm, u, w, cu, chunk_index,
            H, HQ, K, V,
            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, PREC: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
    b_b = tl.load(b + tok * H + i_h, mask=m_t, other=0.).to(tl.float32)  # padding: b = 0
    if USE_G:
        b_G = tl.cumsum(tl.load(g + tok * H + i_h, mask=m_t, other=0.), axis=0)

    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_A += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    strict = o_i[:, None] > o_i[None, :]
    if USE_G:
        b_A = b_A * tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], float("-inf")))
    else:
        b_A = tl.where(strict, b_A, 0.)
    b_A = b_A * b_b[:, None]
    # Tm = (I + A)^-1 by forward substitution: row i = e_i - sum_{j<i} A_ij Tm_j
    b_T = tl.where(o_i[:, None] == o_i[None, :], 1., 0.)
    for i in range(1, BT):
        b_a = tl.sum(tl.where(o_i[:, None] == i, b_A, 0.), axis=0)
        b_r = tl.sum(b_a[:, None] * b_T, axis=0)
        b_T = tl.where(o_i[:, None] == i, b_T - b_r[None, :], b_T)
    tl.store(Tm + (tok[:, None] * H + i_h) * BT + o_i[None, :], b_T, mask=m_t[:, None])

    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_u = tl.dot(b_T, b_v * b_b[:, None], input_precision=PREC)
        tl.store(u + (tok[:, None] * H + i_h) * V + o_v[None, :], b_u, mask=m_tv)
    if USE_G:
        b_bg = b_b * tl.exp(b_G)
    else:
        b_bg = b_b
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_w = tl.dot(b_T, b_k * b_bg[:, None], input_precision=PREC)
        tl.store(w + (tok[:, None] * H + i_h) * K + o_k[None, :], b_w, mask=m_tk)


@triton.jit
def _delta_fwd_h(k, u, w, g, h, vn, h0, ht, cu, chunk_offsets,
                 H, HQ, K, V,
                 BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, GK: tl.constexpr,
                 USE_H0: tl.constexpr, STORE_HT: tl.constexpr, PREC: tl.constexpr):
    """The sequential part: one program per (V block, sequence x head) with the whole K."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    T = (eos - bos).to(tl.int32)
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + s_kv, mask=m_kv, other=0.)
    for i_c in range(0, NT):
        row = (boh + i_c) * H + i_h
        tl.store(h + row * K * V + s_kv, b_h, mask=m_kv)
        o_t = i_c * BT + tl.arange(0, BT)
        m_t = o_t < T
        tok = bos + o_t
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(w + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.)
        b_u = tl.load(u + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.)
        b_vn = b_u - tl.dot(b_w, b_h, input_precision=PREC)
        tl.store(vn + (tok[:, None] * H + i_h) * V + o_v[None, :], b_vn, mask=m_tv)
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        if USE_G:
            if GK:  # KDA: g [TT, H, K]; every exponent G_l - G_t <= 0
                b_g = tl.load(g + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.)
                b_G = tl.cumsum(b_g, axis=0)
                b_gl = tl.sum(b_g, axis=0)
                b_k = b_k * tl.exp(b_gl[None, :] - b_G)
                b_h = b_h * tl.exp(b_gl)[:, None]
            else:
                b_g = tl.load(g + tok * H + i_h, mask=m_t, other=0.)
                b_G = tl.cumsum(b_g, axis=0)
                b_gl = tl.sum(b_g, axis=0)
                b_k = b_k * tl.exp(b_gl - b_G)[:, None]
                b_h = b_h * tl.exp(b_gl)
        b_h += tl.dot(tl.trans(b_k), b_vn, input_precision=PREC)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + s_kv, b_h, mask=m_kv)


@triton.jit
def _delta_bwd_dh(q, k, w, g, do, dvl, dh, dvn, dht, dh0, cu, chunk_offsets,
                  H, HQ, K, V,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, GK: tl.constexpr,
                  USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, PREC: tl.constexpr):
    """Reverse walk: stores dh' (gradient of the state leaving each chunk) and dU."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    T = (eos - bos).to(tl.int32)
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_kv = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + s_kv, mask=m_kv, other=0.)
    for i in range(0, NT):
        i_c = NT - 1 - i
        row = (boh + i_c) * H + i_h
        tl.store(dh + row * K * V + s_kv, b_dh, mask=m_kv)
        o_t = i_c * BT + tl.arange(0, BT)
        m_t = o_t < T
        tok = bos + o_t
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_q = tl.load(q + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        if USE_G:
            if GK:  # KDA: g [TT, H, K]
                b_g = tl.load(g + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.)
                b_G = tl.cumsum(b_g, axis=0)
                b_gl = tl.sum(b_g, axis=0)
                b_k = b_k * tl.exp(b_gl[None, :] - b_G)
                b_q = b_q * tl.exp(b_G)
            else:
                b_g = tl.load(g + tok * H + i_h, mask=m_t, other=0.)
                b_G = tl.cumsum(b_g, axis=0)
                b_gl = tl.sum(b_g, axis=0)
                b_k = b_k * tl.exp(b_gl - b_G)[:, None]
                b_q = b_q * tl.exp(b_G)[:, None]
        b_dvn = tl.load(dvl + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.)
        b_dvn += tl.dot(b_k, b_dh, input_precision=PREC)
        tl.store(dvn + (tok[:, None] * H + i_h) * V + o_v[None, :], b_dvn, mask=m_tv)
        b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_w = tl.load(w + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.)
        if USE_G:
            if GK:
                b_dh = b_dh * tl.exp(b_gl)[:, None]
            else:
                b_dh = b_dh * tl.exp(b_gl)
        b_dh += tl.dot(tl.trans(b_q), b_do, input_precision=PREC) - tl.dot(tl.trans(b_w), b_dvn, input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + s_kv, b_dh, mask=m_kv)


@triton.jit
def _delta_bwd_dqkw(q, k, vn, g, h, do, dh, dvn, dq, dk, dw, dg, cu, chunk_index,
                    TT, H, HQ, K, V,
                    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
                    PREC: tl.constexpr):
    i_k, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    row = i_t.to(tl.int64) * H + i_h
    b_q = tl.load(q + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)

    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_vn = tl.load(vn + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.)
        b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_dvn = tl.load(dvn + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.)
        b_h = tl.load(h + row * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dh + row * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dA += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        b_dq += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dk += tl.dot(b_vn, tl.trans(b_dh), input_precision=PREC)
        b_dw -= tl.dot(b_dvn, tl.trans(b_h), input_precision=PREC)
        if USE_G:
            b_hdh += tl.sum(b_h * b_dh, axis=1)
    causal = o_i[:, None] >= o_i[None, :]
    if USE_G:
        b_g = tl.load(g + tok * H + i_h, mask=m_t, other=0.)
        b_G = tl.cumsum(b_g, axis=0)
        b_gl = tl.sum(b_g, axis=0)
        b_dq = b_dq * tl.exp(b_G)[:, None]
        b_dk = b_dk * tl.exp(b_gl - b_G)[:, None]
        b_dgl = tl.sum(b_hdh, axis=0) * tl.exp(b_gl) + tl.sum(tl.sum(b_k * b_dk, axis=1), axis=0)
        b_dA = b_dA * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf")))
    else:
        b_dA = tl.where(causal, b_dA, 0.)
    b_dq += tl.dot(b_dA, b_k, input_precision=PREC)
    b_dk += tl.dot(tl.trans(b_dA), b_q, input_precision=PREC)
    if USE_G:
        b_dG = tl.sum(b_q * b_dq, axis=1) - tl.sum(b_k * b_dk, axis=1)
        last = tl.minimum(T - i_c * BT, BT) - 1
        b_dG += tl.where(o_i == last, b_dgl, 0.)
        tl.store(dg + i_k.to(tl.int64) * TT * H + tok * H + i_h, b_dG, mask=m_t)
    tl.store(dq + (tok[:, None] * H + i_h) * K + o_k[None, :], b_dq, mask=m_tk)
    tl.store(dk + (tok[:, None] * H + i_h) * K + o_k[None, :], b_dk, mask=m_tk)
    tl.store(dw + (tok[:, None] * H + i_h) * K + o_k[None, :], b_dw, mask=m_tk)


@triton.jit
def _wy_bwd(k, v, b, g, Tm, dvn, dw, dk, dGin, dv, db, dg, cu, chunk_index,
            H, HQ, K, V,
            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, PREC: tl.constexpr):
    """Back through U~ = Tm diag(b) V, W~ = Tm diag(b e^G) K and Tm = (I + A)^-1; adds to dk in place."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
    b_b = tl.load(b + tok * H + i_h, mask=m_t, other=0.).to(tl.float32)
    eye = tl.where(o_i[:, None] == o_i[None, :], 1., 0.)
    b_T = tl.load(Tm + (tok[:, None] * H + i_h) * BT + o_i[None, :], mask=m_t[:, None], other=0.)
    b_T = tl.where(m_t[:, None], b_T, eye)
    strict = o_i[:, None] > o_i[None, :]
    if USE_G:
        b_G = tl.cumsum(tl.load(g + tok * H + i_h, mask=m_t, other=0.), axis=0)
        b_eG = tl.exp(b_G)
        b_dG = tl.load(dGin + tok * H + i_h, mask=m_t, other=0.)
        b_gam = tl.exp(tl.where(strict, b_G[:, None] - b_G[None, :], float("-inf")))
    else:
        b_eG = tl.full([BT], 1.0, tl.float32)
        b_gam = tl.where(strict, 1., 0.)
    b_bg = b_b * b_eG

    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_du = tl.load(dvn + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.)
        b_v = tl.load(v + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_dR = tl.dot(tl.trans(b_T), b_du, input_precision=PREC)
        tl.store(dv + (tok[:, None] * H + i_h) * V + o_v[None, :], b_dR * b_b[:, None], mask=m_tv)
        b_db += tl.sum(b_dR * b_v, axis=1)
        b_dT += tl.dot(b_du, tl.trans(b_v * b_b[:, None]), input_precision=PREC)
    b_KK = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_dw = tl.load(dw + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.)
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_dR = tl.dot(tl.trans(b_T), b_dw, input_precision=PREC)
        b_s = tl.sum(b_dR * b_k, axis=1)
        b_db += b_eG * b_s
        if USE_G:
            b_dG += b_bg * b_s
        b_dT += tl.dot(b_dw, tl.trans(b_k * b_bg[:, None]), input_precision=PREC)
        b_KK += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    # Tm = (I + A)^-1  =>  dA = -Tm^T dTm Tm^T, on the strictly lower triangle
    b_dA = -tl.dot(tl.dot(tl.trans(b_T), b_dT, input_precision=PREC), tl.trans(b_T), input_precision=PREC)
    b_dA = tl.where(strict, b_dA, 0.)
    b_KG = b_KK * b_gam
    b_db += tl.sum(b_dA * b_KG, axis=1)
    b_E = b_dA * b_gam * b_b[:, None]
    if USE_G:
        b_dAA = b_dA * b_KG * b_b[:, None]
        b_dG += tl.sum(b_dAA, axis=1) - tl.sum(b_dAA, axis=0)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_dk = dk + (tok[:, None] * H + i_h) * K + o_k[None, :]
        b_dw = tl.load(dw + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.)
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_dR = tl.dot(tl.trans(b_T), b_dw, input_precision=PREC)
        b_dk = tl.load(p_dk, mask=m_tk, other=0.) + b_dR * b_bg[:, None]
        b_dk += tl.dot(b_E, b_k, input_precision=PREC) + tl.dot(tl.trans(b_E), b_k, input_precision=PREC)
        tl.store(p_dk, b_dk, mask=m_tk)
    tl.store(db + tok * H + i_h, b_db, mask=m_t)
    if USE_G:
        tl.store(dg + tok * H + i_h, tl.cumsum(b_dG, axis=0, reverse=True), mask=m_t)


# ----------------------------------------------------------------------------------------------
# KDA (per-channel log gates g [TT, H, K]) in the chunk form. With G [BT, K] the chunk-local cumulative
# sum, the intra-chunk pairs need sum_d x_td y_id exp(G_td - G_id): no factorisation into exp(G_t) and
# exp(-G_i) (the second overflows fp32 from G < -88, i.e. a few tokens of strong gates). Each pair's
# exponent is formed explicitly over [BT, BT, BK] (`_pair_decay`), masked to the causal pairs where it is
# <= 0, so nothing overflows for any gate strength; the tile is KDA_CHUNK tokens to bound that cube.
# Everything else (the state walk, U~, W~, Q e^G, K e^{G_l - G}) only ever sees exponents <= 0 too.
# ----------------------------------------------------------------------------------------------

KDA_CHUNK = 16  # the token tile with per-channel gates: the pair decays cost BT^2 * K per chunk
KDA_BK = 32     # the K tile of the KDA kernels: the pair-decay cube [BT, BT, BK] lives in registers


def _kda_bk(K: int) -> int:
    return block(K, cap=KDA_BK)


@triton.jit
def _pair_decay(x, y, Gx, Gy, keep):
    """M_ti = sum_d x_td y_id exp(Gx_td - Gy_id) on the pairs `keep` [BT, BT] (else 0); x, y, Gx, Gy [BT, BK]."""
    e = tl.exp(tl.where(keep[:, :, None], Gx[:, None, :] - Gy[None, :, :], float("-inf")))
    return tl.sum(x[:, None, :] * y[None, :, :] * e, axis=2)


@triton.jit
def _pair_decay_bwd(W, x, y, Gx, Gy, keep):
    """Given W = dM: (dx, dy) of `_pair_decay`; the gates' gradients follow as x dx (Gx) and -y dy (Gy)."""
    We = W[:, :, None] * tl.exp(tl.where(keep[:, :, None], Gx[:, None, :] - Gy[None, :, :], float("-inf")))
    return tl.sum(We * y[None, :, :], axis=1), tl.sum(We * x[:, None, :], axis=0)


@triton.jit
def _kda_wy_fwd(k, v, b, g, Tm, u, w, cu, chunk_index,
                H, HQ, K, V,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """A = tril_-1(diag(b) (sum_d k k e^{G - G})), Tm = (I + A)^-1, U~ = Tm diag(b) V, W~ = Tm diag(b) (K e^G)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (H // HQ)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
    b_b = tl.load(b + tok * H + i_h, mask=m_t, other=0.).to(tl.float32)
    strict = o_i[:, None] > o_i[None, :]
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_G = tl.cumsum(tl.load(g + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.), axis=0)
        b_A += _pair_decay(b_k, b_k, b_G, b_G, strict)
    b_A = b_A * b_b[:, None]
    b_T = tl.where(o_i[:, None] == o_i[None, :], 1., 0.)
    for i in range(1, BT):
        b_a = tl.sum(tl.where(o_i[:, None] == i, b_A, 0.), axis=0)
        b_r = tl.sum(b_a[:, None] * b_T, axis=0)
        b_T = tl.where(o_i[:, None] == i, b_T - b_r[None, :], b_T)
    tl.store(Tm + (tok[:, None] * H + i_h) * BT + o_i[None, :], b_T, mask=m_t[:, None])
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(v + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_u = tl.dot(b_T, b_v * b_b[:, None], input_precision=PREC)
        tl.store(u + (tok[:, None] * H + i_h) * V + o_v[None, :], b_u, mask=m_tv)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_G = tl.cumsum(tl.load(g + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.), axis=0)
        b_w = tl.dot(b_T, b_k * tl.exp(b_G) * b_b[:, None], input_precision=PREC)
        tl.store(w + (tok[:, None] * H + i_h) * K + o_k[None, :], b_w, mask=m_tk)


@triton.jit
def _kda_fwd_o(q, k, vn, g, h, o, cu, chunk_index,
               H, HQ, K, V,
               BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """O = (Q e^G) h + M U with M_ti = sum_d q_td k_id e^{G_td - G_id} (i <= t)."""
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (H // HQ)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    row = i_t.to(tl.int64) * H + i_h
    causal = o_i[:, None] >= o_i[None, :]
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_M = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_G = tl.cumsum(tl.load(g + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.), axis=0)
        b_h = tl.load(h + row * K * V + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.)
        b_o += tl.dot(b_q * tl.exp(b_G), b_h, input_precision=PREC)
        b_M += _pair_decay(b_q, b_k, b_G, b_G, causal)
    b_u = tl.load(vn + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.)
    b_o += tl.dot(b_M, b_u, input_precision=PREC)
    tl.store(o + (tok[:, None] * H + i_h) * V + o_v[None, :], b_o, mask=m_tv)


@triton.jit
def _kda_bwd_dv(q, k, g, do, dv, cu, chunk_index,
                H, HQ, K, V,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """The intra-chunk gradient of the pseudo-values, M^T dO."""
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (H // HQ)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    causal = o_i[:, None] >= o_i[None, :]
    b_M = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_q = tl.load(q + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_G = tl.cumsum(tl.load(g + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.), axis=0)
        b_M += _pair_decay(b_q, b_k, b_G, b_G, causal)
    b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
    tl.store(dv + (tok[:, None] * H + i_h) * V + o_v[None, :], tl.dot(tl.trans(b_M), b_do, input_precision=PREC),
             mask=m_tv)


@triton.jit
def _kda_bwd_dqkw(q, k, vn, g, h, do, dh, dvn, dq, dk, dw, dg, cu, chunk_index,
                  H, HQ, K, V,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """dq, the output's and the state's part of dk, dW~ = -dU h^T and the gate gradient w.r.t. the chunk-local
    cumulative G (per channel: each K tile owns its columns of dG)."""
    i_k, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (H // HQ)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    row = i_t.to(tl.int64) * H + i_h
    b_q = tl.load(q + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_g = tl.load(g + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.)
    b_G = tl.cumsum(b_g, axis=0)
    b_gl = tl.sum(b_g, axis=0)  # G at the chunk's last token (padding rows add 0)

    b_dM = tl.zeros([BT, BT], dtype=tl.float32)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_vn = tl.load(vn + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.)
        b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_dvn = tl.load(dvn + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.)
        b_h = tl.load(h + row * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dh + row * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dM += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)
        b_dq += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dk += tl.dot(b_vn, tl.trans(b_dh), input_precision=PREC)
        b_dw -= tl.dot(b_dvn, tl.trans(b_h), input_precision=PREC)
        b_hdh += tl.sum(b_h * b_dh, axis=1)
    b_dq = b_dq * tl.exp(b_G)                      # through Q e^G
    b_dk = b_dk * tl.exp(b_gl[None, :] - b_G)      # through K e^{G_l - G} (the state update)
    b_dgl = b_hdh * tl.exp(b_gl) + tl.sum(b_k * b_dk, axis=0)
    causal = o_i[:, None] >= o_i[None, :]
    b_dqM, b_dkM = _pair_decay_bwd(tl.where(causal, b_dM, 0.), b_q, b_k, b_G, b_G, causal)
    b_dq += b_dqM
    b_dk += b_dkM
    b_dG = b_q * b_dq - b_k * b_dk
    last = tl.minimum(T - i_c * BT, BT) - 1
    b_dG += tl.where((o_i == last)[:, None], b_dgl[None, :], 0.)
    tl.store(dg + (tok[:, None] * H + i_h) * K + o_k[None, :], b_dG, mask=m_tk)
    tl.store(dq + (tok[:, None] * H + i_h) * K + o_k[None, :], b_dq, mask=m_tk)
    tl.store(dk + (tok[:, None] * H + i_h) * K + o_k[None, :], b_dk, mask=m_tk)
    tl.store(dw + (tok[:, None] * H + i_h) * K + o_k[None, :], b_dw, mask=m_tk)


@triton.jit
def _kda_wy_bwd(k, v, b, g, Tm, dvn, dw, dk, dGin, dv, db, dg, cu, chunk_index,
                H, HQ, K, V,
                BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Back through U~ = Tm diag(b) V, W~ = Tm diag(b) (K e^G) and Tm = (I + A)^-1; adds to dk in place;
    dg = the chunk-local reverse cumulative sum of dG."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (H // HQ)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
    b_b = tl.load(b + tok * H + i_h, mask=m_t, other=0.).to(tl.float32)
    eye = tl.where(o_i[:, None] == o_i[None, :], 1., 0.)
    b_T = tl.load(Tm + (tok[:, None] * H + i_h) * BT + o_i[None, :], mask=m_t[:, None], other=0.)
    b_T = tl.where(m_t[:, None], b_T, eye)
    strict = o_i[:, None] > o_i[None, :]

    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        b_du = tl.load(dvn + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.)
        b_v = tl.load(v + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_dR = tl.dot(tl.trans(b_T), b_du, input_precision=PREC)
        tl.store(dv + (tok[:, None] * H + i_h) * V + o_v[None, :], b_dR * b_b[:, None], mask=m_tv)
        b_db += tl.sum(b_dR * b_v, axis=1)
        b_dT += tl.dot(b_du, tl.trans(b_v * b_b[:, None]), input_precision=PREC)
    b_KK = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        b_dw = tl.load(dw + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.)
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_G = tl.cumsum(tl.load(g + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.), axis=0)
        b_ke = b_k * tl.exp(b_G)
        b_dR = tl.dot(tl.trans(b_T), b_dw, input_precision=PREC)
        b_db += tl.sum(b_dR * b_ke, axis=1)
        b_dT += tl.dot(b_dw, tl.trans(b_ke * b_b[:, None]), input_precision=PREC)
        b_KK += _pair_decay(b_k, b_k, b_G, b_G, strict)
    # Tm = (I + A)^-1  =>  dA = -Tm^T dTm Tm^T, on the strictly lower triangle
    b_dA = -tl.dot(tl.dot(tl.trans(b_T), b_dT, input_precision=PREC), tl.trans(b_T), input_precision=PREC)
    b_dA = tl.where(strict, b_dA, 0.)
    b_db += tl.sum(b_dA * b_KK, axis=1)
    b_dKK = b_dA * b_b[:, None]
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        s_tk = (tok[:, None] * H + i_h) * K + o_k[None, :]
        b_dw = tl.load(dw + s_tk, mask=m_tk, other=0.)
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_G = tl.cumsum(tl.load(g + s_tk, mask=m_tk, other=0.), axis=0)
        b_e = tl.exp(b_G) * b_b[:, None]
        b_dR = tl.dot(tl.trans(b_T), b_dw, input_precision=PREC)
        b_dkx, b_dky = _pair_decay_bwd(b_dKK, b_k, b_k, b_G, b_G, strict)
        tl.store(dk + s_tk, tl.load(dk + s_tk, mask=m_tk, other=0.) + b_dR * b_e + b_dkx + b_dky, mask=m_tk)
        b_dG = tl.load(dGin + s_tk, mask=m_tk, other=0.) + b_dR * b_e * b_k + b_k * (b_dkx - b_dky)
        tl.store(dg + s_tk, tl.cumsum(b_dG, axis=0, reverse=True), mask=m_tk)
    tl.store(db + tok * H + i_h, b_db, mask=m_t)


@triton.jit
def _delta_recurrent_fwd(q, k, v, b, g, o, h0, ht, cu,
                         H, HQ, K, V,
                         BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr, GK: tl.constexpr,
                         USE_H0: tl.constexpr,
                         STORE_HT: tl.constexpr):
    """One token at a time, the state [K, BV] in registers (decoding)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    T = (eos - bos).to(tl.int32)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + s_kv, mask=m_kv, other=0.)
    for t in range(0, T):
        tok = bos + t
        b_q = tl.load(q + (tok * HQ + i_hk) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.load(k + (tok * HQ + i_hk) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_v = tl.load(v + (tok * H + i_h) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        b_bt = tl.load(b + tok * H + i_h).to(tl.float32)
        if USE_G:
            if GK:  # KDA: a log-gate per key channel, g [TT, H, K]
                b_h = b_h * tl.exp(tl.load(g + (tok * H + i_h) * K + o_k, mask=m_k, other=0.))[:, None]
            else:
                b_h = b_h * tl.exp(tl.load(g + tok * H + i_h))
        b_err = (b_v - tl.sum(b_k[:, None] * b_h, axis=0)) * b_bt
        b_h += b_k[:, None] * b_err[None, :]
        tl.store(o + (tok * H + i_h) * V + o_v, tl.sum(b_q[:, None] * b_h, axis=0), mask=m_v)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + s_kv, b_h, mask=m_kv)


# ----------------------------------------------------------------------------------------------
# launchers: q, k [TT, H, K], v [TT, H, V], b [TT, H], g [TT, H] (or [TT, H, K]: KDA) or None, h0 [N, H, K, V]; fp32
# ----------------------------------------------------------------------------------------------

def _wy(k, v, b, g, cfg):
    TT, H, HQ = heads(k, v)
    K, V = k.shape[-1], v.shape[-1]
    dev = k.device
    Tm = torch.empty(TT, H, cfg.BT, dtype=torch.float32, device=dev)
    u = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
    w = torch.empty(TT, H, K, dtype=torch.float32, device=dev)
    if _per_channel(g):
        _kda_wy_fwd[(cfg.chunks.NT, H)](k, v, b, g, Tm, u, w, cfg.chunks.cu, cfg.chunks.index, H, HQ, K, V,
                                        BT=cfg.BT, BK=_kda_bk(K), BV=block(V), PREC=cfg.prec)
        return Tm, u, w
    _wy_fwd[(cfg.chunks.NT, H)](k, v, b, g if g is not None else dummy(dev), Tm, u, w, cfg.chunks.cu,
                                cfg.chunks.index, H, HQ, K, V, BT=cfg.BT, BK=block(K), BV=block(V),
                                USE_G=g is not None, PREC=cfg.prec)
    return Tm, u, w


def _states(k, u, w, g, h0, cfg, store_final):
    TT, H, HQ = heads(k, u)
    K, V = k.shape[-1], u.shape[-1]
    ch, dev = cfg.chunks, k.device
    BK, BV = full_block(K, "K"), block(V, cap=32 if K > 64 else 64)
    h = torch.empty(ch.NT, H, K, V, dtype=torch.float32, device=dev)
    vn = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
    ht = torch.empty(ch.N, H, K, V, dtype=torch.float32, device=dev) if store_final else dummy(dev)
    _delta_fwd_h[(triton.cdiv(V, BV), ch.N * H)](
        k, u, w, g if g is not None else dummy(dev), h, vn, h0 if h0 is not None else dummy(dev), ht,
        ch.cu, ch.offsets, H, HQ, K, V, BT=cfg.BT, BK=BK, BV=BV, USE_G=g is not None, GK=_per_channel(g),
        USE_H0=h0 is not None, STORE_HT=store_final, PREC=cfg.prec)
    return h, vn, (ht if store_final else None)


def _per_channel(g) -> bool:
    """KDA: a log-gate per key channel, g [TT, H, K] (a per-head gate is [TT, H])."""
    return g is not None and g.dim() == 3


def _config(q, starts, chunk_size, g=None) -> KernelConfig:
    BT = KDA_CHUNK if _per_channel(g) else triton_chunk_size(chunk_size)
    return KernelConfig(prepare_chunks(list(starts), BT, q.device), BT, FMAP_IDENTITY, 1.0, False,
                        dot_precision(q.dtype))


def _chunk_fwd(q, k, v, b, g, h0, cfg, output_final_state):
    """-> o [TT, H, V] fp32, h_T [N, H, K, V] fp32 or None."""
    _, u, w = _wy(k, v, b, g, cfg)
    h, vn, ht = _states(k, u, w, g, h0, cfg, output_final_state)
    if _per_channel(g):
        TT, H, HQ = heads(q, vn)
        K, V, ch = q.shape[-1], vn.shape[-1], cfg.chunks
        o = torch.empty(TT, H, V, dtype=torch.float32, device=q.device)
        BV = block(V)
        _kda_fwd_o[(triton.cdiv(V, BV), ch.NT, H)](q, k, vn, g, h, o, ch.cu, ch.index, H, HQ, K, V,
                                                   BT=cfg.BT, BK=_kda_bk(K), BV=BV, PREC=cfg.prec)
        return o, ht
    o, _ = chunk_fwd_o(q, k, vn, g, h, None, cfg, 1.0, FMAP_IDENTITY, False)
    return o, ht


def _chunk_bwd(q, k, v, b, g, h0, cfg, do, dht, need_dh0):
    """-> dq, dk, dv, db (in the inputs' dtypes), dg or None, dh0 or None."""
    ch, dev = cfg.chunks, q.device
    TT, H, HQ = heads(q, v)
    K, V = q.shape[-1], v.shape[-1]
    do = do.contiguous() if do is not None else torch.zeros(TT, H, V, dtype=torch.float32, device=dev)
    Tm, u, w = _wy(k, v, b, g, cfg)
    h, vn, _ = _states(k, u, w, g, h0, cfg, False)
    gd = g if g is not None else dummy(dev)
    gk = _per_channel(g)
    if gk:
        dvl = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
        _kda_bwd_dv[(triton.cdiv(V, block(V)), ch.NT, H)](q, k, g, do, dvl, ch.cu, ch.index, H, HQ, K, V,
                                                          BT=cfg.BT, BK=_kda_bk(K), BV=block(V), PREC=cfg.prec)
    else:
        dvl = chunk_bwd_dv(q, k, g, do, None, cfg, 1.0, FMAP_IDENTITY)
    BKf, BVf = full_block(K, "K"), block(V, cap=32 if K > 64 else 64)
    dh = torch.empty(ch.NT, H, K, V, dtype=torch.float32, device=dev)
    dvn = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
    dh0 = torch.empty(ch.N, H, K, V, dtype=torch.float32, device=dev) if need_dh0 else dummy(dev)
    _delta_bwd_dh[(triton.cdiv(V, BVf), ch.N * H)](
        q, k, w, gd, do, dvl, dh, dvn, dht.contiguous() if dht is not None else dummy(dev), dh0,
        ch.cu, ch.offsets, H, HQ, K, V, BT=cfg.BT, BK=BKf, BV=BVf, USE_G=g is not None, GK=gk,
        USE_DHT=dht is not None, STORE_DH0=need_dh0, PREC=cfg.prec)

    BK, BV = block(K), block(V)
    NK = triton.cdiv(K, BK)
    dq = torch.empty(TT, H, K, dtype=torch.float32, device=dev)
    dk = torch.empty(TT, H, K, dtype=torch.float32, device=dev)
    dw = torch.empty(TT, H, K, dtype=torch.float32, device=dev)
    if gk:  # each K tile owns its columns of dG: no partial sums
        BK = _kda_bk(K)
        NK = triton.cdiv(K, BK)
        dG = torch.empty(TT, H, K, dtype=torch.float32, device=dev)
        _kda_bwd_dqkw[(NK, ch.NT, H)](q, k, vn, g, h, do, dh, dvn, dq, dk, dw, dG, ch.cu, ch.index, H, HQ, K, V,
                                      BT=cfg.BT, BK=BK, BV=BV, PREC=cfg.prec)
        dv = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
        db = torch.empty(TT, H, dtype=torch.float32, device=dev)
        dg = torch.empty(TT, H, K, dtype=torch.float32, device=dev)
        _kda_wy_bwd[(ch.NT, H)](k, v, b, g, Tm, dvn, dw, dk, dG, dv, db, dg, ch.cu, ch.index, H, HQ, K, V,
                                BT=cfg.BT, BK=BK, BV=BV, PREC=cfg.prec)
        return (group_sum(dq, HQ).to(q.dtype), group_sum(dk, HQ).to(k.dtype), dv.to(v.dtype), db.to(b.dtype),
                dg, dh0 if need_dh0 else None)
    dGp = torch.empty(NK, TT, H, dtype=torch.float32, device=dev) if g is not None else dummy(dev)
    _delta_bwd_dqkw[(NK, ch.NT, H)](
        q, k, vn, gd, h, do, dh, dvn, dq, dk, dw, dGp, ch.cu, ch.index, TT, H, HQ, K, V,
        BT=cfg.BT, BK=BK, BV=BV, USE_G=g is not None, PREC=cfg.prec)

    dv = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
    db = torch.empty(TT, H, dtype=torch.float32, device=dev)
    dg = torch.empty(TT, H, dtype=torch.float32, device=dev) if g is not None else dummy(dev)
    _wy_bwd[(ch.NT, H)](
        k, v, b, gd, Tm, dvn, dw, dk, dGp.sum(0) if g is not None else dummy(dev), dv, db, dg,
        ch.cu, ch.index, H, HQ, K, V, BT=cfg.BT, BK=BK, BV=BV, USE_G=g is not None, PREC=cfg.prec)
    return (group_sum(dq, HQ).to(q.dtype), group_sum(dk, HQ).to(k.dtype), dv.to(v.dtype), db.to(b.dtype),
            dg if g is not None else None, dh0 if need_dh0 else None)


# ----------------------------------------------------------------------------------------------
# torch.library custom ops (see linear.py): one opaque op per pass for torch.compile, with its fake
# (shape) implementation and its autograd formula; an absent final state is an empty tensor.
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("linattn::triton_delta_chunk_fwd", mutates_args=())
def _op_chunk_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, g: Optional[torch.Tensor],
                  h0: Optional[torch.Tensor], starts: List[int], chunk_size: int, output_final_state: bool
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    o, ht = _chunk_fwd(q, k, v, b, g, h0, _config(q, starts, chunk_size, g), output_final_state)
    return o, (ht if ht is not None else absent(q))


@_op_chunk_fwd.register_fake
def _(q, k, v, b, g, h0, starts, chunk_size, output_final_state):
    TT, H, _ = heads(q, v)
    K, V, N = q.shape[-1], v.shape[-1], len(starts) - 1
    return (q.new_empty(TT, H, V, dtype=torch.float32),
            q.new_empty((N, H, K, V) if output_final_state else (0,), dtype=torch.float32))


@torch.library.custom_op("linattn::triton_delta_chunk_bwd", mutates_args=())
def _op_chunk_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, g: Optional[torch.Tensor],
                  h0: Optional[torch.Tensor], do: Optional[torch.Tensor], dht: Optional[torch.Tensor],
                  starts: List[int], chunk_size: int
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dht = dht if dht is not None and dht.numel() else None  # absent, or the empty stand-in of no final state
    dq, dk, dv, db, dg, dh0 = _chunk_bwd(q, k, v, b, g, h0, _config(q, starts, chunk_size, g), do, dht,
                                         need_dh0=h0 is not None)
    return dq, dk, dv, db, (dg if dg is not None else absent(q)), (dh0 if dh0 is not None else absent(q))


@_op_chunk_bwd.register_fake
def _(q, k, v, b, g, h0, do, dht, starts, chunk_size):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(b),
            torch.empty_like(g) if g is not None else absent(q),
            torch.empty_like(h0) if h0 is not None else absent(q))


def _setup_chunk(ctx, inputs, output):
    q, k, v, b, g, h0, starts, chunk_size, _ = inputs
    ctx.save_for_backward(q, k, v, b, g, h0)
    ctx.meta = (list(starts), chunk_size)


def _backward_chunk(ctx, do, dht):
    q, k, v, b, g, h0 = ctx.saved_tensors
    starts, chunk_size = ctx.meta
    dq, dk, dv, db, dg, dh0 = torch.ops.linattn.triton_delta_chunk_bwd(q, k, v, b, g, h0, do, dht, starts,
                                                                       chunk_size)
    return (dq, dk, dv, db, dg if g is not None else None, dh0 if h0 is not None else None, None, None, None)


_op_chunk_fwd.register_autograd(_backward_chunk, setup_context=_setup_chunk)


@torch.library.custom_op("linattn::triton_delta_recurrent_fwd", mutates_args=())
def _op_recurrent_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
                      g: Optional[torch.Tensor], h0: Optional[torch.Tensor], starts: List[int],
                      output_final_state: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    o, ht = _recurrent(q, k, v, b, g, h0, list(starts), output_final_state)
    return o, (ht if ht is not None else absent(q))


@_op_recurrent_fwd.register_fake
def _(q, k, v, b, g, h0, starts, output_final_state):
    TT, H, _ = heads(q, v)
    K, V, N = q.shape[-1], v.shape[-1], len(starts) - 1
    return (q.new_empty(TT, H, V, dtype=torch.float32),
            q.new_empty((N, H, K, V) if output_final_state else (0,), dtype=torch.float32))


# ----------------------------------------------------------------------------------------------
# entry points, on prepared tensors (checks and preprocessing happen in ops/ first): q (scaled),
# k~ [TT, HQ, K], v~ [TT, H, V] (H a multiple of HQ: value head j reads q/k head j // (H // HQ)),
# b = a~ [TT, H], g [TT, H] or None, h0 [N, H, K, V] or None, all fp32 except q, k, v which may be
# 16-bit; starts: the sequence boundaries on the TT axis.
# Return o [TT, H, V] fp32 and the final state [N, H, K, V] (or None).
# ----------------------------------------------------------------------------------------------

def chunk_delta_rule(q, k, v, b, g, h0, *, starts: List[int], chunk_size: int, output_final_state: bool):
    """The chunk form (forward and backward; the custom op linattn::triton_delta_chunk_fwd); K <= 256
    (the state walk keeps a whole K x BV tile). The tile is `triton_chunk_size(chunk_size)`."""
    fin = bool(output_final_state)
    o, ht = torch.ops.linattn.triton_delta_chunk_fwd(q, k, v, b, g, h0, [int(s) for s in starts], int(chunk_size),
                                                     fin)
    return o, (ht if fin else None)


def fused_recurrent_delta_rule(q, k, v, b, g, h0, *, starts: List[int], output_final_state: bool):
    """The recurrent form as one fused kernel (decoding; forward only: no gradients flow through it;
    the custom op linattn::triton_delta_recurrent_fwd)."""
    fin = bool(output_final_state)
    d = [x.detach() if x is not None else None for x in (q, k, v, b, g, h0)]
    o, ht = torch.ops.linattn.triton_delta_recurrent_fwd(*d, [int(s) for s in starts], fin)
    return o, (ht if fin else None)


def _recurrent(q, k, v, b, g, h0, starts, output_final_state):
    TT, H, HQ = heads(q, v)
    K, V, N, dev = q.shape[-1], v.shape[-1], len(starts) - 1, q.device
    BK, BV = full_block(K, "K"), block(V, cap=32 if K > 64 else 64)
    o = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else dummy(dev)
    cu = torch.tensor(starts, dtype=torch.int64, device=dev)
    _delta_recurrent_fwd[(triton.cdiv(V, BV), N * H)](
        q, k, v, b, g if g is not None else dummy(dev), o, h0 if h0 is not None else dummy(dev), ht, cu, H, HQ, K, V,
        BK=BK, BV=BV, USE_G=g is not None, GK=g is not None and g.dim() == 3, USE_H0=h0 is not None,
        STORE_HT=bool(output_final_state))
    return o, (ht if output_final_state else None)
