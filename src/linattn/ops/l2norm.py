"""The q/k L2 normalisation of the delta family, one implementation for the operators and the layers.

Two conventions, over the last dimension, eps = 1e-6:

* "rsqrt" (the default, `qk_l2norm=True`): x * rsqrt(sum x^2 + eps), flash-linear-attention's and
  transformers' form (`l2norm`, `use_qk_l2norm_in_kernel`);
* "clamp": x / max(||x||, eps), `torch.nn.functional.normalize`'s form, which the operators used before
  the convention could be chosen (checkpoints of that time load with it: `LMConfig.l2norm_convention`).

They differ only for small vectors (by 4e-3 relative at ||x|| = 4e-3, 0.14 at 4e-4).
"""
from __future__ import annotations

from typing import Optional

import torch

from ..errors import LinattnError, LinattnTypeError

L2NORM_EPS = 1e-6
L2NORM_CONVENTIONS = ("rsqrt", "clamp")


def resolve_l2norm(value, name: str = "qk_l2norm") -> Optional[str]:
    """An operator's `qk_l2norm` argument -> None (no normalisation), "rsqrt" or "clamp".
    False / None: none; True or "rsqrt": fla's x * rsqrt(sum x^2 + 1e-6); "clamp": x / max(||x||, 1e-6)."""
    if value is None or value is False:
        return None
    if value is True:
        return "rsqrt"
    if isinstance(value, str) and value in L2NORM_CONVENTIONS:
        return value
    msg = f"{name} must be a bool (True = 'rsqrt') or one of {L2NORM_CONVENTIONS}, got {value!r}"
    raise LinattnError(msg) if isinstance(value, str) else LinattnTypeError(msg)


def l2norm(x: torch.Tensor, convention: str = "rsqrt", eps: float = L2NORM_EPS) -> torch.Tensor:
    """x normalised over its last dimension by `convention` ("rsqrt" or "clamp", module docstring),
    computed in x's dtype, for any finite x.

    Overflow: sum x^2 overflows fp32 from |x| ~ 1e19 (and the result would be 0). Both forms are computed on
    y = x / s with s = max(max |x|, 1), detached: x * rsqrt(sum x^2 + eps) = y * rsqrt(sum y^2 + eps / s^2) and
    x / max(||x||, eps) = y / max(||y||, eps / s) exactly, so the gradient through s is zero. sum y^2 <= K never
    overflows, and eps / s^2 <= eps; for max |x| <= 1 (s = 1) the values are bit for bit the unscaled ones.
    So a key scaled by any c >= 1 normalises to the same vector (to rounding) up to the dtype's largest value."""
    if convention not in L2NORM_CONVENTIONS:
        raise LinattnError(f"the L2 normalisation convention must be one of {L2NORM_CONVENTIONS}, "
                           f"got {convention!r}")
    s = x.detach().abs().amax(-1, keepdim=True).clamp_min(1.0) if x.shape[-1] else None
    y = x / s if s is not None else x
    if convention == "rsqrt":
        return y * torch.rsqrt((y * y).sum(-1, keepdim=True) + (eps / (s * s) if s is not None else eps))
    return y / torch.linalg.vector_norm(y, dim=-1, keepdim=True).clamp_min(eps / s if s is not None else eps)
