"""`MesaNet` layer (von Oswald et al. 2025), FLA's layer pattern around `linattn.mesa_net`.

q/k/v projections, a short causal convolution (kernel 4, SiLU), L2-normalised q and k, per head a
write strength beta = sigmoid(b_proj(x)) and a log-gate g = logsigmoid(a_proj(x)), a learnable ridge
lam = softplus(lambda_params) + lambda_lower_bound per key channel (`[H, K]`, initialised to 1),
the operator, a per-head output norm (gated by g_proj if output_gate) and o_proj.

Training and prefill run the chunk form, decoding the recurrent form; both solve with the same
conjugate gradients (`solver="cg"`, `max_iter`, `tol`), so prefill + decoding match the full forward
to CG's tolerance. The cache holds the `MesaState` (H `[B, H, K, K]`, G `[B, H, K, V]`, fp32): constant
memory.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import LinattnError
from ..ops import mesa_net
from .base import AttentionBase
from .cache import LayerCache
from .common import l2_normalize
from .registry import register_mixer


def _cdt(x: torch.Tensor) -> torch.dtype:
    """The gates' dtype: fp64 stays fp64, everything else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class MesaNet(AttentionBase):
    """MesaNet layer: the `mesanet` mixer, on the `mesa_net` operator.

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        chunk_size: for the operator.
        scale: for q (None: head_dim**-0.5; with the output norm it only sets the output's scale before the norm).
        solver: "cg" | "exact".
        max_iter: CG's iteration cap.
        tol: CG's tolerance (None: the operator's default).
        lambda_lower_bound: (> 0) the smallest ridge.
        short_conv: The short convolution on q, k, v (default True).
        output_norm: The per-head output norm (default True).
        v_conv: False leaves v out of the short convolution (q and k only: fla's MesaNet layer).
        **kwargs: `AttentionBase`'s options.

    Raises:
        LinattnError: A bad solver or other option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import MesaNet
        >>> MesaNet(64, 4)(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    config_fields = AttentionBase.config_fields + ("chunk_size",)

    def __init__(self, d_model: int, n_heads: int, *, chunk_size: int = 64, scale: Optional[float] = None,
                 solver: str = "cg", max_iter: int = 30, tol: Optional[float] = None,
                 lambda_lower_bound: float = 0.25, short_conv: bool = True, output_norm: bool = True,
                 v_conv: bool = True, **kwargs):
        super().__init__(d_model, n_heads, short_conv=short_conv, output_norm=output_norm, **kwargs)
        self.v_conv_on = bool(v_conv)
        if self.short_conv and not self.v_conv_on:
            del self.v_conv
        if not lambda_lower_bound > 0 or lambda_lower_bound >= 1.0:
            raise LinattnError(f"lambda_lower_bound must be in (0, 1) (lam starts at 1), got {lambda_lower_bound!r}")
        self.chunk_size = int(chunk_size)
        self.scale = self.resolve_scale(scale, self.head_dim)
        self.solver, self.max_iter, self.tol = solver, int(max_iter), tol
        self.lambda_lower_bound = float(lambda_lower_bound)
        self.a_proj = nn.Linear(d_model, self.n_heads, bias=True)
        self.b_proj = nn.Linear(d_model, self.n_heads, bias=True)
        # softplus(p) + lower bound = 1 at initialisation
        init = math.log(math.expm1(1.0 - self.lambda_lower_bound))
        self.lambda_params = nn.Parameter(torch.full((self.n_heads, self.head_dim), init))

    def ridge(self) -> torch.Tensor:
        """lam `[H, K]` (> lambda_lower_bound), in fp32 (fp64 for fp64 parameters)."""
        p = self.lambda_params
        return F.softplus(p.to(_cdt(p))) + self.lambda_lower_bound

    def _qkv(self, x: torch.Tensor, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        if not self.short_conv or self.v_conv_on:
            return super()._qkv(x, cache, cu_seqlens)
        B, T, _ = x.shape                       # v_conv=False: the short convolution on q and k only
        conv = cache.conv if cache is not None else {}
        q, sq = self.q_conv(self.q_proj(x), conv.get("q"), cu_seqlens)
        k, sk = self.k_conv(self.k_proj(x), conv.get("k"), cu_seqlens)
        if cache is not None:
            cache.conv.update(q=sq, k=sk)
        return (q.view(B, T, self.n_heads, self.head_dim), k.view(B, T, self.n_heads, self.head_dim),
                self.v_proj(x).view(B, T, self.n_value_heads, self.head_dim_v))

    def _mix(self, q, k, v, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        q, k = l2_normalize(q), l2_normalize(k)
        beta = torch.sigmoid(self.b_proj(x).to(_cdt(x))).to(q.dtype)
        g = F.logsigmoid(self.a_proj(x).to(_cdt(x)))
        o, state = mesa_net(
            q, k, v, beta, g, self.ridge().to(q.dtype), solver=self.solver, max_iter=self.max_iter, tol=self.tol,
            scale=self.scale, mode=self._mode(cache, x.shape[1]), chunk_size=self.chunk_size,
            initial_state=cache.state if cache is not None else None,
            output_final_state=cache is not None, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.state = state
        return o

    def extra_repr(self) -> str:
        return super().extra_repr() + f", solver={self.solver!r}, max_iter={self.max_iter}"


register_mixer("mesanet", MesaNet, {}, "MesaNet: ridge regression H^-1 G per token, chunkwise conjugate "
               "gradients", short_conv=True)
