"""Triton kernels for causal kernelized linear attention (`linear_attention`): the chunk form
(forward and backward) and a fused recurrent form for decoding (forward only).

Layout: every sequence tensor is flattened to [TT, H, D] (TT = B*T tokens, or the packed tokens of
cu_seqlens); a batch of B sequences of length T is the packed batch with cu_seqlens = [0, T, .., BT].
Chunks of BT tokens never cross a sequence boundary (`common.prepare_chunks`).

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

from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from . import triton_chunk_size
from .common import (
    FUSED_MAPS,
    KernelConfig,
    absent,
    block,
    chunk_bwd_dv,
    chunk_fwd_o,
    chunk_tokens,
    dot_precision,
    dphi,
    dummy,
    group_sum,
    heads,
    phi,
    prepare_chunks,
)

# ----------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_h(k, v, g, h, z, h0, z0, ht, zt, cu, chunk_offsets,
           H, HQ, K, V,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr,
           USE_G: tl.constexpr, NORM: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
           PREC: tl.constexpr):
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
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
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
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
def _bwd_dh(q, g, do, dden, dh, dz, dht, dzt, dh0, dz0, cu, chunk_offsets, scale,
            H, HQ, K, V,
            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr,
            USE_G: tl.constexpr, NORM: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
            PREC: tl.constexpr):
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
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
        b_q = tl.load(q + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
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
              TT, H, HQ, K, V,
              BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr,
              USE_G: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr):
    i_k, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]
    row = i_t.to(tl.int64) * H + i_h

    b_xq = tl.load(q + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32) * scale
    b_xk = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
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
def _recurrent_fwd(q, k, v, g, o, den, h0, z0, ht, zt, cu, scale,
                   TT, H, HQ, K, V,
                   BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr, USE_G: tl.constexpr,
                   GK: tl.constexpr, NORM: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr):
    """One token at a time, a [BK, BV] block of the state in registers: decoding (T = 1) and short
    prompts. K blocks write partial outputs o [NK, TT, H, V] / den [NK, TT, H], summed by the caller."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
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
        b_q = tl.load(q + (tok * HQ + i_hk) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_q = tl.where(m_k, phi(b_q * scale, FMAP), 0.)
        b_k = tl.load(k + (tok * HQ + i_hk) * K + o_k, mask=m_k, other=0.).to(tl.float32)
        b_k = tl.where(m_k, phi(b_k, FMAP), 0.)
        b_v = tl.load(v + (tok * H + i_h) * V + o_v, mask=m_v, other=0.).to(tl.float32)
        if USE_G:
            if GK:  # diagonal (GLA) gates: a log-gate per feature, g [TT, H, K]
                b_gk = tl.exp(tl.load(g + (tok * H + i_h) * K + o_k, mask=m_k, other=0.))
                b_h = b_h * b_gk[:, None]
                b_z = b_z * b_gk
            else:
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

def chunk_fwd_h(k, v, g, h0, z0, cfg, norm, store_final, fmap=None):
    """Per-chunk states h [NT, H, K, V] (and z [NT, H, K] when norm), final states (or None)."""
    TT, H, HQ = heads(k, v)
    K, V = k.shape[-1], v.shape[-1]
    ch, dev = cfg.chunks, k.device
    BK, BV = block(K), block(V)
    h = torch.empty(ch.NT, H, K, V, dtype=torch.float32, device=dev)
    z = torch.empty(ch.NT, H, K, dtype=torch.float32, device=dev) if norm else dummy(dev)
    ht = torch.empty(ch.N, H, K, V, dtype=torch.float32, device=dev) if store_final else dummy(dev)
    zt = torch.empty(ch.N, H, K, dtype=torch.float32, device=dev) if (store_final and norm) else dummy(dev)
    grid = (triton.cdiv(K, BK), triton.cdiv(V, BV), ch.N * H)
    _fwd_h[grid](k, v, g if g is not None else dummy(dev), h, z,
                 h0 if h0 is not None else dummy(dev), z0 if (z0 is not None and norm) else dummy(dev),
                 ht, zt, ch.cu, ch.offsets, H, HQ, K, V,
                 BT=cfg.BT, BK=BK, BV=BV, FMAP=cfg.fmap if fmap is None else fmap, USE_G=g is not None,
                 NORM=norm, USE_H0=h0 is not None, STORE_HT=store_final, PREC=cfg.prec)
    return h, (z if norm else None), (ht if store_final else None), (zt if (store_final and norm) else None)


def _given(x):
    """An output's gradient, or None when autograd gave none (or it is the empty stand-in of an absent output)."""
    return x if x is not None and x.numel() else None


def _config(q, fused, scale, norm, starts, chunk_size) -> KernelConfig:
    BT = triton_chunk_size(chunk_size)
    return KernelConfig(prepare_chunks(list(starts), BT, q.device), BT, FUSED_MAPS[fused], float(scale), bool(norm),
                        dot_precision(q.dtype))


def _chunk_fwd(q, k, v, g, h0, z0, cfg, output_final_state):
    """-> num [TT,H,V], den [TT,H] or None, h_T, z_T (or None), all fp32."""
    h, z, ht, zt = chunk_fwd_h(k, v, g, h0, z0, cfg, cfg.norm, output_final_state)
    num, den = chunk_fwd_o(q, k, v, g, h, z, cfg, cfg.scale, cfg.fmap, cfg.norm)
    return num, den, ht, zt


def _chunk_bwd(q, k, v, g, h0, z0, cfg, dnum, dden, dht, dzt, need_dh0):
    """-> dq, dk, dv (in the inputs' dtypes), dg [TT, H] or None, dh0, dz0 (or None)."""
    ch, dev = cfg.chunks, q.device
    TT, H, HQ = heads(q, v)
    K, V = q.shape[-1], v.shape[-1]
    norm = cfg.norm
    BK, BV = block(K), block(V)
    do = dnum.contiguous() if dnum is not None else torch.zeros(TT, H, V, dtype=torch.float32, device=dev)
    if norm:
        dd = dden.contiguous() if dden is not None else torch.zeros(TT, H, dtype=torch.float32, device=dev)
    h, z, _, _ = chunk_fwd_h(k, v, g, h0, z0, cfg, norm, False)

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
        ch.cu, ch.offsets, cfg.scale, H, HQ, K, V,
        BT=cfg.BT, BK=BK, BV=BV, FMAP=cfg.fmap, USE_G=g is not None, NORM=norm, USE_DHT=use_dht,
        STORE_DH0=need_dh0, PREC=cfg.prec)

    NK = triton.cdiv(K, BK)
    dq = torch.empty(TT, H, K, dtype=torch.float32, device=dev)
    dk = torch.empty(TT, H, K, dtype=torch.float32, device=dev)
    dg = torch.empty(NK, TT, H, dtype=torch.float32, device=dev) if g is not None else dummy(dev)
    _bwd_dqkg[(NK, ch.NT, H)](
        q, k, v, gd, h, z if norm else dummy(dev), do, dd if norm else dummy(dev), dh, dz, dq, dk, dg,
        ch.cu, ch.index, cfg.scale, TT, H, HQ, K, V,
        BT=cfg.BT, BK=BK, BV=BV, FMAP=cfg.fmap, USE_G=g is not None, NORM=norm, PREC=cfg.prec)
    dv = chunk_bwd_dv(q, k, g, do, dh, cfg, cfg.scale, cfg.fmap)
    return (group_sum(dq, HQ).to(q.dtype), group_sum(dk, HQ).to(k.dtype), dv.to(v.dtype),
            dg.sum(0) if g is not None else None,
            dh0 if need_dh0 else None, dz0 if (need_dh0 and norm) else None)


