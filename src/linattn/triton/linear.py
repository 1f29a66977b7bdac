"""Triton kernels for causal kernelized linear attention (`linear_attention`): the chunk form
(forward and backward) and a fused recurrent form for decoding (forward only).

Layout: every sequence tensor is flattened to [TT, H, D] (TT = B*T tokens, or the packed tokens of
cu_seqlens); a batch of B sequences of length T is the packed batch with cu_seqlens = [0, T, .., BT].
Chunks of BT tokens never cross a sequence boundary (`_utils.prepare_chunks`).

Per chunk c of a sequence, with features fq = phi(scale q), fk = psi(k) (zero on padding tokens),
G the scalar log-gate's cumulative sum *local to the chunk* (so every exponent is <= 0), G_l its
value at the chunk's last token, and h_c [K, V], z_c [K] the states entering the chunk:

    num_i = e^{G_i} fq_i h_c + sum_{j<=i} (fq_i . fk_j) e^{G_i - G_j} v_j
    den_i = e^{G_i} fq_i . z_c + sum_{j<=i} (fq_i . fk_j) e^{G_i - G_j}
    h_{c+1} = e^{G_l} h_c + sum_j e^{G_l - G_j} fk_j v_j^T,   z_{c+1} likewise with v_j = 1

Forward: `_fwd_h` walks the chunks of a sequence and materialises h_c, z_c (fp32) per chunk (one
program per (K block, V block, sequence x head)); `_fwd_o` then computes every chunk in parallel
(one program per (V block, chunk, head), tl.dot on BT x BK x BV tiles, fp32 accumulation). The
normaliser rides along in the programs of the first V block. The output division (with the
operator's eps floor) is done by PyTorch on (num, den).

Backward: `_bwd_dh` walks the chunks in reverse and materialises dh_{c+1}, dz_{c+1} (the gradient
of the state *leaving* each chunk); `_bwd_dqkg` gives dq, dk and the gate gradient; `_bwd_dv` gives
dv. The gate gradient uses dL/dG_t = fq_t . dfq_t - fk_t . dfk_t (+ <dh_{c+1}, h_{c+1}> at the last
token of the chunk), followed by a reverse cumulative sum inside the chunk (G is chunk-local).
States are recomputed in the backward pass (nothing of size [NT, H, K, V] is kept between passes).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..feature_maps import EluPlusOne, Identity, ReLU, get_feature_map
from ..ops._common import check_cu_seqlens, check_mode, check_qkv
from ..ops.linear import LinearAttentionState, _check_state, _gate_to_log
from ._utils import (FMAP_ELU1, FMAP_IDENTITY, FMAP_RELU, block, chunk_size_for, dot_precision, dphi, dummy,
                     phi, prepare_chunks)

# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_h(k, v, g, h, z, h0, z0, ht, zt, cu, chunk_offsets,
           H, K, V,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr,
           USE_G: tl.constexpr, NORM: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
           PREC: tl.constexpr):
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    T = (eos - bos).to(tl.int32)
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_kv = o_k[:, None] * V + o_v[None, :]

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    b_z = tl.zeros([BK], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + s_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(z0 + i_nh.to(tl.int64) * K + o_k, mask=m_k, other=0.)
    for i_c in range(0, NT):
        row = (boh + i_c) * H + i_h
        tl.store(h + row * K * V + s_kv, b_h, mask=m_kv)
        if NORM:
            if i_v == 0:
                tl.store(z + row * K + o_k, b_z, mask=m_k)
        o_t = i_c * BT + tl.arange(0, BT)
        m_t = o_t < T
        tok = bos + o_t
        m_tk = m_t[:, None] & m_k[None, :]
        b_k = tl.load(k + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.where(m_tk, phi(b_k, FMAP), 0.)
        b_v = tl.load(v + (tok[:, None] * H + i_h) * V + o_v[None, :],
                      mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
        if USE_G:
            b_g = tl.load(g + tok * H + i_h, mask=m_t, other=0.)
            b_G = tl.cumsum(b_g, axis=0)
            b_gl = tl.sum(b_g, axis=0)
            b_k = b_k * tl.exp(b_gl - b_G)[:, None]
            b_h = b_h * tl.exp(b_gl)
            b_z = b_z * tl.exp(b_gl)
        b_h += tl.dot(tl.trans(b_k), b_v, input_precision=PREC)
        if NORM:
            b_z += tl.sum(b_k, axis=0)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + s_kv, b_h, mask=m_kv)
        if NORM:
            if i_v == 0:
                tl.store(zt + i_nh.to(tl.int64) * K + o_k, b_z, mask=m_k)


@triton.jit
def _fwd_o(q, k, v, g, h, z, o, den, cu, chunk_index, scale,
           H, K, V,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr,
           USE_G: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr):
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c = tl.load(chunk_index + i_t * 2), tl.load(chunk_index + i_t * 2 + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    T = (eos - bos).to(tl.int32)
    o_i = tl.arange(0, BT)
    o_t = i_c * BT + o_i
    m_t = o_t < T
    tok = bos + o_t
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    row = i_t.to(tl.int64) * H + i_h

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_A = tl.zeros([BT, BT], dtype=tl.float32)
    b_den = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_q = tl.where(m_tk, phi(b_q * scale, FMAP), 0.)
        b_k = tl.load(k + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.where(m_tk, phi(b_k, FMAP), 0.)
        b_h = tl.load(h + row * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.)
        b_o += tl.dot(b_q, b_h, input_precision=PREC)
        b_A += tl.dot(b_q, tl.trans(b_k), input_precision=PREC)
        if NORM:
            b_zc = tl.load(z + row * K + o_k, mask=m_k, other=0.)
            b_den += tl.sum(b_q * b_zc[None, :], axis=1)
    causal = o_i[:, None] >= o_i[None, :]
    if USE_G:
        b_g = tl.load(g + tok * H + i_h, mask=m_t, other=0.)
        b_G = tl.cumsum(b_g, axis=0)
        b_o = b_o * tl.exp(b_G)[:, None]
        b_den = b_den * tl.exp(b_G)
        b_A = b_A * tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf")))
    else:
        b_A = tl.where(causal, b_A, 0.)
    b_v = tl.load(v + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
    b_o += tl.dot(b_A, b_v, input_precision=PREC)
    tl.store(o + (tok[:, None] * H + i_h) * V + o_v[None, :], b_o, mask=m_tv)
    if NORM:
        if i_v == 0:
            tl.store(den + tok * H + i_h, b_den + tl.sum(b_A, axis=1), mask=m_t)


@triton.jit
def _bwd_dh(q, g, do, dden, dh, dz, dht, dzt, dh0, dz0, cu, chunk_offsets, scale,
            H, K, V,
            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr,
            USE_G: tl.constexpr, NORM: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
            PREC: tl.constexpr):
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    T = (eos - bos).to(tl.int32)
    NT = tl.cdiv(T, BT)
    boh = tl.load(chunk_offsets + i_n)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_kv = o_k[:, None] * V + o_v[None, :]

    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    b_dz = tl.zeros([BK], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_nh.to(tl.int64) * K * V + s_kv, mask=m_kv, other=0.)
        if NORM:
            b_dz += tl.load(dzt + i_nh.to(tl.int64) * K + o_k, mask=m_k, other=0.)
    for i in range(0, NT):
        i_c = NT - 1 - i
        row = (boh + i_c) * H + i_h
        tl.store(dh + row * K * V + s_kv, b_dh, mask=m_kv)
        if NORM:
            if i_v == 0:
                tl.store(dz + row * K + o_k, b_dz, mask=m_k)
        o_t = i_c * BT + tl.arange(0, BT)
        m_t = o_t < T
        tok = bos + o_t
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_q = tl.where(m_tk, phi(b_q * scale, FMAP), 0.)
        b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :],
                       mask=m_t[:, None] & m_v[None, :], other=0.).to(tl.float32)
        if USE_G:
            b_g = tl.load(g + tok * H + i_h, mask=m_t, other=0.)
            b_G = tl.cumsum(b_g, axis=0)
            b_gl = tl.sum(b_g, axis=0)
            b_q = b_q * tl.exp(b_G)[:, None]
            b_dh = b_dh * tl.exp(b_gl)
            b_dz = b_dz * tl.exp(b_gl)
        b_dh += tl.dot(tl.trans(b_q), b_do, input_precision=PREC)
        if NORM:
            b_dd = tl.load(dden + tok * H + i_h, mask=m_t, other=0.)
            b_dz += tl.sum(b_q * b_dd[:, None], axis=0)
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + s_kv, b_dh, mask=m_kv)
        if NORM:
            if i_v == 0:
                tl.store(dz0 + i_nh.to(tl.int64) * K + o_k, b_dz, mask=m_k)


@triton.jit
def _bwd_dqkg(q, k, v, g, h, z, do, dden, dh, dz, dq, dk, dg, cu, chunk_index, scale,
              TT, H, K, V,
              BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr,
              USE_G: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr):
    i_k, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c = tl.load(chunk_index + i_t * 2), tl.load(chunk_index + i_t * 2 + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    T = (eos - bos).to(tl.int32)
    o_i = tl.arange(0, BT)
    o_t = i_c * BT + o_i
    m_t = o_t < T
    tok = bos + o_t
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    row = i_t.to(tl.int64) * H + i_h

    b_xq = tl.load(q + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32) * scale
    b_xk = tl.load(k + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
    b_q = tl.where(m_tk, phi(b_xq, FMAP), 0.)
    b_k = tl.where(m_tk, phi(b_xk, FMAP), 0.)

    b_dA = tl.zeros([BT, BT], dtype=tl.float32)
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)  # <h_c, dh_{c+1}>, per feature
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        m_kv = m_k[:, None] & m_v[None, :]
        b_v = tl.load(v + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
        b_h = tl.load(h + row * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dh = tl.load(dh + row * K * V + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.)
        b_dA += tl.dot(b_do, tl.trans(b_v), input_precision=PREC)
        b_dq += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dk += tl.dot(b_v, tl.trans(b_dh), input_precision=PREC)
        if USE_G:
            b_hdh += tl.sum(b_h * b_dh, axis=1)
    if NORM:
        b_dd = tl.load(dden + tok * H + i_h, mask=m_t, other=0.)
        b_zc = tl.load(z + row * K + o_k, mask=m_k, other=0.)
        b_dzn = tl.load(dz + row * K + o_k, mask=m_k, other=0.)
        b_dA += b_dd[:, None]
        b_dq += b_dd[:, None] * b_zc[None, :]
        b_dk += tl.where(m_tk, b_dzn[None, :], 0.)
        if USE_G:
            b_hdh += b_zc * b_dzn
    causal = o_i[:, None] >= o_i[None, :]
    if USE_G:
        b_g = tl.load(g + tok * H + i_h, mask=m_t, other=0.)
        b_G = tl.cumsum(b_g, axis=0)
        b_gl = tl.sum(b_g, axis=0)
        b_dq = b_dq * tl.exp(b_G)[:, None]
        b_dk = b_dk * tl.exp(b_gl - b_G)[:, None]
        # <dh_{c+1}, h_{c+1}>: the state term's derivative in G_l (this K block's share)
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
        b_dg = tl.cumsum(b_dG, axis=0, reverse=True)
        tl.store(dg + i_k.to(tl.int64) * TT * H + tok * H + i_h, b_dg, mask=m_t)
    b_dq = b_dq * dphi(b_xq, FMAP) * scale
    b_dk = b_dk * dphi(b_xk, FMAP)
    tl.store(dq + (tok[:, None] * H + i_h) * K + o_k[None, :], b_dq, mask=m_tk)
    tl.store(dk + (tok[:, None] * H + i_h) * K + o_k[None, :], b_dk, mask=m_tk)


@triton.jit
def _bwd_dv(q, k, g, do, dh, dv, cu, chunk_index, scale,
            H, K, V,
            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr,
            USE_G: tl.constexpr, USE_DH: tl.constexpr, PREC: tl.constexpr):
    """dv = A^T do (+ (fk e^{G_l - G}) dh_{c+1}); with USE_DH=False it is the delta rule's
    intra-chunk gradient of the pseudo-values."""
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_c = tl.load(chunk_index + i_t * 2), tl.load(chunk_index + i_t * 2 + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    T = (eos - bos).to(tl.int32)
    o_i = tl.arange(0, BT)
    o_t = i_c * BT + o_i
    m_t = o_t < T
    tok = bos + o_t
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_tv = m_t[:, None] & m_v[None, :]
    row = i_t.to(tl.int64) * H + i_h
    if USE_G:
        b_g = tl.load(g + tok * H + i_h, mask=m_t, other=0.)
        b_G = tl.cumsum(b_g, axis=0)
        b_gl = tl.sum(b_g, axis=0)

    b_At = tl.zeros([BT, BT], dtype=tl.float32)  # b_At[j, i] = A[i, j]
    b_dv = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        b_q = tl.load(q + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_q = tl.where(m_tk, phi(b_q * scale, FMAP), 0.)
        b_k = tl.load(k + (tok[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_k = tl.where(m_tk, phi(b_k, FMAP), 0.)
        b_At += tl.dot(b_k, tl.trans(b_q), input_precision=PREC)
        if USE_DH:
            b_dh = tl.load(dh + row * K * V + o_k[:, None] * V + o_v[None, :],
                           mask=m_k[:, None] & m_v[None, :], other=0.)
            if USE_G:
                b_k = b_k * tl.exp(b_gl - b_G)[:, None]
            b_dv += tl.dot(b_k, b_dh, input_precision=PREC)
    causal_t = o_i[:, None] <= o_i[None, :]
    if USE_G:
        b_At = b_At * tl.exp(tl.where(causal_t, b_G[None, :] - b_G[:, None], float("-inf")))
    else:
        b_At = tl.where(causal_t, b_At, 0.)
    b_do = tl.load(do + (tok[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.).to(tl.float32)
    b_dv += tl.dot(b_At, b_do, input_precision=PREC)
    tl.store(dv + (tok[:, None] * H + i_h) * V + o_v[None, :], b_dv, mask=m_tv)


@triton.jit
def _recurrent_fwd(q, k, v, g, o, den, h0, z0, ht, zt, cu, scale,
                   TT, H, K, V,
                   BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr, USE_G: tl.constexpr,
                   NORM: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr):
    """One token at a time, a [BK, BV] block of the state in registers: decoding (T = 1) and short
    prompts. K blocks write partial outputs o [NK, TT, H, V] / den [NK, TT, H], summed by the caller."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    T = (eos - bos).to(tl.int32)
    o += i_k.to(tl.int64) * TT * H * V
    den += i_k.to(tl.int64) * TT * H
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    s_kv = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    b_z = tl.zeros([BK], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh.to(tl.int64) * K * V + s_kv, mask=m_kv, other=0.)
        if NORM:
            b_z += tl.load(z0 + i_nh.to(tl.int64) * K + o_k, mask=m_k, other=0.)
    for t in range(0, T):
        tok = bos + t
        b_q = tl.load(q + (tok * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_q = tl.where(m_k, phi(b_q * scale, FMAP), 0.)
        b_k = tl.load(k + (tok * H + i_h) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.where(m_k, phi(b_k, FMAP), 0.)
        b_v = tl.load(v + (tok * H + i_h) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        if USE_G:
            b_gt = tl.exp(tl.load(g + tok * H + i_h))
            b_h = b_h * b_gt
            b_z = b_z * b_gt
        b_h += b_k[:, None] * b_v[None, :]
        tl.store(o + (tok * H + i_h) * V + o_v, tl.sum(b_q[:, None] * b_h, axis=0), mask=m_v)
        if NORM:
            b_z += b_k
            if i_v == 0:
                tl.store(den + tok * H + i_h, tl.sum(b_q * b_z, axis=0))
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + s_kv, b_h, mask=m_kv)
        if NORM:
            if i_v == 0:
                tl.store(zt + i_nh.to(tl.int64) * K + o_k, b_z, mask=m_k)


# ----------------------------------------------------------------------------------------------
# launchers: q, k [TT, H, K] and v [TT, H, V] contiguous (any float dtype); g [TT, H] fp32 or
# None; states fp32 [N, H, K, V] / [N, H, K]
# ----------------------------------------------------------------------------------------------

class _Cfg:
    """Static configuration of one call (not a tensor: kept on ctx)."""

    def __init__(self, chunks, BT, fmap, scale, norm, prec):
        self.chunks, self.BT, self.fmap, self.scale, self.norm, self.prec = chunks, BT, fmap, scale, norm, prec


def chunk_fwd_h(k, v, g, h0, z0, cfg, norm, store_final, fmap=None):
    """Per-chunk states h [NT, H, K, V] (and z [NT, H, K] when norm), final states (or None)."""
    TT, H, K = k.shape
    V = v.shape[-1]
    ch, dev = cfg.chunks, k.device
    BK, BV = block(K), block(V)
    h = torch.empty(ch.NT, H, K, V, dtype=torch.float32, device=dev)
    z = torch.empty(ch.NT, H, K, dtype=torch.float32, device=dev) if norm else dummy(dev)
    ht = torch.empty(ch.N, H, K, V, dtype=torch.float32, device=dev) if store_final else dummy(dev)
    zt = torch.empty(ch.N, H, K, dtype=torch.float32, device=dev) if (store_final and norm) else dummy(dev)
    grid = (triton.cdiv(K, BK), triton.cdiv(V, BV), ch.N * H)
    _fwd_h[grid](k, v, g if g is not None else dummy(dev), h, z,
                 h0 if h0 is not None else dummy(dev), z0 if (z0 is not None and norm) else dummy(dev),
                 ht, zt, ch.cu, ch.offsets, H, K, V,
                 BT=cfg.BT, BK=BK, BV=BV, FMAP=cfg.fmap if fmap is None else fmap, USE_G=g is not None,
                 NORM=norm, USE_H0=h0 is not None, STORE_HT=store_final, PREC=cfg.prec)
    return h, (z if norm else None), (ht if store_final else None), (zt if (store_final and norm) else None)


def chunk_fwd_o(q, k, v, g, h, z, cfg, scale, fmap, norm):
    """num [TT, H, V] fp32 (and den [TT, H] fp32 when norm) from the per-chunk states."""
    TT, H, K = q.shape
    V = v.shape[-1]
    ch, dev = cfg.chunks, q.device
    BK, BV = block(K), block(V)
    o = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
    den = torch.empty(TT, H, dtype=torch.float32, device=dev) if norm else dummy(dev)
    grid = (triton.cdiv(V, BV), ch.NT, H)
    _fwd_o[grid](q, k, v, g if g is not None else dummy(dev), h, z if norm else dummy(dev), o, den,
                 ch.cu, ch.index, scale, H, K, V,
                 BT=cfg.BT, BK=BK, BV=BV, FMAP=fmap, USE_G=g is not None, NORM=norm, PREC=cfg.prec)
    return o, (den if norm else None)


def chunk_bwd_dv(q, k, g, do, dh, cfg, scale, fmap):
    """A^T do (+ the state term when dh [NT, H, K, V] is given), fp32 [TT, H, V]."""
    TT, H, K = q.shape
    V = do.shape[-1]
    ch, dev = cfg.chunks, q.device
    BK, BV = block(K), block(V)
    dv = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
    grid = (triton.cdiv(V, BV), ch.NT, H)
    _bwd_dv[grid](q, k, g if g is not None else dummy(dev), do, dh if dh is not None else dummy(dev), dv,
                  ch.cu, ch.index, scale, H, K, V,
                  BT=cfg.BT, BK=BK, BV=BV, FMAP=fmap, USE_G=g is not None, USE_DH=dh is not None,
                  PREC=cfg.prec)
    return dv


class _ChunkLinearAttention(torch.autograd.Function):
    """(q, k, v, g, h0, z0) -> (num [TT,H,V], den [TT,H] or None, h_T, z_T), all outputs fp32."""

    @staticmethod
    def forward(ctx, q, k, v, g, h0, z0, cfg, output_final_state):
        h, z, ht, zt = chunk_fwd_h(k, v, g, h0, z0, cfg, cfg.norm, output_final_state)
        num, den = chunk_fwd_o(q, k, v, g, h, z, cfg, cfg.scale, cfg.fmap, cfg.norm)
        ctx.save_for_backward(q, k, v, g, h0, z0)
        ctx.cfg = cfg
        return num, den, ht, zt

    @staticmethod
    def backward(ctx, dnum, dden, dht, dzt):
        q, k, v, g, h0, z0 = ctx.saved_tensors
        cfg = ctx.cfg
        ch, dev = cfg.chunks, q.device
        TT, H, K = q.shape
        V = v.shape[-1]
        norm = cfg.norm
        BK, BV = block(K), block(V)
        do = dnum.contiguous() if dnum is not None else torch.zeros(TT, H, V, dtype=torch.float32, device=dev)
        if norm:
            dd = dden.contiguous() if dden is not None else torch.zeros(TT, H, dtype=torch.float32, device=dev)
        h, z, _, _ = chunk_fwd_h(k, v, g, h0, z0, cfg, norm, False)

        need_dh0 = ctx.needs_input_grad[4] or ctx.needs_input_grad[5]
        dh = torch.empty(ch.NT, H, K, V, dtype=torch.float32, device=dev)
        dz = torch.empty(ch.NT, H, K, dtype=torch.float32, device=dev) if norm else dummy(dev)
        dh0 = torch.empty(ch.N, H, K, V, dtype=torch.float32, device=dev) if need_dh0 else dummy(dev)
        dz0 = torch.empty(ch.N, H, K, dtype=torch.float32, device=dev) if (need_dh0 and norm) else dummy(dev)
        use_dht = dht is not None or (norm and dzt is not None)
        if use_dht:
            dht = dht.contiguous() if dht is not None else torch.zeros(ch.N, H, K, V, dtype=torch.float32, device=dev)
            if norm:
                dzt = dzt.contiguous() if dzt is not None else torch.zeros(ch.N, H, K, dtype=torch.float32, device=dev)
        gd = g if g is not None else dummy(dev)
        _bwd_dh[(triton.cdiv(K, BK), triton.cdiv(V, BV), ch.N * H)](
            q, gd, do, dd if norm else dummy(dev), dh, dz,
            dht if use_dht else dummy(dev), dzt if (use_dht and norm) else dummy(dev), dh0, dz0,
            ch.cu, ch.offsets, cfg.scale, H, K, V,
            BT=cfg.BT, BK=BK, BV=BV, FMAP=cfg.fmap, USE_G=g is not None, NORM=norm, USE_DHT=use_dht,
            STORE_DH0=need_dh0, PREC=cfg.prec)

        NK = triton.cdiv(K, BK)
        dq = torch.empty(TT, H, K, dtype=torch.float32, device=dev)
        dk = torch.empty(TT, H, K, dtype=torch.float32, device=dev)
        dg = torch.empty(NK, TT, H, dtype=torch.float32, device=dev) if g is not None else dummy(dev)
        _bwd_dqkg[(NK, ch.NT, H)](
            q, k, v, gd, h, z if norm else dummy(dev), do, dd if norm else dummy(dev), dh, dz, dq, dk, dg,
            ch.cu, ch.index, cfg.scale, TT, H, K, V,
            BT=cfg.BT, BK=BK, BV=BV, FMAP=cfg.fmap, USE_G=g is not None, NORM=norm, PREC=cfg.prec)
        dv = chunk_bwd_dv(q, k, g, do, dh, cfg, cfg.scale, cfg.fmap)
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype),
                dg.sum(0) if g is not None else None,
                dh0 if ctx.needs_input_grad[4] else None,
                dz0 if (ctx.needs_input_grad[5] and norm) else None,
                None, None)


# ----------------------------------------------------------------------------------------------
# entry points
# ----------------------------------------------------------------------------------------------

def _fused_code(fmap) -> Optional[int]:
    t = type(fmap)
    return {Identity: FMAP_IDENTITY, EluPlusOne: FMAP_ELU1, ReLU: FMAP_RELU}.get(t)


def _prepare(q, k, v, feature_map, normalize, gamma, g, scale, chunk_size, initial_state, cu_seqlens, eps, mode):
    """The operator's checks and PyTorch-side preprocessing, shared by both entry points."""
    B, T, H, K, V = check_qkv(q, k, v)
    check_mode(mode, chunk_size)
    if q.dtype == torch.float64:
        raise NotImplementedError("the Triton kernels take fp16, bf16 or fp32 inputs; use backend='torch' for fp64")
    fmap = get_feature_map(feature_map, K)
    if fmap.log_space:
        raise NotImplementedError(f"log-space feature map {fmap.name!r}: the Triton kernels cover linear-space maps; "
                                  f"use backend='torch'")
    if gamma is not None and g is not None:
        raise ValueError("pass either gamma (constant decay) or g (data-dependent log-gate), not both")
    if not isinstance(eps, (int, float)) or eps < 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    N = B if offsets is None else len(offsets) - 1
    starts = [i * T for i in range(B + 1)] if offsets is None else offsets
    dev = q.device

    if initial_state is not None:
        if not isinstance(initial_state, LinearAttentionState):
            raise TypeError(f"initial_state must be a linattn.LinearAttentionState (as returned with "
                            f"output_final_state=True), got {type(initial_state).__name__}")
        offset0 = initial_state.offset.to(device=dev, dtype=torch.int64)
    else:
        offset0 = torch.zeros(N, dtype=torch.int64, device=dev)

    code = _fused_code(fmap)
    if code is not None:  # phi(scale q) is computed inside the kernels
        fq, fk, kscale = q, k, float(scale)
    else:  # any other linear-space map: features in PyTorch (fp32), identity in the kernels
        if fmap.positional:
            if offsets is None:
                pos = offset0.view(N, 1) + torch.arange(T, device=dev)
            else:
                pos = torch.cat([offset0[i] + torch.arange(b - a, device=dev)
                                 for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))]).view(1, T)
        else:
            pos = None
        q_c, k_c = q.float(), k.float()
        if scale != 1.0:
            q_c = q_c * scale
        fq, fk = fmap.phi(q_c, pos), fmap.psi(k_c, pos)
        if fq.shape[:3] != (B, T, H) or fk.shape[:3] != (B, T, H) or fq.shape[-1] != fk.shape[-1]:
            raise ValueError(f"feature map {fmap!r} must map [B, T, H, K] to [B, T, H, K_phi] for both phi and psi; "
                             f"got {tuple(fq.shape)} and {tuple(fk.shape)}")
        code, kscale = FMAP_IDENTITY, 1.0
    Kf = fq.shape[-1]
    glog = _gate_to_log(gamma, g, B, T, H, Kf, torch.float32, dev)
    if glog is not None and glog.shape[-1] != 1:
        raise NotImplementedError("diagonal gates g [B, T, H, K] are not covered by the Triton kernels; "
                                  "use backend='torch'")
    gflat = glog[..., 0].transpose(1, 2).reshape(B * T, H).contiguous() if glog is not None else None
    h0 = z0 = None
    if initial_state is not None:
        S0, _, offset0 = _check_state(initial_state, N, H, Kf, V, False, torch.float32, dev)
        h0, z0 = S0[..., :V].contiguous(), S0[..., V].contiguous()
    flat = [x.reshape(B * T, H, x.shape[-1]).contiguous() for x in (fq, fk, v)]
    seq_lens = torch.tensor([b - a for a, b in zip(starts[:-1], starts[1:])], dtype=torch.int64, device=dev)
    return dict(B=B, T=T, H=H, V=V, N=N, starts=starts, code=code, kscale=kscale, flat=flat, g=gflat,
                h0=h0, z0=z0, offset_out=offset0 + seq_lens)


