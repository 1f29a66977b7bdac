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
from ._common import reads_values

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


def select_rows(plain: torch.Tensor, bad: torch.Tensor, exact) -> torch.Tensor:
    """`plain` with the rows where `bad` [..] is True replaced by `exact(rows)`: on CPU tensors in eager mode
    only those rows are recomputed (usually none), elsewhere every row is and torch.where picks (no host read).
    Either way each row is computed from itself alone, by the same formula: the same bits on every path, and no
    later token can change an earlier row."""
    if reads_values(plain):
        if not bool(bad.any()):
            return plain
        rows = bad.nonzero(as_tuple=True)
        return plain.index_put(rows, exact(rows))
    return torch.where(bad.unsqueeze(-1) if plain.dim() > bad.dim() else bad, exact(None), plain)


def l2norm(x: torch.Tensor, convention: str = "rsqrt", eps: float = L2NORM_EPS) -> torch.Tensor:
    """x normalised over its last dimension by `convention` ("rsqrt" or "clamp", module docstring),
    computed in x's dtype, for any finite x.

    Overflow: sum x^2 overflows fp32 from |x| ~ 1e19 (and the result would be 0). A row whose sum of squares
    is not finite is computed on y = x / s with s = max(max |x|, 1), detached: x * rsqrt(sum x^2 + eps) =
    y * rsqrt(sum y^2 + eps / s^2) and x / max(||x||, eps) = y / max(||y||, eps / s) exactly (the gradient
    through s is zero), and sum y^2 <= K never overflows. Every other row is the plain formula, bit for bit.
    So a key scaled by any c >= 1 normalises to the same vector (to rounding) up to the dtype's largest value."""
    if convention not in L2NORM_CONVENTIONS:
        raise LinattnError(f"the L2 normalisation convention must be one of {L2NORM_CONVENTIONS}, "
                           f"got {convention!r}")
    if convention == "rsqrt":
        ss = (x * x).sum(-1, keepdim=True)
        plain = x * torch.rsqrt(ss + eps)
    else:
        ss = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        plain = x / ss.clamp_min(eps)
    if not x.shape[-1]:
        return plain

    def scaled(rows):
        xr = x if rows is None else x[rows]
        s = xr.detach().abs().amax(-1, keepdim=True).clamp_min(1.0)
        y = xr / s
        if convention == "rsqrt":
            return y * torch.rsqrt((y * y).sum(-1, keepdim=True) + eps / (s * s))
        return y / torch.linalg.vector_norm(y, dim=-1, keepdim=True).clamp_min(eps / s)

    return select_rows(plain, ~torch.isfinite(ss.detach()).squeeze(-1), scaled)