# ----------------------------------------------------------------------------------------------
# torch.library custom ops: torch.compile(fullgraph=True) sees one opaque op per pass (no graph break
# at the kernels' host code), with its fake (shape) implementation and its autograd formula. An
# absent optional output (den without norm, final states without output_final_state) is an empty
# tensor in the op's schema (ops return tensors only); the entry points below turn it back into None.
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("linattn::triton_linear_chunk_fwd", mutates_args=())
def _op_chunk_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                  h0: Optional[torch.Tensor], z0: Optional[torch.Tensor], fused: str, scale: float, norm: bool,
                  starts: List[int], chunk_size: int, output_final_state: bool
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = _config(q, fused, scale, norm, starts, chunk_size)
    num, den, ht, zt = _chunk_fwd(q, k, v, g, h0, z0, cfg, output_final_state)
    return (num, den if den is not None else absent(q), ht if ht is not None else absent(q),
            zt if zt is not None else absent(q))


@_op_chunk_fwd.register_fake
def _(q, k, v, g, h0, z0, fused, scale, norm, starts, chunk_size, output_final_state):
    TT, H, _ = heads(q, v)
    K, V, N = q.shape[-1], v.shape[-1], len(starts) - 1
    f32 = dict(dtype=torch.float32)
    return (q.new_empty(TT, H, V, **f32), q.new_empty((TT, H) if norm else (0,), **f32),
            q.new_empty((N, H, K, V) if output_final_state else (0,), **f32),
            q.new_empty((N, H, K) if (output_final_state and norm) else (0,), **f32))


