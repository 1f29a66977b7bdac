"""Grouped value heads (GVA, as in Qwen3-Next and Mamba2's groups): v has HV = n H heads while q and k have H,
and value head j reads q/k head j // n (transformers' `repeat_interleave` convention)."""
from __future__ import annotations

import torch

from ..errors import LinattnError


def value_groups(q, v) -> int:
    """n for grouped value heads (v `[B, T, HV, V]` with HV = n H, q `[B, T, H, K]`), 1 otherwise; raises when
    HV is not a multiple of H. Anything that is not a pair of 4-d tensors gives 1 (the shape checks then
    report it)."""
    if not (isinstance(q, torch.Tensor) and isinstance(v, torch.Tensor) and q.dim() == 4 and v.dim() == 4):
        return 1
    H, HV = q.shape[2], v.shape[2]
    if HV == H:
        return 1
    if H == 0 or HV == 0 or HV % H:
        raise LinattnError(f"v must have shape [B, T, HV, V] with HV = H or HV = n * H value heads (grouped: value "
                           f"head j reads q/k head j // n), H = {H} the heads of q and k; got q {tuple(q.shape)} "
                           f"and v {tuple(v.shape)}")
    return HV // H
