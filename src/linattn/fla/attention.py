"""`forgetting_attention` on fla's `parallel_forgetting_attn` (FoX; flash-style softmax attention with a forget gate).

The translation: q, k, v as the caller's (fla applies the scale, always passed explicitly: both libraries default
to K**-0.5); g the per-token log forget gate [B, T, H] as in linattn (fla sums it itself, in fp32, where linattn's
PyTorch forms sum it in fp64); linattn's window (keys with i - j < window) is fla's `window_size` (keys in
[i - window_size + 1, i]); cu_seqlens with B = 1 in both; g = None is plain causal softmax attention.
"""
from __future__ import annotations

from typing import Optional

import torch

from . import kernel


def forgetting_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: Optional[torch.Tensor], *,
                         scale: float, window: Optional[int], cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """Forgetting attention on fla's kernel.

    Args:
        q: Queries `[B, T, H, K]` (fp16, bf16 or fp32).
        k: Keys `[B, T, H, K]`, the dtype of q.
        v: Values `[B, T, H, V]`, the dtype of q.
        g: Log forget gates `[B, T, H]` (fp32), or None.
        scale: The score scale, passed as it is.
        window: Keys with i - j < window only, or None.
        cu_seqlens: int64 `[N + 1]` sequence starts (B = 1), or None.

    Returns:
        o `[B, T, H, V]` in the dtype of q.
    """
    return kernel("fla.ops.forgetting_attn", "parallel_forgetting_attn")(q, k, v, g, scale=scale, window_size=window,
                                                                         cu_seqlens=cu_seqlens)