def _finish(p, num, den, ht, zt, normalize, eps, out_dtype, output_final_state):
    if normalize:
        floor = torch.as_tensor(eps, dtype=den.dtype, device=den.device)
        den = torch.where(den < 0, torch.minimum(den, -floor), torch.maximum(den, floor))
        out = num / den.unsqueeze(-1)
    else:
        out = num
    out = out.view(p["B"], p["T"], p["H"], p["V"]).to(out_dtype)
    state = None
    if output_final_state:
        state = LinearAttentionState(kv=ht, z=zt, log_scale=None, offset=p["offset_out"])
    return out, state


def chunk_linear_attention(
    q, k, v, *, feature_map="elu+1", normalize=True, gamma=None, g=None, scale=1.0, chunk_size=64,
    initial_state=None, output_final_state=False, cu_seqlens=None, eps=1e-6,
):
    """`linear_attention(..., causal=True, mode="chunk")` on the Triton kernels (forward and backward).

    Same arguments, results and state as the operator, for linear-space feature maps with no gate,
    a constant `gamma` or a scalar gate `g` [B, T, H]; fp16 / bf16 / fp32 inputs. identity, elu+1
    and relu are fused into the kernels; other linear-space maps are applied by PyTorch first.
    The chunk tile is `chunk_size` when it is 16, 32 or 64, else 64 (the result does not depend on it).
    """
    p = _prepare(q, k, v, feature_map, normalize, gamma, g, scale, chunk_size, initial_state, cu_seqlens,
                 eps, "chunk")
    fq, fk, vf = p["flat"]
    BT = chunk_size_for(chunk_size)
    norm = bool(normalize or output_final_state)
    cfg = _Cfg(prepare_chunks(p["starts"], BT, q.device), BT, p["code"], p["kscale"], norm, dot_precision(q.dtype))
    num, den, ht, zt = _ChunkLinearAttention.apply(fq, fk, vf, p["g"], p["h0"], p["z0"], cfg,
                                                   bool(output_final_state))
    return _finish(p, num, den, ht, zt, normalize, eps, q.dtype, output_final_state)


