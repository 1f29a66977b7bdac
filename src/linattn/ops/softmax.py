"""Softmax attention, the O(T^2) baseline every comparison in linattn uses.

Built on torch.nn.functional.scaled_dot_product_attention, in the library's [B, T, H, D] layout.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import LinattnError
from ._common import check_cu_seqlens, check_finite_output, check_qkv, check_scale, run_varlen
from .registry import randn, register_op


def _sdpa(q, k, v, causal: bool, scale: float, window: Optional[int]) -> torch.Tensor:
    # q, k, v: [B, T, H, D] -> SDPA works on [B, H, T, D]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if window is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    else:
        T = q.shape[2]
        i = torch.arange(T, device=q.device)[:, None]
        j = torch.arange(T, device=q.device)[None, :]
        mask = (i - j).abs() < window if not causal else (j <= i) & (i - j < window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      scale: Optional[float] = None, window: Optional[int] = None,
                      cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Softmax attention, the O(T^2) baseline, in the library's layout.

    o_i = sum_j softmax_j(scale q_i . k_j) v_j over the keys j <= i (causal) or all j, built on
    torch.nn.functional.scaled_dot_product_attention. `window=w` keeps only keys with |i - j| < w (and j <= i
    when causal): a sliding window.

    Args:
        q: Queries `[B, T, H, K]`, any float dtype.
        k: Keys `[B, T, H, K]`.
        v: Values `[B, T, H, V]`.
        causal: Attend to earlier keys only (j <= i).
        scale: The score scale; None means K**-0.5.
        window: A sliding window length w >= 1 (keys with |i - j| < w), or None (all keys).
        cu_seqlens: int64 `[N+1]` offsets of N packed sequences (B must be 1); a sequence attends to its own
            keys only.

    Returns:
        The output o `[B, T, H, V]`, in the input dtype.

    Raises:
        LinattnError: An argument of the wrong shape or value, or a non-finite output.

    Examples:
        >>> import torch
        >>> from linattn import softmax_attention
        >>> q, k, v = torch.randn(3, 2, 10, 4, 16).unbind(0)
        >>> softmax_attention(q, k, v).shape
        torch.Size([2, 10, 4, 16])
        >>> o = softmax_attention(q, k, v, window=4)                      # sliding window
        >>> packed = softmax_attention(q[:1], k[:1], v[:1], cu_seqlens=torch.tensor([0, 3, 10]))
        >>> torch.allclose(packed[:, :3], softmax_attention(q[:1, :3], k[:1, :3], v[:1, :3]), atol=1e-6)
        True
    """
    B, T, H, K, V = check_qkv(q, k, v, allow_empty_k=True)   # K = 0: uniform weights, the math
    if window is not None and (not isinstance(window, int) or window < 1):
        raise LinattnError(f"window must be a positive int or None, got {window!r}")
    scale = check_scale(scale, K ** -0.5) if K > 0 else check_scale(scale, 1.0)
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    if offsets is None:
        o = _sdpa(q, k, v, causal, scale, window)
    else:
        o, _ = run_varlen(offsets, lambda i, s: (_sdpa(q[:, s], k[:, s], v[:, s], causal, scale, window), None),
                          lambda states: None)
    return check_finite_output(o, "softmax_attention", q=q, k=k, v=v)


def _example(gen, B, T, H, K, V, dtype):
    return (randn(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, K), dtype), randn(gen, (B, T, H, V), dtype)), {}


def _reference(q, k, v, *, scale=None, window=None):
    from .reference import forgetting_attention_ref  # softmax attention is FoX without a forget gate
    return forgetting_attention_ref(q, k, v, None, window=window, scale=scale)


register_op("softmax_attention", softmax_attention, chunk_arg=None, example=_example, reference=_reference,
            description="causal softmax attention (SDPA), the O(T^2) baseline")
