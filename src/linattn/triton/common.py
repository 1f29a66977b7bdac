"""What the Triton kernels share: block sizes, the chunk index of packed sequences, the in-kernel
feature maps, and the two chunk kernels both families use (the intra-chunk output `_fwd_o` and its
dv backward `_bwd_dv`). Imports triton (only imported once the Triton backend is chosen)."""
from __future__ import annotations

from typing import List, NamedTuple

import torch
import triton
import triton.language as tl

from ..errors import LinattnError
from ..feature_codes import FMAP_ELU1, FMAP_IDENTITY, FMAP_RELU, FUSED_MAPS  # noqa: F401

# feature maps fused into the kernels, by the name a FeatureMap gives as its `fused_kernel`, come from
# feature_codes (one table with the CPU kernels; other maps are computed in PyTorch and passed as identity)
MAX_FULL_DIM = 256  # kernels that hold a whole K (or K x BV) state in registers


def block(n: int, cap: int = 64) -> int:
    """A power-of-two tile >= 16 (tl.dot's minimum) covering n, at most `cap`."""
    return min(cap, max(16, triton.next_power_of_2(n)))


def full_block(n: int, name: str) -> int:
    b = max(16, triton.next_power_of_2(n))
    if b > MAX_FULL_DIM:
        raise ValueError(f"the Triton kernels keep a whole {name} = {n} in registers and support "
                         f"{name} <= {MAX_FULL_DIM}; use backend='torch'")
    return b


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot precision: exact fp32 ('ieee') for fp32 inputs; 'tf32' for 16-bit inputs, whose own
    rounding (2^-8 / 2^-11) is at least as large as tf32's (2^-11). Operands stay fp32 either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


class Chunks(NamedTuple):
    """Packed sequences cut into chunks of BT tokens that never cross a sequence boundary.

    cu:      int64 [N+1], sequence starts on the flattened token axis
    index:   int32 [NT, 2], (sequence, chunk within the sequence) of every chunk, in order
    offsets: int64 [N+1], index of each sequence's first chunk (row of the per-chunk state arrays)
    """
    cu: torch.Tensor
    index: torch.Tensor
    offsets: torch.Tensor
    N: int
    NT: int


