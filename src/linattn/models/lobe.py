"""The ELA Memory Lobe: attention over a layer's "flow" (its FFN output).

    m = LinearAttention_hadamard_exp(Q f, K f, V f)     (no output projection, one head, no scaling)

mode="causal": position t attends to flows 1..t (a recurrent state for decoding).
mode="bidirectional": the paper's form, a global sum over the whole sequence. In a causal
language model this makes position t depend on tokens after t (the targets leak); it cannot
decode incrementally either.

With `cu_seqlens` (packed documents) the lobe attends within each document only (causal: the
state restarts at each document; bidirectional: one global sum per document).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from ..errors import LinattnError
from ..feature_maps import FeatureMap, get_feature_map
from ..layers.cache import LayerCache
from ..layers.packing import check_cu_seqlens, reject_cache_with_cu_seqlens
from ..ops import linear_attention

LOBE_MODES = ("causal", "bidirectional")


class MemoryLobe(nn.Module):
    """f `[B, T, d]` -> m `[B, T, d]`. Three bias-free d x d projections Q, K, V and a normalised
    linear attention with `feature_map` (default hadamard_exp) over `n_heads` heads."""

    def __init__(self, d_model: int, mode: str = "causal", n_heads: int = 1,
                 feature_map: Union[str, FeatureMap] = "hadamard_exp", scale: float = 1.0,
                 chunk_size: int = 64, eps: float = 1e-6):
        super().__init__()
        if mode not in LOBE_MODES:
            raise LinattnError(f"mode must be one of {LOBE_MODES}, got {mode!r}")
        if d_model % n_heads:
            raise LinattnError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.d_model, self.mode, self.n_heads = int(d_model), mode, int(n_heads)
        self.head_dim = d_model // n_heads
        self.feature_map = get_feature_map(feature_map, self.head_dim)
        self.scale, self.chunk_size, self.eps = float(scale), int(chunk_size), float(eps)
        self.Q = nn.Linear(d_model, d_model, bias=False)
        self.K = nn.Linear(d_model, d_model, bias=False)
        self.V = nn.Linear(d_model, d_model, bias=False)

    @property
    def causal(self) -> bool:
        return self.mode == "causal"

    def forward(self, f: torch.Tensor, cache: Optional[LayerCache] = None, *,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, T, _ = f.shape
        H, D = self.n_heads, self.head_dim
        reject_cache_with_cu_seqlens("MemoryLobe", cache, cu_seqlens)
        cu_seqlens = check_cu_seqlens(cu_seqlens, B, T)
        q, k, v = (p(f).view(B, T, H, D) for p in (self.Q, self.K, self.V))
        if not self.causal:
            if cache is not None:
                raise LinattnError("a bidirectional memory lobe has no incremental form: every position depends "
                                 "on the whole sequence, so it cannot decode with a cache")
            o, _ = linear_attention(q, k, v, feature_map=self.feature_map, causal=False, scale=self.scale,
                                    mode="chunk", cu_seqlens=cu_seqlens, eps=self.eps)
            return o.reshape(B, T, self.d_model)
        mode = "recurrent" if cache is not None and T == 1 else "chunk"
        o, state = linear_attention(q, k, v, feature_map=self.feature_map, causal=True, scale=self.scale,
                                    mode=mode, chunk_size=self.chunk_size,
                                    initial_state=cache.state if cache is not None else None,
                                    output_final_state=cache is not None, cu_seqlens=cu_seqlens, eps=self.eps)
        if cache is not None:
            cache.state = state
            cache.offset = cache.offset + T
        return o.reshape(B, T, self.d_model)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, mode={self.mode!r}, n_heads={self.n_heads}"
