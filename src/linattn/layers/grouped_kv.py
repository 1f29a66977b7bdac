"""q/k/v of `AttentionBase` layers, with grouped k/v heads (GQA: fewer k/v heads than query heads, each serving a
group of query heads) or not. `AttentionBase._qkv`, softmax attention and linear attention use it, so it sits below
them all."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn as nn

from .cache import LayerCache
from .common import ShortConv
from .packing import packed_positions

if TYPE_CHECKING:   # only for the annotations: base.py imports more than these helpers need
    from .base import AttentionBase


def group_kv_heads(layer: AttentionBase, kv_heads: int) -> None:
    """Give `layer` (built with one k/v head per query head) `kv_heads` grouped k/v heads instead: smaller k/v
    projections (and short convolutions). `grouped_qkv` then projects, `repeat_kv` widens them for the operator."""
    if kv_heads == layer.n_heads:
        return
    bias, d = layer.q_proj.bias is not None, layer.d_model
    layer.k_proj = nn.Linear(d, kv_heads * layer.head_dim, bias=bias)
    layer.v_proj = nn.Linear(d, kv_heads * layer.head_dim_v, bias=bias)
    if layer.short_conv:
        layer.k_conv = ShortConv(kv_heads * layer.head_dim, layer.k_conv.kernel_size)
        layer.v_conv = ShortConv(kv_heads * layer.head_dim_v, layer.v_conv.kernel_size)


def grouped_qkv(layer: AttentionBase, x: torch.Tensor, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor],
                kv_heads: int, q_norm: Optional[nn.Module] = None, k_norm: Optional[nn.Module] = None,
                v_heads: Optional[int] = None):
    """The projections, short convolutions and RoPE of an `AttentionBase` layer (its `_qkv`), for k with `kv_heads`
    heads (`group_kv_heads`; n_heads: not grouped), v with `v_heads` (default kv_heads) and optional per-head q/k
    norms (before RoPE): q `[B, T, H, K]`, k `[B, T, kv_heads, K]`, v `[B, T, v_heads, V]`."""
    B, T, _ = x.shape
    q, k, v = layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)
    if layer.short_conv:
        conv = cache.conv if cache is not None else {}
        q, sq = layer.q_conv(q, conv.get("q"), cu_seqlens)
        k, sk = layer.k_conv(k, conv.get("k"), cu_seqlens)
        v, sv = layer.v_conv(v, conv.get("v"), cu_seqlens)
        if cache is not None:
            cache.conv.update(q=sq, k=sk, v=sv)
    q = q.view(B, T, layer.n_heads, layer.head_dim)
    k = k.view(B, T, kv_heads, layer.head_dim)
    v = v.view(B, T, kv_heads if v_heads is None else v_heads, layer.head_dim_v)
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    if layer.rope is not None:
        if cu_seqlens is not None:
            q, k = layer.rope(q, k, positions=packed_positions(cu_seqlens, T, x.device))
        else:
            q, k = layer.rope(q, k, cache.offset if cache is not None else 0)
    return q, k, v


def repeat_kv(t: torch.Tensor, groups: int) -> torch.Tensor:
    """`[B, T, kv_heads, D]` -> `[B, T, kv_heads * groups, D]`: k/v head j serves query heads j*groups..+groups-1."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=2)

