"""Packed sequences: several documents laid end to end in one row, `[1, T_total, ...]`, with
`cu_seqlens` (int64 `[N+1]`: 0, end of document 1, ..., T_total) marking where each one starts.

A layer called with `cu_seqlens` treats every document as if it were run alone: the recurrent
state starts from zero at each start, the short convolution sees no token of the previous
document, RoPE positions restart at 0 and softmax attention is block-diagonal causal.
These helpers validate the offsets and turn them into per-token positions.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import LinattnError, LinattnTypeError
from ..ops._common import check_cu_seqlens as check_offsets
from .cache import LayerCache


def check_cu_seqlens(cu_seqlens, batch_size: int, seq_len: int) -> Optional[torch.Tensor]:
    """Validate packed-sequence offsets for an input `[batch_size, seq_len, ...]`.

    Args:
        cu_seqlens: The offsets `[N+1]` (a 1-D integer tensor starting at 0 and ending at seq_len), or None.
        batch_size: The input's batch size (must be 1 with offsets).
        seq_len: The input's length.

    Returns:
        cu_seqlens as an int64 tensor (or None when None was given).

    Raises:
        LinattnError: naming what is wrong: not a 1-D integer tensor, batch size other than 1, offsets that do
            not start at 0 and end at seq_len, or an empty document.
    """
    if check_offsets(cu_seqlens, batch_size, seq_len) is None:   # the operators' check: one host read per tensor
        return None
    return cu_seqlens.long()


def packed_positions(cu_seqlens: torch.Tensor, seq_len: int, device=None) -> torch.Tensor:
    """Position of every token within its own document (0 at each start).

    Args:
        cu_seqlens: Validated offsets `[N+1]`.
        seq_len: The packed length.
        device: The device of the result (None: that of cu_seqlens).

    Returns:
        `[seq_len]` int64 positions.

    Examples:
        >>> import torch
        >>> from linattn.layers import packed_positions
        >>> packed_positions(torch.tensor([0, 3, 5]), 5).tolist()
        [0, 1, 2, 0, 1]
    """
    cu = cu_seqlens.to(device=device if device is not None else cu_seqlens.device, dtype=torch.long)
    t = torch.arange(seq_len, device=cu.device)
    doc = torch.searchsorted(cu[1:], t, right=True)   # index of the document holding token t
    return t - cu[doc]


def reject_cache_with_cu_seqlens(owner: str, cache, cu_seqlens) -> None:
    """Packed documents are for full-sequence (training / evaluation) calls, not for decoding."""
    if cache is not None and cu_seqlens is not None:
        raise LinattnError(f"{owner}: cu_seqlens (packed documents) cannot be combined with a decoding cache; "
                           f"decode a [B, T] batch instead")


def check_mixer_call(owner: str, d_model: int, x, cache, cu_seqlens) -> Optional[torch.Tensor]:
    """The checks every mixer's forward starts with: x `[B, T, d_model]`, a `LayerCache` or None, no cache
    together with packed documents. -> the validated `cu_seqlens` (or None)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != d_model:
        raise LinattnError(f"{owner} expects x of shape [B, T, {d_model}], "
                           f"got {tuple(getattr(x, 'shape', ())) or type(x).__name__}")
    if cache is not None and not isinstance(cache, LayerCache):
        raise LinattnTypeError(f"cache must be a linattn.layers.LayerCache, got {type(cache).__name__}")
    reject_cache_with_cu_seqlens(owner, cache, cu_seqlens)
    return check_cu_seqlens(cu_seqlens, x.shape[0], x.shape[1])


__all__ = ["check_cu_seqlens", "check_mixer_call", "packed_positions", "reject_cache_with_cu_seqlens"]