@torch.library.custom_op("linattn::triton_linear_chunk_bwd", mutates_args=())
def _op_chunk_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                  h0: Optional[torch.Tensor], z0: Optional[torch.Tensor], dnum: Optional[torch.Tensor],
                  dden: Optional[torch.Tensor], dht: Optional[torch.Tensor], dzt: Optional[torch.Tensor],
                  fused: str, scale: float, norm: bool, starts: List[int],
                  chunk_size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                            torch.Tensor, torch.Tensor]:
    cfg = _config(q, fused, scale, norm, starts, chunk_size)
    dq, dk, dv, dg, dh0, dz0 = _chunk_bwd(q, k, v, g, h0, z0, cfg, dnum, dden if norm else None,
                                          _given(dht), _given(dzt), need_dh0=h0 is not None)
    return (dq, dk, dv, dg if dg is not None else absent(q), dh0 if dh0 is not None else absent(q),
            dz0 if dz0 is not None else absent(q))


@_op_chunk_bwd.register_fake
def _(q, k, v, g, h0, z0, dnum, dden, dht, dzt, fused, scale, norm, starts, chunk_size):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            torch.empty_like(g) if g is not None else absent(q),
            torch.empty_like(h0) if h0 is not None else absent(q),
            torch.empty_like(z0) if (h0 is not None and z0 is not None and norm) else absent(q))


def _setup_chunk(ctx, inputs, output):
    q, k, v, g, h0, z0, fused, scale, norm, starts, chunk_size, _ = inputs
    ctx.save_for_backward(q, k, v, g, h0, z0)
    ctx.meta = (fused, scale, norm, list(starts), chunk_size)


def _backward_chunk(ctx, dnum, dden, dht, dzt):
    q, k, v, g, h0, z0 = ctx.saved_tensors
    fused, scale, norm, starts, chunk_size = ctx.meta
    dq, dk, dv, dg, dh0, dz0 = torch.ops.linattn.triton_linear_chunk_bwd(
        q, k, v, g, h0, z0, dnum, dden, dht, dzt, fused, scale, norm, starts, chunk_size)
    return (dq, dk, dv, dg if g is not None else None, dh0 if h0 is not None else None,
            dz0 if (z0 is not None and h0 is not None and norm) else None, None, None, None, None, None, None)


_op_chunk_fwd.register_autograd(_backward_chunk, setup_context=_setup_chunk)