def prepare_chunks(starts: List[int], BT: int, device) -> Chunks:
    lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    n_chunks = [-(-n // BT) for n in lens]
    index, offsets = [], [0]
    for i, c in enumerate(n_chunks):
        index.extend((i, j) for j in range(c))
        offsets.append(offsets[-1] + c)
    return Chunks(
        cu=torch.tensor(starts, dtype=torch.int64, device=device),
        index=torch.tensor(index, dtype=torch.int32, device=device).view(-1, 2),
        offsets=torch.tensor(offsets, dtype=torch.int64, device=device),
        N=len(lens), NT=offsets[-1])


def heads(qk: torch.Tensor, v: torch.Tensor):
    """(TT, H, HQ) of a call: H value heads (v, gates, states, outputs), HQ query/key heads; value head j
    reads q/k head j // (H // HQ) (grouped value heads; HQ == H is the plain case)."""
    TT, HQ = qk.shape[:2]
    H = v.shape[1]
    if HQ < 1 or H % HQ:
        raise LinattnError(f"the value heads ({H}) must be a multiple of the query/key heads ({HQ})")
    return TT, H, HQ


def group_sum(dx: torch.Tensor, HQ: int) -> torch.Tensor:
    """[TT, H, K] per value head -> [TT, HQ, K]: the gradient of a q/k head sums over the value heads
    that read it."""
    TT, H, K = dx.shape
    return dx if H == HQ else dx.view(TT, HQ, H // HQ, K).sum(2)


def absent(like: torch.Tensor) -> torch.Tensor:
    """The empty stand-in of an absent output of a custom op (whose outputs are tensors only); a new one
    each time, since the outputs of a custom op must not alias each other."""
    return like.new_empty(0, dtype=torch.float32)


def dummy(device) -> torch.Tensor:
    """A placeholder for a pointer argument the kernel does not read (its flag is off)."""
    return torch.empty(1, dtype=torch.float32, device=device)


@triton.jit
def chunk_tokens(cu, chunk_index, i_t, BT: tl.constexpr):
    """Chunk i_t of the packed sequences: (its index i_c within its sequence, the sequence length T,
    the offsets 0..BT-1, their positions in the sequence, which are real tokens, and their rows on
    the flattened token axis)."""
    i_n, i_c = tl.load(chunk_index + i_t * 2), tl.load(chunk_index + i_t * 2 + 1)
    bos, eos = tl.load(cu + i_n), tl.load(cu + i_n + 1)
    T = (eos - bos).to(tl.int32)
    o_i = tl.arange(0, BT)
    o_t = i_c * BT + o_i
    return i_c, T, o_i, o_t, o_t < T, bos + o_t


@triton.jit
def phi(x, FMAP: tl.constexpr):
    """The fused feature maps: identity, elu(x) + 1 (= x + 1 for x > 0, exp(x) else), relu."""
    if FMAP == 1:
        return tl.where(x > 0, x + 1.0, tl.exp(tl.minimum(x, 0.0)))
    elif FMAP == 2:
        return tl.maximum(x, 0.0)
    else:
        return x


@triton.jit
def dphi(x, FMAP: tl.constexpr):
    """Their derivatives, as torch's autograd defines them (relu'(0) = 0, elu'(0) = 1)."""
    if FMAP == 1:
        return tl.where(x > 0, 1.0, tl.exp(tl.minimum(x, 0.0)))
    elif FMAP == 2:
        return tl.where(x > 0, 1.0, 0.0)
    else:
        return tl.full(x.shape, 1.0, tl.float32)


# ----------------------------------------------------------------------------------------------
# kernels shared by linear.py and delta.py: the intra-chunk output and its dv backward
# ----------------------------------------------------------------------------------------------

@triton.jit
def _fwd_o(q, k, v, g, h, z, o, den, cu, chunk_index, scale,
           H, HQ, K, V,
           BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr,
           USE_G: tl.constexpr, NORM: tl.constexpr, PREC: tl.constexpr):
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
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
        b_q = tl.load(q + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_q = tl.where(m_tk, phi(b_q * scale, FMAP), 0.)
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
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
def _bwd_dv(q, k, g, do, dh, dv, cu, chunk_index, scale,
            H, HQ, K, V,
            BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, FMAP: tl.constexpr,
            USE_G: tl.constexpr, USE_DH: tl.constexpr, PREC: tl.constexpr):
    """dv = A^T do (+ (fk e^{G_l - G}) dh_{c+1}); with USE_DH=False it is the delta rule's
    intra-chunk gradient of the pseudo-values."""
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (H // HQ)  # the q/k head read by value head i_h (grouped value heads)
    i_c, T, o_i, o_t, m_t, tok = chunk_tokens(cu, chunk_index, i_t, BT)
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
        b_q = tl.load(q + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
        b_q = tl.where(m_tk, phi(b_q * scale, FMAP), 0.)
        b_k = tl.load(k + (tok[:, None] * HQ + i_hk) * K + o_k[None, :], mask=m_tk, other=0.).to(tl.float32)
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



class KernelConfig:
    """Static configuration of one call (not a tensor: kept on ctx)."""

    def __init__(self, chunks, BT, fmap, scale, norm, prec):
        self.chunks, self.BT, self.fmap, self.scale, self.norm, self.prec = chunks, BT, fmap, scale, norm, prec


def chunk_fwd_o(q, k, v, g, h, z, cfg, scale, fmap, norm):
    """num [TT, H, V] fp32 (and den [TT, H] fp32 when norm) from the per-chunk states."""
    TT, H, HQ = heads(q, v)
    K, V = q.shape[-1], v.shape[-1]
    ch, dev = cfg.chunks, q.device
    BK, BV = block(K), block(V)
    o = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
    den = torch.empty(TT, H, dtype=torch.float32, device=dev) if norm else dummy(dev)
    grid = (triton.cdiv(V, BV), ch.NT, H)
    _fwd_o[grid](q, k, v, g if g is not None else dummy(dev), h, z if norm else dummy(dev), o, den,
                 ch.cu, ch.index, scale, H, HQ, K, V,
                 BT=cfg.BT, BK=BK, BV=BV, FMAP=fmap, USE_G=g is not None, NORM=norm, PREC=cfg.prec)
    return o, (den if norm else None)


def chunk_bwd_dv(q, k, g, do, dh, cfg, scale, fmap):
    """A^T do (+ the state term when dh [NT, H, K, V] is given), fp32 [TT, H, V]."""
    TT, H, HQ = heads(q, do)
    K, V = q.shape[-1], do.shape[-1]
    ch, dev = cfg.chunks, q.device
    BK, BV = block(K), block(V)
    dv = torch.empty(TT, H, V, dtype=torch.float32, device=dev)
    grid = (triton.cdiv(V, BV), ch.NT, H)
    _bwd_dv[grid](q, k, g if g is not None else dummy(dev), do, dh if dh is not None else dummy(dev), dv,
                  ch.cu, ch.index, scale, H, HQ, K, V,
                  BT=cfg.BT, BK=BK, BV=BV, FMAP=fmap, USE_G=g is not None, USE_DH=dh is not None,
                  PREC=cfg.prec)
    return dv
