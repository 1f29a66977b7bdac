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
from .common import RMSNorm
from .grouped_kv import group_kv_heads, grouped_qkv, repeat_kv
from .registry import register_mixer


class SoftmaxAttention(AttentionBase):
    """Causal softmax attention layer, with RoPE, a KV cache, an optional sliding window and GQA.

    With `cu_seqlens` the attention is block-diagonal causal: no token attends to another document.

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The model's number of heads.
        window: Keys with i - j < window only; None = full.
        scale: None (the default) means head_dim**-0.5.
        rope: Rotary positions on q and k (default True).
        output_norm: Per-head RMSNorm on the output (default False).
        kv_chunk: The KV cache grows by this many tokens at a time.
        heads: This layer's query heads when they differ from the model's n_heads (a hybrid's softmax
            layers with their own head count, e.g. fla's `attn` layouts); None: n_heads.
        n_kv_heads: Grouped key/value heads (GQA: query head h reads k/v head h // (heads / n_kv_heads));
            None: one per query head.
        qk_norm: A per-head RMSNorm (eps qk_norm_eps, a weight [head_dim]) on q and k before RoPE (fla's
            `qk_norm`, Qwen3's).
        qk_norm_eps: That norm's epsilon.
        **kwargs: `AttentionBase`'s options (head_dim, output_gate, ...).

    Raises:
        LinattnError: A bad window, heads or other option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import LayerCache, SoftmaxAttention
        >>> layer = SoftmaxAttention(64, 4, n_kv_heads=2).double()
        >>> x = torch.randn(2, 10, 64, dtype=torch.float64)
        >>> y = layer(x)
        >>> y.shape
        torch.Size([2, 10, 64])
        >>> cache = LayerCache()                     # prefill 9 tokens, then decode the 10th
        >>> _ = layer(x[:, :9], cache)
        >>> torch.allclose(layer(x[:, 9:], cache), y[:, 9:])
        True
    """

    config_fields = AttentionBase.config_fields + ("window",)

    def __init__(self, d_model: int, n_heads: int, *, window: Optional[int] = None, scale: Optional[float] = None,
                 rope: bool = True, output_norm: bool = False, kv_chunk: int = 256, heads: Optional[int] = None,
                 n_kv_heads: Optional[int] = None, qk_norm: bool = False, qk_norm_eps: float = 1e-5, **kwargs):
        if window is not None and (not isinstance(window, int) or window < 1):
            raise LinattnError(f"window must be a positive int or None, got {window!r}")
        if heads is not None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
            raise LinattnError(f"heads must be a positive int or None (the model's n_heads), got {heads!r}")
        super().__init__(d_model, n_heads if heads is None else heads, rope=rope, output_norm=output_norm, **kwargs)
        self.window, self.kv_chunk = window, int(kv_chunk)
        self.scale = self.resolve_scale(scale, self.head_dim)
        H = self.n_heads
        kvh = H if n_kv_heads is None else n_kv_heads
        if isinstance(kvh, bool) or not isinstance(kvh, int) or kvh < 1 or H % kvh:
            raise LinattnError(f"n_kv_heads must be a positive int that divides the query heads ({H}), got "
                               f"{n_kv_heads!r}")
        if kvh != H and self.n_value_heads != H:
            raise LinattnError(f"n_kv_heads ({kvh}) cannot be combined with n_value_heads ({self.n_value_heads})")
        self.n_kv_heads = int(kvh)
        group_kv_heads(self, kvh)
        self.q_norm = RMSNorm(self.head_dim, eps=qk_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps=qk_norm_eps) if qk_norm else None

    def _qkv(self, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        if self.n_kv_heads == self.n_heads and self.q_norm is None:
            return super()._qkv(x, cache, cu_seqlens)
        return grouped_qkv(self, x, cache, cu_seqlens, self.n_kv_heads, self.q_norm, self.k_norm)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """k or v `[B, T, n_kv_heads, D]` repeated to the query heads (each k/v head serves a group)."""
        return repeat_kv(t, self.n_heads // self.n_kv_heads)

    def _mix(self, q, k, v, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        if cache is None:
            return softmax_attention(q, self._heads(k), self._heads(v), causal=True, scale=self.scale,
                                     window=self.window, cu_seqlens=cu_seqlens)
        kv = cache.kv
        if kv is None:
            kv = cache.kv = KVCache(chunk=self.kv_chunk, window=self.window)
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
        k_all, v_all = self._heads(k_all), self._heads(v_all)
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
        return (super().extra_repr() + f", window={self.window}"
                + (f", n_kv_heads={self.n_kv_heads}" if self.n_kv_heads != self.n_heads else "")
                + (", qk_norm=True" if self.q_norm is not None else ""))


# the mixers of this module (their registration order is the order of linattn.mixers(): see layers/__init__.py)
register_mixer("softmax", SoftmaxAttention, {}, "causal softmax attention with RoPE and a KV cache", rope=True)
register_mixer("swa", SoftmaxAttention, {"window": 256},
               "sliding-window softmax attention (LMConfig.window sets the window)", rope=True)
