"""`SoftmaxAttention`: causal multi-head softmax attention with RoPE, a KV cache and an optional
sliding window; the quadratic baseline."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import LinattnError
from ..ops import softmax_attention
from .base import AttentionBase
from .cache import KVCache, LayerCache


class SoftmaxAttention(AttentionBase):
    """Causal softmax attention layer.

    Args (besides `AttentionBase`'s): window (keys with i - j < window only; None = full),
    scale (None, the default, means head_dim**-0.5), kv_chunk (the KV cache grows by this many
    tokens at a time). rope defaults to True, output_norm to False. With `cu_seqlens` the
    attention is block-diagonal causal: no token attends to another document.
    """

    config_fields = AttentionBase.config_fields + ("window",)

    def __init__(self, d_model: int, n_heads: int, *, window: Optional[int] = None, scale: Optional[float] = None,
                 rope: bool = True, output_norm: bool = False, kv_chunk: int = 256, **kwargs):
        if window is not None and (not isinstance(window, int) or window < 1):
            raise LinattnError(f"window must be a positive int or None, got {window!r}")
        super().__init__(d_model, n_heads, rope=rope, output_norm=output_norm, **kwargs)
        self.window, self.kv_chunk = window, int(kv_chunk)
        self.scale = self.resolve_scale(scale, self.head_dim)

    def _mix(self, q, k, v, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        if cache is None:
            return softmax_attention(q, k, v, causal=True, scale=self.scale, window=self.window,
                                     cu_seqlens=cu_seqlens)
        kv = cache.get("kv")
        if kv is None:
            kv = cache["kv"] = KVCache(chunk=self.kv_chunk, window=self.window)
        T = q.shape[1]
        k_all, v_all, start = kv.append(k, v)
        offset = cache.offset
        if isinstance(offset, torch.Tensor):  # per-row offsets: left-padded rows, see _row_mask
            mask = self._row_mask(offset.to(q.device), T, k_all.shape[1])
        elif T == 1 and self.window is None:
            mask = None  # one new query sees every stored key
        else:
            qpos = offset + torch.arange(T, device=q.device)
            kpos = start + torch.arange(k_all.shape[1], device=q.device)
            diff = qpos[:, None] - kpos[None, :]
            mask = diff >= 0
            if self.window is not None:
                mask = mask & (diff < self.window)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2),
                                           attn_mask=mask, scale=self.scale)
        return o.transpose(1, 2)

    def _row_mask(self, offset: torch.Tensor, T: int, L: int) -> torch.Tensor:
        """The `[B, 1, T, L]` mask of a batch whose rows have consumed `offset[b]` tokens before
        these T: row b's tokens fill the last offset[b] + T of the L stored slots, so slot j holds
        its position offset[b] + T - L + j, and a negative position is left padding (masked)."""
        qpos = offset[:, None] + torch.arange(T, device=offset.device)                   # [B, T]
        kpos = (offset[:, None] + T - L) + torch.arange(L, device=offset.device)        # [B, L]
        diff = qpos[:, :, None] - kpos[:, None, :]
        mask = (diff >= 0) & (kpos[:, None, :] >= 0)
        if self.window is not None:
            mask = mask & (diff < self.window)
        return mask[:, None]

    def extra_repr(self) -> str:
        return super().extra_repr() + f", window={self.window}"
