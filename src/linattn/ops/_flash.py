"""Blockwise (flash-attention style) softmax attention with a forget-gate bias: the shared engine of
the softmax side of the family (`forgetting.py`, `deltaformer.py`; `path.py` has its own sweep).

    o_i = sum_{j <= i, i - j < window} softmax_j(s_ij) v_j,      s_ij = q_i . k_j + G_i - G_j,

q already scaled, G the cumulative log-gate (None: no bias). Layout inside: [N, T, D] with N = B * H,
T padded to n blocks of C tokens.

The sweep runs over block *diagonals*: at offset d every query block b meets key block b - d, for
all b at once (batched matmuls on [N, n - d, C, C]), with the online softmax (running max m,
denominator l, accumulator) carried per query row. Offset 0 (the diagonal blocks, which hold every
row's own key) runs first, so every running max is finite from then on and no -inf - -inf ever
occurs. A window stops the sweep after ceil((window + C - 1) / C) offsets: O(T * window) work.
Memory: the accumulators O(T * V) plus one [N, n - d, C, C] score tensor per step, O(T * C); never a
T x T matrix.

Backward (`_FlashAttention`, a custom autograd.Function): recomputes the same blocks from q, k, v, G
and the per-row log-sum-exp saved by the forward (FlashAttention-2's backward): D_i = dO_i . o_i,
P = exp(s - lse), dS = P * (dO V^T - D), dq += dS K, dk += dS^T Q, dv += P^T dO, and for the bias
dG_i += sum_j dS_ij, dG_j -= sum_i dS_ij. Memory O(T * C) as in the forward.

Gate precision. G = cumsum(g) is accumulated in fp64 (a [B, T, H] vector: free). Each query block b
subtracts its own anchor a_b = G at its first token (in fp64) from the query and key gates before
they are cast to the compute dtype, so a bias G_i - G_j is rounded relative to its own size, not to
the size of G_i (which reaches -8e4 after 4096 tokens of g = -20, where fp32's spacing is 8e-3).
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

from .. import fla
from ..errors import LinattnError, LinattnTypeError
from ._common import FLOAT_DTYPES, check_cu_seqlens, check_same_device, check_scale, check_values, pad_time

NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------
# Argument checks shared by forgetting_attention, deltaformer and path_attention
# ----------------------------------------------------------------------------------------------

def check_block_size(block_size) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise LinattnError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def check_window(window) -> Optional[int]:
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise LinattnError(f"window must be a positive int (keys with i - j < window) or None, got {window!r}")
    return window


def check_flag(x, name: str) -> bool:
    if not isinstance(x, bool):
        raise LinattnTypeError(f"{name} must be a bool, got {type(x).__name__}")
    return x


def check_mode(mode) -> str:
    modes = ("parallel", "chunk", "recurrent")
    if mode not in modes:
        raise LinattnError(f"mode must be one of {modes}, got {mode!r}")
    return mode


def check_per_token(x, name: str, B: int, T: int, H: int, ref: torch.Tensor, *, nonneg: bool) -> None:
    """A per-token, per-head scalar `[B, T, H]` (beta): shape, dtype, device; finite and (if nonneg)
    >= 0 when value checks run."""
    if not isinstance(x, torch.Tensor):
        raise LinattnTypeError(f"{name} must be a torch.Tensor of shape [B, T, H] = {(B, T, H)}, "
                               f"got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise LinattnTypeError(f"{name} must be float16, bfloat16, float32 or float64, got {x.dtype}")
    if tuple(x.shape) != (B, T, H):
        raise LinattnError(f"{name} must have shape [B, T, H] = {(B, T, H)}, got {tuple(x.shape)}")
    check_same_device(x, name, ref)
    if check_values(x):
        if not bool(torch.isfinite(x).all()):
            raise LinattnError(f"{name} must be finite (it contains NaN or inf)")
        if nonneg and not bool((x >= 0).all()):
            raise LinattnError(f"{name} must be >= 0 everywhere, got a minimum of {x.min().item():.4g}")


def check_finite_gate(g, name: str = "g") -> None:
    if check_values(g) and not bool(torch.isfinite(g).all()):
        raise LinattnError(f"{name} must be finite (a log-gate of -inf would cut the sequence; use a large "
                           f"negative value)")


def check_scale_state_packing(scale, K: int, output_final_state, cu_seqlens, B: int, T: int):
    """The common tail of the three operators' checks -> (scale, offsets): scale (None: K^-1/2), the
    output_final_state flag, cu_seqlens, and no decoding state for packed sequences."""
    scale = check_scale(scale, K ** -0.5)
    check_flag(output_final_state, "output_final_state")
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    if offsets is not None and output_final_state:
        raise LinattnError("output_final_state cannot be combined with cu_seqlens (packed sequences have no "
                           "single decoding state); decode a [B, T] batch instead")
    return scale, offsets


# ----------------------------------------------------------------------------------------------
# Gates: fp64 cumulative sums, anchored per block before the cast
# ----------------------------------------------------------------------------------------------

def cumulative_gate(g: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """G = cumsum(g) along the last axis, in fp64 (differentiable)."""
    return None if g is None else g.double().cumsum(-1)


def anchored(Gb: torch.Tensor, cdt: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gb [N, n, C] fp64 -> (anchor a [N, n] fp64 = G at each block's first token,
    the block's own gates relative to it, [N, n, C] in `cdt`)."""
    a = Gb[..., 0]
    return a, (Gb - a.unsqueeze(-1)).to(cdt)