@torch.library.custom_op("linattn::triton_linear_recurrent_fwd", mutates_args=())
def _op_recurrent_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                      h0: Optional[torch.Tensor], z0: Optional[torch.Tensor], fused: str, scale: float, norm: bool,
                      starts: List[int], output_final_state: bool
                      ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    TT, H, HQ = heads(q, v)
    K, V, N, dev = q.shape[-1], v.shape[-1], len(starts) - 1, q.device
    BK, BV = block(K), block(V)
    NK = triton.cdiv(K, BK)
    num = torch.empty(NK, TT, H, V, dtype=torch.float32, device=dev)
    den = torch.empty(NK, TT, H, dtype=torch.float32, device=dev) if norm else dummy(dev)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else dummy(dev)
    zt = torch.empty(N, H, K, dtype=torch.float32, device=dev) if (output_final_state and norm) else dummy(dev)
    cu = torch.tensor(list(starts), dtype=torch.int64, device=dev)
    _recurrent_fwd[(NK, triton.cdiv(V, BV), N * H)](
        q, k, v, g if g is not None else dummy(dev), num, den,
        h0 if h0 is not None else dummy(dev), z0 if (z0 is not None and norm) else dummy(dev),
        ht, zt, cu, float(scale), TT, H, HQ, K, V,
        BK=BK, BV=BV, FMAP=FUSED_MAPS[fused], USE_G=g is not None, GK=g is not None and g.dim() == 3, NORM=norm,
        USE_H0=h0 is not None, STORE_HT=bool(output_final_state))
    num = num[0] if NK == 1 else num.sum(0)
    den = (den[0] if NK == 1 else den.sum(0)) if norm else absent(q)
    return (num, den, ht if output_final_state else absent(q),
            zt if (output_final_state and norm) else absent(q))


@_op_recurrent_fwd.register_fake
def _(q, k, v, g, h0, z0, fused, scale, norm, starts, output_final_state):
    TT, H, _ = heads(q, v)
    K, V, N = q.shape[-1], v.shape[-1], len(starts) - 1
    f32 = dict(dtype=torch.float32)
    return (q.new_empty(TT, H, V, **f32), q.new_empty((TT, H) if norm else (0,), **f32),
            q.new_empty((N, H, K, V) if output_final_state else (0,), **f32),
            q.new_empty((N, H, K) if (output_final_state and norm) else (0,), **f32))


# ----------------------------------------------------------------------------------------------
# entry points, on prepared tensors (the operator's checks and preprocessing happen in ops/ first):
# q, k [TT, HQ, K] raw queries/keys when `fused` names an in-kernel feature map (phi(scale q) is
# computed inside), else the features themselves with fused="identity" and scale=1; v [TT, H, V]
# (H a multiple of HQ: value head j reads q/k head j // (H // HQ)); g [TT, H] fp32 log-gate or None;
# h0 [N, H, K, V], z0 [N, H, K] fp32 or None; starts: the sequence boundaries on the TT axis.
# Returns num [TT, H, V] and den [TT, H] (or None), fp32, and the final states (or None).
# ----------------------------------------------------------------------------------------------

def chunk_linear_attention(q, k, v, g, h0, z0, *, fused: str, scale: float, norm: bool, starts: List[int],
                           chunk_size: int, output_final_state: bool):
    """The chunk form (forward and backward; the custom op linattn::triton_linear_chunk_fwd). The tile
    is `triton_chunk_size(chunk_size)`."""
    norm, fin = bool(norm), bool(output_final_state)
    num, den, ht, zt = torch.ops.linattn.triton_linear_chunk_fwd(
        q, k, v, g, h0, z0 if norm else None, fused, float(scale), norm, [int(s) for s in starts],
        int(chunk_size), fin)
    return num, (den if norm else None), (ht if fin else None), (zt if (fin and norm) else None)


def fused_recurrent_linear_attention(q, k, v, g, h0, z0, *, fused: str, scale: float, norm: bool,
                                     starts: List[int], output_final_state: bool):
    """The recurrent form as one fused kernel (decoding; forward only: no gradients flow through it;
    the custom op linattn::triton_linear_recurrent_fwd)."""
    norm, fin = bool(norm), bool(output_final_state)
    d = [x.detach() if x is not None else None for x in (q, k, v, g, h0, z0)]
    num, den, ht, zt = torch.ops.linattn.triton_linear_recurrent_fwd(
        *d[:5], d[5] if norm else None, fused, float(scale), norm, [int(s) for s in starts], fin)
    return num, (den if norm else None), (ht if fin else None), (zt if (fin and norm) else None)
