"""More delta-rule layers: `Comba`, `DeltaProduct` and `KDA` (Kimi Delta Attention).

They follow the pattern of `layers/delta.py` (FLA's layer pattern): q/k/v projections, a short causal
convolution (kernel 4, SiLU) on each, a write strength beta from `b_proj`, the operator, a per-head output
norm (gated by `g_proj` when output_gate) and `o_proj`. q and k are L2-normalised.

* Comba (`linattn.comba`): S_t = exp(g_t) S_{t-1} + b_t k_t (v_t - S_{t-1}^T p_t)^T, o_t = scale S_t^T q~_t,
  with Gated DeltaNet's decay g = -exp(A_log) softplus(a_proj(x) + dt_bias) and b = sigmoid(b_proj(x)).
  The read key is derived from the key, as in the Comba paper's code (flash-linear-attention's layer,
  "inner decay"): p_t = sigmoid(c_h) k_t, a learnable per-head feedback gain in (0, 1) (c_h = 1 at
  init). Output correction: q~_t = q_t - d_h p_t, a learnable per-head d (init `correction_factor`, 1.0
  by default; FLA notes that 0.02 sometimes works better for small models). With seed eq. (18) in mind:
  the decay acts on the state only, the prediction reads the undecayed state.
* DeltaProduct (`linattn.delta_product`): n Householder steps per token (n_householder, default 2): k_proj,
  v_proj and b_proj produce n keys, values and step sizes per head (the short convolutions run over all
  of them), b = sigmoid(b_proj(x)), or b = 2 sigmoid(b_proj(x)) with allow_negative_eigenvalues=True
  (each factor's eigenvalue 1 - b in (-1, 1): state tracking). gate=True adds Gated DeltaNet's decay,
  applied once per token (Gated DeltaProduct).
* KDA (`linattn.delta_rule` with a per-channel log-gate g `[B, T, H, K]`): Gated DeltaNet's gate made per
  key channel, g = -exp(A_log_h) softplus(f_proj(x) + dt_bias), with f_proj a low-rank projection
  d_model -> gate_rank -> H*K (gate_rank defaults to head_dim, as in the Kimi Linear layer), a per-head
  A_log and a per-channel dt_bias (Mamba2's initialisation); output gate on by default: the gated RMSNorm
  with silu, as Gated DeltaNet; gate_act="sigmoid" gives Kimi Linear's sigmoid-gated norm (its gate projection
  is low-rank; here g_proj is full-rank). Grouped value heads (n_value_heads) put the gate and beta per value head.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import LinattnError, LinattnTypeError
from ..ops import comba, delta_product
from .cache import LayerCache
from .common import ShortConv, cdt, init_mamba_decay, l2_normalize, mamba_log_decay
from .delta import DeltaNet, GatedDeltaNet
from .packing import packed_positions
from .registry import register_mixer


def _no_value_groups(name: str, n_heads: int, kwargs) -> None:
    hv = kwargs.get("n_value_heads")
    if hv is not None and hv != n_heads:
        raise LinattnError(f"{name} has no grouped value heads: n_value_heads must be None or n_heads ({n_heads}), "
                           f"got {hv!r}")


class Comba(GatedDeltaNet):
    """Comba (Hu et al. 2025): the gated delta rule with state feedback p = sigmoid(c) k and output
    correction q - d p (module docstring).

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        correction_factor: the initial d (default 1.0).
        output_correction: (default True) turns q - d p off when False.
        inner_decay: (default True): False means p = k (no p_gain).
        correction_before_norm: (default False: q and k are L2-normalised first, then p and q - d p are formed):
            True is flash-linear-attention's order, p = sigmoid(c) k and q - d p from the raw q and k, then q, k
            and p L2-normalised (so the read key is k / ||k||, and c acts through the correction only).
        **kwargs: `GatedDeltaNet`'s options (and so `DeltaNet`'s and `AttentionBase`'s). With grouped value heads
            (n_value_heads) p, c and d stay per q/k head; v, beta and the decay are per value head.

    Raises:
        LinattnError: A bad option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import Comba
        >>> Comba(64, 4)(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    qk_norms = ("l2",)   # the layer normalises q, k (and p) itself, in the rsqrt form

    def __init__(self, d_model: int, n_heads: int, *, correction_factor: float = 1.0, output_correction: bool = True,
                 inner_decay: bool = True, correction_before_norm: bool = False, **kwargs):
        super().__init__(d_model, n_heads, **kwargs)
        if isinstance(correction_factor, bool) or not isinstance(correction_factor, (int, float)):
            raise LinattnTypeError(f"correction_factor must be a number, got {correction_factor!r}")
        self.output_correction = bool(output_correction)
        self.inner_decay, self.correction_before_norm = bool(inner_decay), bool(correction_before_norm)
        if self.inner_decay:
            self.p_gain = nn.Parameter(torch.ones(self.n_heads))     # p = sigmoid(p_gain) * k
        if self.output_correction:
            self.d = nn.Parameter(torch.full((self.n_heads,), float(correction_factor)))

    def _mix(self, q, k, v, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        if not self.correction_before_norm:
            q, k = l2_normalize(q), l2_normalize(k)
        p = torch.sigmoid(self.p_gain)[:, None].to(k.dtype) * k if self.inner_decay else k
        if self.output_correction:
            q = q - self.d[:, None].to(q.dtype) * p
        if self.correction_before_norm:
            q, k, p = l2_normalize(q), l2_normalize(k), l2_normalize(p)
        beta = self.beta(x).to(q.dtype)
        o, state = comba(
            q, k, v, beta, p=p, g=self.log_gate(x), scale=self.scale, mode=self._mode(cache, x.shape[1]),
            chunk_size=self.chunk_size, initial_state=cache.state if cache is not None else None,
            output_final_state=cache is not None, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.state = state
        return o

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", output_correction={self.output_correction}, inner_decay={self.inner_decay}"
                + (", correction_before_norm=True" if self.correction_before_norm else ""))


class DeltaProduct(DeltaNet):
    """DeltaProduct (Siems et al. 2025): n_householder delta-rule steps per token (module docstring).

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        n_householder: (default 2) the steps per token.
        allow_negative_eigenvalues: (default False: beta = sigmoid, True: beta = 2 sigmoid).
        gate: (default False: True adds Gated DeltaNet's decay per token, applied before the n steps).
        conv_size: The short convolutions' kernel.
        qkv_bias: Biases on the q/k/v projections.
        beta_bias: A bias on b_proj.
        **kwargs: `DeltaNet`'s options (chunk_size counts sub-steps, n per token, as in the operator) and
            `AttentionBase`'s.

    Raises:
        LinattnError: A bad n_householder or other option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import DeltaProduct
        >>> DeltaProduct(64, 4, n_householder=2, allow_negative_eigenvalues=True)(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    qk_norms = ("l2", "l2-clamp")

    def __init__(self, d_model: int, n_heads: int, *, n_householder: int = 2, allow_negative_eigenvalues: bool = False,
                 gate: bool = False, conv_size: int = 4, qkv_bias: bool = False, beta_bias: bool = True, **kwargs):
        if isinstance(n_householder, bool) or not isinstance(n_householder, int) or n_householder < 1:
            raise LinattnError(f"n_householder must be a positive int, got {n_householder!r}")
        _no_value_groups("DeltaProduct", n_heads, kwargs)
        if not kwargs.get("use_beta", True) or kwargs.get("qk_activation", "silu") != "silu":
            raise LinattnError("DeltaProduct takes neither use_beta=False nor a qk_activation other than 'silu'")
        super().__init__(d_model, n_heads, conv_size=conv_size, qkv_bias=qkv_bias, **kwargs)
        self.n_householder = n = n_householder
        self.allow_negative_eigenvalues = bool(allow_negative_eigenvalues)
        H, Dk, Dv = self.n_heads, self.head_dim, self.head_dim_v
        # n keys, values and step sizes per head and token
        self.k_proj = nn.Linear(d_model, H * n * Dk, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, H * n * Dv, bias=qkv_bias)
        self.b_proj = nn.Linear(d_model, H * n, bias=bool(beta_bias))
        if self.short_conv:
            self.k_conv = ShortConv(H * n * Dk, conv_size)
            self.v_conv = ShortConv(H * n * Dv, conv_size)
        self.gated = bool(gate)
        if self.gated:
            self.a_proj = nn.Linear(d_model, H, bias=False)
            A_log, dt_bias = init_mamba_decay(H)
            self.A_log = nn.Parameter(A_log)
            self.dt_bias = nn.Parameter(dt_bias)

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        """The step sizes of the n Householder steps of every token.

        Args:
            x: The layer input `[B, T, d_model]`.

        Returns:
            beta `[B, T, H, n]` in (0, 1), or (0, 2) with allow_negative_eigenvalues.
        """
        b = self.b_proj(x)
        b = torch.sigmoid(b.to(cdt(b))).view(*x.shape[:2], self.n_heads, self.n_householder)
        return 2.0 * b if self.allow_negative_eigenvalues else b

    def log_gate(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Gated DeltaNet's decay per token (applied before the n steps) when `gate=True`.

        Args:
            x: The layer input `[B, T, d_model]`.

        Returns:
            g `[B, T, H]` (<= 0), or None without the gate.
        """
        if not self.gated:
            return None
        return mamba_log_decay(self.a_proj(x), self.A_log, self.dt_bias)

    def _qkv(self, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        """q `[B, T, H, K]`, k `[B, T, H, n, K]`, v `[B, T, H, n, V]` (AttentionBase._qkv with n keys)."""
        B, T, _ = x.shape
        H, n = self.n_heads, self.n_householder
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.short_conv:
            conv = cache.conv if cache is not None else {}
            q, sq = self.q_conv(q, conv.get("q"), cu_seqlens)
            k, sk = self.k_conv(k, conv.get("k"), cu_seqlens)
            v, sv = self.v_conv(v, conv.get("v"), cu_seqlens)
            if cache is not None:
                cache.conv.update(q=sq, k=sk, v=sv)
        if not self._plain_features:
            q, k, v = self._features(q, k, v)
        q = q.view(B, T, H, self.head_dim)
        k = k.view(B, T, H * n, self.head_dim)
        v = v.view(B, T, H, n, self.head_dim_v)
        if self.rope is not None:  # every key of a token at the token's position
            if cu_seqlens is not None:
                q, k = self.rope(q, k, positions=packed_positions(cu_seqlens, T, x.device))
            else:
                q, k = self.rope(q, k, cache.offset if cache is not None else 0)
        return q, k.view(B, T, H, n, self.head_dim), v

    def _mix(self, q, k, v, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        beta = self.beta(x).to(q.dtype)
        o, state = delta_product(
            q, k, v, beta, g=self.log_gate(x), scale=self.scale, qk_l2norm=self.l2norm_convention,
            mode=self._mode(cache, x.shape[1]), chunk_size=self.chunk_size,
            initial_state=cache.state if cache is not None else None,
            output_final_state=cache is not None, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.state = state
        return o

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", n_householder={self.n_householder}, "
                f"allow_negative_eigenvalues={self.allow_negative_eigenvalues}, gate={self.gated}")


class KDA(DeltaNet):
    """Kimi Delta Attention: the gated delta rule with a decay per key channel (module docstring).

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        gate_rank: the inner width of the low-rank gate projection (default head_dim).
        output_gate: defaults to True.
        output_gate_rank: (None: g_proj is one full-rank linear map, bias-free): an int makes g_proj low-rank as
            in flash-linear-attention's and Kimi Linear's layers, d_model -> rank (bias-free) -> HV * head_dim_v
            with a bias.
        gate_lower_bound: (None: the Mamba2 form above): a negative number b gives fla's bounded gate
            g = b * sigmoid(exp(A_log_h) (f_proj(x) + dt_bias)), in [b, 0).
        **kwargs: `DeltaNet`'s options and `AttentionBase`'s.

    Examples:
        >>> import torch
        >>> from linattn.layers import KDA
        >>> KDA(64, 4)(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    def __init__(self, d_model: int, n_heads: int, *, gate_rank: Optional[int] = None, output_gate: bool = True,
                 output_gate_rank: Optional[int] = None, gate_lower_bound: Optional[float] = None, **kwargs):
        super().__init__(d_model, n_heads, output_gate=output_gate, **kwargs)
        rank = self.head_dim if gate_rank is None else gate_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise LinattnError(f"gate_rank must be a positive int or None (head_dim), got {gate_rank!r}")
        self.gate_rank = rank
        if output_gate_rank is not None:
            if (isinstance(output_gate_rank, bool) or not isinstance(output_gate_rank, int) or output_gate_rank < 1
                    or self.g_proj is None):
                raise LinattnError(f"output_gate_rank must be None or a positive int with output_gate=True, "
                                   f"got {output_gate_rank!r} (output_gate={self.g_proj is not None})")
            self.g_proj = nn.Sequential(nn.Linear(d_model, output_gate_rank, bias=False),
                                        nn.Linear(output_gate_rank, self.n_value_heads * self.head_dim_v, bias=True))
        self.output_gate_rank = output_gate_rank
        if gate_lower_bound is not None and (isinstance(gate_lower_bound, bool)
                                             or not isinstance(gate_lower_bound, (int, float))
                                             or not gate_lower_bound < 0):
            raise LinattnError(f"gate_lower_bound must be None or a negative number, got {gate_lower_bound!r}")
        self.gate_lower_bound = None if gate_lower_bound is None else float(gate_lower_bound)
        HV, K = self.n_value_heads, self.head_dim     # one gate per value head and key channel
        self.f_proj = nn.Sequential(nn.Linear(d_model, rank, bias=False), nn.Linear(rank, HV * K, bias=False))
        A_log, _ = init_mamba_decay(HV)
        _, dt_bias = init_mamba_decay(HV * K)     # a time scale per channel
        self.A_log = nn.Parameter(A_log)
        self.dt_bias = nn.Parameter(dt_bias)

    def log_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The per-channel log-gate: Kimi Delta Attention's decay.

        Args:
            x: The layer input `[B, T, d_model]`.

        Returns:
            g `[B, T, HV, K]` (<= 0), in fp32 (fp64 in an fp64 model).
        """
        B, T = x.shape[:2]
        HV, K = self.n_value_heads, self.head_dim
        f = self.f_proj(x)
        f = f.to(cdt(f))
        f = f.view(B, T, HV, K) + self.dt_bias.to(f.dtype).view(HV, K)
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * torch.sigmoid(torch.exp(self.A_log.to(f.dtype))[:, None] * f)
        return -torch.exp(self.A_log.to(f.dtype))[:, None] * F.softplus(f)

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", gate_rank={self.gate_rank}"
                + (f", output_gate_rank={self.output_gate_rank}" if self.output_gate_rank is not None else "")
                + (f", gate_lower_bound={self.gate_lower_bound}" if self.gate_lower_bound is not None else ""))


# the mixers of this module (their registration order is the order of linattn.mixers(): see layers/__init__.py)
register_mixer("comba", Comba, {}, "Comba: gated delta rule with state feedback p = sigmoid(c) k and "
               "output correction q - d p", short_conv=True)
register_mixer("delta-product", DeltaProduct, {"n_householder": 2},
               "DeltaProduct: 2 Householder (delta-rule) steps per token", short_conv=True)
register_mixer("kda", KDA, {}, "Kimi Delta Attention: gated delta rule with a per-channel decay", short_conv=True)


__all__ = ["Comba", "DeltaProduct", "KDA"]