# ----------------------------------------------------------------------------------------------
# The diagonal sweep
# ----------------------------------------------------------------------------------------------

def _offsets(n: int, C: int, window: Optional[int], device) -> Iterator[Tuple[int, Optional[torch.Tensor]]]:
    """(d, mask [C, C] or None) for every block offset d with at least one pair in range; the mask
    keeps pairs with 0 <= i - j (< window), i - j = d C + r_i - r_j."""
    d_max = n - 1 if window is None else min(n - 1, (window + C - 2) // C)
    r = torch.arange(C, device=device)
    diff0 = r[:, None] - r[None, :]
    for d in range(d_max + 1):
        diff = diff0 + d * C
        if d == 0:
            mask = diff >= 0
            if window is not None:
                mask = mask & (diff < window)
        elif window is not None and d * C + C - 1 >= window:
            mask = diff < window
        else:
            mask = None
        yield d, mask


LOG2E = 1.4426950408889634


def base2(dtype: torch.dtype):
    """(factor, exp, log) of the softmax arithmetic: fp32 works in base 2 (scores times log2(e), then
    exp2 / log2: the same numbers, and exp2 is several times faster than exp on CPUs and maps to the
    hardware's ex2 on GPUs); fp64 keeps base e (exp is the faster of the two there)."""
    if dtype == torch.float64:
        return 1.0, torch.exp, torch.log
    return LOG2E, torch.exp2, torch.log2


def _scores(qb, kb, gq, Gb, anchor, d: int, n: int, cdt, factor: float):
    """Scores (times `factor`) of query blocks d.. against key blocks ..n-d: [n - d, N, C, C].
    Blocks are block-major, [n, N, C, D] (a slice along blocks stays one contiguous batch, so every
    matmul is a plain bmm without copies); qb is already multiplied by `factor`, gq likewise."""
    s = qb[d:] @ kb[: n - d].transpose(-1, -2)
    if Gb is not None:
        gk = ((Gb[: n - d] - anchor[d:, :, None]) * factor).to(cdt)      # keys relative to the query anchor
        s.add_(gq[d:, :, :, None]).sub_(gk[:, :, None, :])
    return s


def _gates(G, cdt, factor):
    """G [n, N, C] fp64 -> (G, anchors [n, N], the rows' gates relative to their anchor, times factor)."""
    if G is None:
        return None, None, None
    anchor, gq = anchored(G, torch.float64)
    return G, anchor, (gq * factor).to(cdt)


class _FlashAttention(torch.autograd.Function):
    """Block-major q (scaled), k [n, N, C, K], v [n, N, C, V], G [n, N, C] fp64 or None -> o
    [n, N, C, V]. Saves the row log-sum-exp in the sweep's units (base 2 for fp32, see `base2`)."""

    @staticmethod
    def forward(ctx, q, k, v, G, window: Optional[int]):
        n, N, C, _ = q.shape
        V = v.shape[-1]
        cdt = q.dtype
        factor, ex, lg = base2(cdt)
        qf = q * factor
        Gb, anchor, gq = _gates(G, cdt, factor)
        m = q.new_full((n, N, C), NEG_INF)
        l_ = q.new_zeros((n, N, C))
        acc = q.new_zeros((n, N, C, V))
        for d, mask in _offsets(n, C, window, q.device):
            s = _scores(qf, k, gq, Gb, anchor, d, n, cdt, factor)
            if mask is not None:
                s.masked_fill_(~mask, NEG_INF)
            m_d, l_d, acc_d = m[d:], l_[d:], acc[d:]
            m_new = torch.maximum(m_d, s.amax(-1))
            alpha = ex(m_d - m_new)                   # 0 at d = 0 (m = -inf, m_new finite)
            p = ex(s.sub_(m_new.unsqueeze(-1)))
            l_d.mul_(alpha).add_(p.sum(-1))
            acc_d.mul_(alpha.unsqueeze(-1)).add_(p @ v[: n - d])
            m_d.copy_(m_new)
        o = acc.div_(l_.unsqueeze(-1))
        lse = m.add_(lg(l_))
        ctx.save_for_backward(q, k, v, G, o, lse)
        ctx.window = window
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, G, o, lse = ctx.saved_tensors
        window = ctx.window
        n, N, C, _ = q.shape
        cdt = q.dtype
        factor, ex, _ = base2(cdt)
        qf = q * factor
        do = do.to(cdt)
        Dsum = (do * o).sum(-1)                                         # [n, N, C]
        Gb, anchor, gq = _gates(G, cdt, factor)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        dG = q.new_zeros((n, N, C)) if G is not None else None
        for d, mask in _offsets(n, C, window, q.device):
            s = _scores(qf, k, gq, Gb, anchor, d, n, cdt, factor)
            if mask is not None:
                s.masked_fill_(~mask, NEG_INF)
            p = ex(s.sub_(lse[d:].unsqueeze(-1)))
            do_d = do[d:]
            dv[: n - d] += p.transpose(-1, -2) @ do_d
            ds = (do_d @ v[: n - d].transpose(-1, -2)).sub_(Dsum[d:].unsqueeze(-1)).mul_(p)
            dq[d:] += ds @ k[: n - d]
            dk[: n - d] += ds.transpose(-1, -2) @ q[d:]
            if dG is not None:
                dG[d:] += ds.sum(-1)
                dG[: n - d] -= ds.sum(-2)
        return dq, dk, dv, (dG.to(G.dtype) if dG is not None else None), None


def _block_major(x: torch.Tensor, C: int) -> torch.Tensor:
    """[N, n C, *] -> [n, N, C, *] (contiguous)."""
    N, Tp = x.shape[:2]
    return x.reshape(N, Tp // C, C, *x.shape[2:]).transpose(0, 1).contiguous()


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor],
                    block_size: int, window: Optional[int] = None) -> torch.Tensor:
    """Causal softmax attention with the bias G_i - G_j (G = cumsum(g) along T), blockwise.

    q (scaled), k [N, T, K], v [N, T, V] in the compute dtype; g [N, T] log-gates or None.
    Returns o [N, T, V]. Memory O(T * block) in forward and backward.
    """
    N, T, _ = q.shape
    C = min(block_size, T)
    qb, kb, vb = (_block_major(pad_time(x, C, dim=1), C) for x in (q, k, v))
    G = _block_major(cumulative_gate(pad_time(g, C, dim=1)), C) if g is not None else None   # padding: g = 0
    o = _FlashAttention.apply(qb, kb, vb, G, window)
    # explicit sizes: -1 cannot be inferred when N or V is 0 (empty batches give empty outputs)
    return o.transpose(0, 1).reshape(N, qb.shape[0] * C, v.shape[-1])[:, :T]