@torch.no_grad()
def fused_recurrent_linear_attention(
    q, k, v, *, feature_map="elu+1", normalize=True, gamma=None, g=None, scale=1.0,
    initial_state=None, output_final_state=False, cu_seqlens=None, eps=1e-6, chunk_size=64,
):
    """`linear_attention(..., mode="recurrent")` as one fused kernel (decoding; forward only: no
    gradients flow through it). Same arguments, results and state as the operator."""
    p = _prepare(q, k, v, feature_map, normalize, gamma, g, scale, chunk_size, initial_state, cu_seqlens,
                 eps, "recurrent")
    fq, fk, vf = p["flat"]
    TT, H, K = fq.shape
    V, N, dev = p["V"], p["N"], q.device
    BK, BV = block(K), block(V)
    NK = triton.cdiv(K, BK)
    norm = bool(normalize or output_final_state)
    num = torch.empty(NK, TT, H, V, dtype=torch.float32, device=dev)
    den = torch.empty(NK, TT, H, dtype=torch.float32, device=dev) if norm else dummy(dev)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else dummy(dev)
    zt = torch.empty(N, H, K, dtype=torch.float32, device=dev) if (output_final_state and norm) else dummy(dev)
    cu = torch.tensor(p["starts"], dtype=torch.int64, device=dev)
    _recurrent_fwd[(NK, triton.cdiv(V, BV), N * H)](
        fq, fk, vf, p["g"] if p["g"] is not None else dummy(dev), num, den,
        p["h0"] if p["h0"] is not None else dummy(dev), p["z0"] if p["z0"] is not None else dummy(dev),
        ht, zt, cu, p["kscale"], TT, H, K, V,
        BK=BK, BV=BV, FMAP=p["code"], USE_G=p["g"] is not None, NORM=norm, USE_H0=p["h0"] is not None,
        STORE_HT=bool(output_final_state))
    num = num[0] if NK == 1 else num.sum(0)
    den = (den[0] if NK == 1 else den.sum(0)) if norm else None
    return _finish(p, num, den, ht, zt if norm else None, normalize, eps, q.dtype, output_final_state)


def linear_attention_triton(q, k, v, *, feature_map="elu+1", causal=True, normalize=True, gamma=None, g=None,
                            scale=1.0, mode="chunk", chunk_size=64, initial_state=None, output_final_state=False,
                            cu_seqlens=None, eps=1e-6):
    """The operator's full signature, routed to the chunk or the fused recurrent kernels
    (called by `linattn.linear_attention` when its backend resolves to "triton")."""
    if not causal:
        raise NotImplementedError("the Triton kernels cover causal attention; use backend='torch' for causal=False")
    kw = dict(feature_map=feature_map, normalize=normalize, gamma=gamma, g=g, scale=scale, chunk_size=chunk_size,
              initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens, eps=eps)
    if mode == "recurrent":
        return fused_recurrent_linear_attention(q, k, v, **kw)
    if mode == "chunk":
        return chunk_linear_attention(q, k, v, **kw)
    raise NotImplementedError(f"mode={mode!r} has no Triton kernel (chunk and recurrent do); use backend='torch'")
