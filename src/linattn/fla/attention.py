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


def path_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, beta: torch.Tensor,
                   g: Optional[torch.Tensor], *, scale: float, cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """PaTH attention on fla's `parallel_path_attn`: softmax_j(scale q_i^T R_ij k_j + G_i - G_j) v_j.

    fla's kernel scales the gate with the scores, softmax((q_i^T R_ij k_j + G_i - G_j) scale), where linattn
    adds the gate after the scale: the gate goes to fla divided by the scale.

    Args:
        q: Queries `[B, T, H, K]` (fp16, bf16 or fp32), K in 16, 32, 64, 128.
        k: Keys `[B, T, H, K]`, the dtype of q.
        v: Values `[B, T, H, V]`, the dtype of q, V in 16, 32, 64, 128.
        w: The Householder directions `[B, T, H, K]` (fp32, as fla requires).
        beta: Their strengths `[B, T, H]` (fp32).
        g: Log forget gates `[B, T, H]` (fp32), or None.
        scale: The score scale (> 0).
        cu_seqlens: int64 `[N + 1]` sequence starts (B = 1), or None.

    Returns:
        o `[B, T, H, V]` in the dtype of q.
    """
    g_fla = g / scale if g is not None else None
    o, _ = kernel("fla.ops.path_attn", "parallel_path_attn")(q, k, v, w, beta, g_fla, scale=scale,
                                                              cu_seqlens=cu_seqlens)
    return o
