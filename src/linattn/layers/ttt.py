"""Test-time-training layers: `TTT` (TTT-Linear, TTT-MLP; Sun et al. 2024) and `Titans` (Behrouz et al.
2025), around `linattn.ttt` / `linattn.titans`.

q/k/v projections, a short causal convolution (kernel 4, SiLU), the operator, a per-head output norm
(gated by g_proj if output_gate) and o_proj. The inner model's initial weights are parameters of the
layer (per head: W0 `[K, V]`, b0 `[V]`, or W1 `[K, hidden]`, b1, W2 `[hidden, V]`, b2), as are the
inner LayerNorm's weight and bias `[H, V]`; they reach the operator as its initial state and
ln_weight / ln_bias, so the outer optimiser trains them through the inner updates. Per token:

* TTT:    eta = base_lr * sigmoid(lr_proj(x)) / head_dim   (the TTT paper's learnable inner rate)
* Titans: theta = base_lr * sigmoid(lr_proj(x)) / head_dim, alpha = sigmoid(alpha_proj(x)) (weight
          decay, bias initialised to -4: ~0.018), eta = sigmoid(momentum_proj(x)) (momentum, bias 0: 0.5);
          q and k are L2-normalised (as in the Titans paper).

Decoding. The cache holds the operator's `TTTState`: the weights at the current mini-batch's start,
the running weights, Titans' momentum, and the position inside the mini-batch. A single decoded token
takes its gradient at the mini-batch's start weights and updates the running weights (the TTT
paper's token-level update inside a mini-batch), so prefill + token-by-token decoding computes
exactly what the full forward computes, in constant memory, with no token buffer.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..errors import LinattnError
from ..ops import titans, ttt
from .base import AttentionBase
from .cache import LayerCache
from .common import l2_normalize
from .registry import register_mixer

INNER = ("linear", "mlp")


class TTT(AttentionBase):
    """TTT-Linear (inner="linear") or TTT-MLP (inner="mlp") layer, on the `ttt` operator.

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        inner: "linear" or "mlp".
        mini_batch: tokens per inner gradient step, 16 in the paper.
        base_lr: None: 1.0 for linear, 0.1 for mlp, the paper's values.
        hidden_mult: the MLP's hidden width / head_dim.
        residual: f(x) = x + LN(m(x)), needs head_dim_v == head_dim.
        scale: for q (None: head_dim**-0.5).
        init_std: of the inner weights.
        short_conv: The short convolution on q, k, v (default True).
        output_norm: The per-head output norm (default True).
        **kwargs: `AttentionBase`'s options.

    Raises:
        LinattnError: A bad option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import TTT
        >>> TTT(64, 4, mini_batch=4)(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    l2_qk = False
    config_fields = AttentionBase.config_fields

    def __init__(self, d_model: int, n_heads: int, *, inner: str = "linear", mini_batch: int = 16,
                 base_lr: Optional[float] = None, hidden_mult: int = 4, residual: bool = True,
                 scale: Optional[float] = None, init_std: float = 0.02, short_conv: bool = True,
                 output_norm: bool = True, **kwargs):
        super().__init__(d_model, n_heads, short_conv=short_conv, output_norm=output_norm, **kwargs)
        if inner not in INNER:
            raise LinattnError(f"inner must be one of {INNER}, got {inner!r}")
        if not isinstance(mini_batch, int) or mini_batch < 1:
            raise LinattnError(f"mini_batch must be a positive int, got {mini_batch!r}")
        if residual and self.head_dim_v != self.head_dim:
            raise LinattnError(f"residual=True needs head_dim_v == head_dim, got {self.head_dim_v} and {self.head_dim}")
        self.inner, self.mini_batch, self.residual = inner, int(mini_batch), bool(residual)
        self.base_lr = float(base_lr if base_lr is not None else (1.0 if inner == "linear" else 0.1))
        self.scale = self.resolve_scale(scale, self.head_dim)
        H, K, V = self.n_heads, self.head_dim, self.head_dim_v
        if inner == "linear":
            self.W0 = nn.Parameter(torch.randn(H, K, V) * init_std)
            self.b0 = nn.Parameter(torch.zeros(H, V))
        else:
            hidden = int(hidden_mult) * K
            self.W1 = nn.Parameter(torch.randn(H, K, hidden) * init_std)
            self.b1 = nn.Parameter(torch.zeros(H, hidden))
            self.W2 = nn.Parameter(torch.randn(H, hidden, V) * init_std)
            self.b2 = nn.Parameter(torch.zeros(H, V))
        self.ln_weight = nn.Parameter(torch.ones(H, V))
        self.ln_bias = nn.Parameter(torch.zeros(H, V))
        self.lr_proj = nn.Linear(d_model, H, bias=True)

    def initial_weights(self) -> Tuple[torch.Tensor, ...]:
        """The inner model's learnable initial weights, `[H, ...]` each."""
        if self.inner == "linear":
            return (self.W0, self.b0)
        return (self.W1, self.b1, self.W2, self.b2)

    def learning_rate(self, x: torch.Tensor) -> torch.Tensor:
        """The inner learning rate per token.

        Args:
            x: The layer input `[B, T, d_model]`.

        Returns:
            base_lr * sigmoid(lr_proj(x)) / head_dim, `[B, T, H]` (fp32).
        """
        return self.base_lr * torch.sigmoid(self.lr_proj(x).float()) / self.head_dim

    def _op(self, q, k, v, x, **kw):
        return ttt(q, k, v, self.learning_rate(x).to(q.dtype), **kw)

    def _mix(self, q, k, v, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        if self.l2_qk:
            q, k = l2_normalize(q), l2_normalize(k)
        state = cache.state if cache is not None else None
        o, state = self._op(
            q, k, v, x, inner=self.inner, mini_batch=self.mini_batch, ln_weight=self.ln_weight,
            ln_bias=self.ln_bias, residual=self.residual, scale=self.scale, mode=self._mode(cache, x.shape[1]),
            initial_state=state if state is not None else self.initial_weights(),
            output_final_state=cache is not None, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.state = state
        return o

    def extra_repr(self) -> str:
        return super().extra_repr() + f", inner={self.inner!r}, mini_batch={self.mini_batch}"


class Titans(TTT):
    """Titans' neural memory as a layer: TTT with momentum and weight decay (module docstring).

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        inner: defaults to "mlp" (the paper's deep memory).
        **kwargs: `TTT`'s options (mini_batch, base_lr, hidden_mult, ...) and `AttentionBase`'s.

    Examples:
        >>> import torch
        >>> from linattn.layers import Titans
        >>> Titans(64, 4, mini_batch=4)(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    l2_qk = True

    def __init__(self, d_model: int, n_heads: int, *, inner: str = "mlp", **kwargs):
        super().__init__(d_model, n_heads, inner=inner, **kwargs)
        self.alpha_proj = nn.Linear(d_model, self.n_heads, bias=True)
        self.momentum_proj = nn.Linear(d_model, self.n_heads, bias=True)
        with torch.no_grad():
            self.alpha_proj.bias.fill_(-4.0)
            self.momentum_proj.bias.zero_()

    def _op(self, q, k, v, x, **kw):
        dt = q.dtype
        alpha = torch.sigmoid(self.alpha_proj(x).float()).to(dt)
        eta = torch.sigmoid(self.momentum_proj(x).float()).to(dt)
        return titans(q, k, v, self.learning_rate(x).to(dt), alpha, eta, **kw)


# the mixers of this module (their registration order is the order of linattn.mixers(): see layers/__init__.py)
register_mixer("ttt-linear", TTT, {"inner": "linear"}, "TTT-Linear: a linear inner model + LayerNorm trained "
               "by mini-batch gradient descent", short_conv=True)
register_mixer("ttt-mlp", TTT, {"inner": "mlp"}, "TTT-MLP: a 2-layer MLP inner model + LayerNorm trained by "
               "mini-batch gradient descent", short_conv=True)
register_mixer("titans", Titans, {}, "Titans: TTT-MLP memory with momentum and weight decay, L2-normalised q/k",
               short_conv=True)