# ----------------------------------------------------------------------------------------------
# Dense helpers for the parallel forms and the decoding steps
# ----------------------------------------------------------------------------------------------

def causal_mask(T: int, device, window: Optional[int] = None, strict: bool = False) -> torch.Tensor:
    i = torch.arange(T, device=device)
    diff = i[:, None] - i[None, :]
    mask = diff > 0 if strict else diff >= 0
    if window is not None:
        mask = mask & (diff < window)
    return mask


def gate_bias(G: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """G [..., T] fp64 -> G_i - G_j [..., T, T] (differences in fp64, then cast)."""
    return (G.unsqueeze(-1) - G.unsqueeze(-2)).to(cdt)


def masked_softmax(s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Softmax over the last axis restricted to `mask`; rows with no entry give zeros (not NaN)."""
    s = s.masked_fill(~mask, NEG_INF)
    mx = s.amax(-1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx)).detach()
    e = torch.exp(s - mx)
    z = e.sum(-1, keepdim=True)
    return e / torch.where(z > 0, z, torch.ones_like(z))


def empty_kv_cache(k: torch.Tensor, v: torch.Tensor, gated: bool):
    """An empty decoding cache for [B, T, H, *] keys and values: (keys, values, the cached G's, the
    running G), the last two fp64 [B, 0, H] and [B, H] if `gated`, else None."""
    B, _, H, K = k.shape
    G0 = (k.new_zeros(B, 0, H, dtype=torch.float64), k.new_zeros(B, H, dtype=torch.float64)) if gated else (None, None)
    return (k.new_zeros(B, 0, H, K), v.new_zeros(B, 0, H, v.shape[-1])) + G0


def kv_cache_attend(q_t, k_t, v_t, g_t, kc, vc, Gc, G_now, window: Optional[int] = None):
    """One decoding step: append k_t, v_t [B, 1, H, *] (and G_now + g_t, fp64) to the cache, keep the
    last `window` entries, attend with q_t [B, H, K] (scaled) -> (o_t [B, H, V], kc, vc, Gc, G_now)."""
    kc = torch.cat([kc, k_t], dim=1)
    vc = torch.cat([vc, v_t], dim=1)
    if window is not None and kc.shape[1] > window:
        kc, vc = kc[:, -window:], vc[:, -window:]
    s = torch.einsum("bhk,blhk->blh", q_t, kc)
    if g_t is not None:
        G_now = G_now + g_t.double()
        Gc = torch.cat([Gc, G_now.unsqueeze(1)], dim=1)
        if window is not None and Gc.shape[1] > window:
            Gc = Gc[:, -window:]
        s = s + (G_now.unsqueeze(1) - Gc).to(s.dtype)
    p = torch.softmax(s, dim=1)
    return torch.einsum("blh,blhv->bhv", p, vc), kc, vc, Gc, G_now


def to_heads_first(x: torch.Tensor, cdt: torch.dtype) -> torch.Tensor:
    """[B, T, H, *] -> [B * H, T, *] in the compute dtype (contiguous)."""
    B, T, H = x.shape[:3]
    x = x.to(cdt).transpose(1, 2)
    return x.reshape(B * H, T, *x.shape[3:]).contiguous()


def from_heads_first(x: torch.Tensor, B: int, H: int) -> torch.Tensor:
    """[B * H, T, *] -> [B, T, H, *]."""
    return x.reshape(B, H, *x.shape[1:]).transpose(1, 2)


__all__ = ["flash_attention", "check_block_size", "check_window", "check_flag", "check_mode", "check_per_token",
           "check_finite_gate", "check_scale_state_packing", "cumulative_gate", "anchored", "causal_mask", "gate_bias",
           "masked_softmax", "empty_kv_cache", "kv_cache_attend", "to_heads_first", "from_heads_first", "NEG_INF",
           "base2", "LOG2E"]


FLA_ATTN_BLOCK = 128   # fla's parallel attention kernels' query tile


class FlaSoftmaxCall:
    """The backend questions of a prepared softmax-side call (a dataclass with q, mode, block_size,
    output_final_state, out_dtype): fla covers its blockwise form, nothing else; linattn has no Triton or compiled
    CPU kernel for it. A subclass names fla's function and its head-size rule (`fla_head_dims`)."""

    fla_kernel = "fla's kernel"

    def fla_head_dims(self) -> Optional[str]:
        """Why fla rejects these head sizes (None when it takes them)."""
        return None

    def fla_unsupported(self) -> Optional[str]:
        """Why fla's kernel does not cover this call (None when it does; the dispatch checks device and fla)."""
        if self.out_dtype not in fla.DTYPES:
            return f"fla's kernels take fp16 / bf16 / fp32 inputs, not {self.out_dtype}"
        if self.mode != "chunk":
            return f"mode={self.mode!r}: fla's {self.fla_kernel} is the blockwise (chunk) form"
        if self.output_final_state:
            return "output_final_state: the decoding state (linattn's cache) is not fla's"
        return self.fla_head_dims()

    def triton_unsupported(self) -> Optional[str]:
        return "the softmax side has no linattn Triton kernel"

    def chunk_size_used(self, backend: str) -> int:
        """The block length a backend really uses (fla: its 128-query tiles; parallel: T; recurrent: 1)."""
        if self.mode == "recurrent":
            return 1
        if self.mode == "parallel":
            return self.q.shape[1]
        return FLA_ATTN_BLOCK if backend == "fla" else self.block_size
