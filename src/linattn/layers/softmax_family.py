"""Softmax attention with what linear attention taught: `FoX`, `DeltaFormer` and `PaTH` layers.

All three keep a KV-style cache (it grows with the tokens seen, like softmax attention's):

* `FoX` (Forgetting Transformer): a sigmoid forget gate per head and token, g = logsigmoid(f_proj(x)),
  inside the softmax (`linattn.ops.forgetting_attention`). No RoPE by default (the gate is the
  position signal). The FoX "Pro" block is this layer with `output_gate=True, output_norm=True,
  qk_norm=True, short_conv=True` (its KV-shift is a short causal convolution here). Optional
  sliding `window`. Cache: keys, values, the cumulative gate of each key and the running G.
* `DeltaFormer`: beta = sigmoid(b_proj(x)) per head; stage one makes pseudo-values
  u_t = v_t - beta_t softmax_{j<t}(k_t . k_j) u_<t (keys score keys, `stage1_query="k"`, or queries,
  "q"), stage two attends them (`linattn.ops.deltaformer`). RoPE by default. Cache: (k, u).
* `PaTH`: Householder-like position encoding (`linattn.ops.path_attention`) with
  w = L2norm(ShortConv(low-rank projection of x)) per head (kernel 3, no activation) and
  beta = 2 sigmoid(b_proj(x)) in (0, 2); optional FoX gate (`use_forget_gate`). No RoPE by default.
  Cache: keys already multiplied by every later factor, values (and gates), the w convolution's state.

Training and prefill from an empty cache run the chunk form (blockwise, memory O(T * block)); every
later call on a cache runs the operator's decoding step, token by token.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import LinattnError
from ..ops.deltaformer import STAGE1_QUERIES, deltaformer, deltaformer_step
from ..ops.forgetting import forgetting_attention, forgetting_attention_step
from ..ops.l2norm import l2norm
from ..ops.path import path_attention, path_attention_step
from .base import AttentionBase
from .cache import LayerCache
from .common import RMSNorm, ShortConv
from .packing import packed_positions
from .registry import register_mixer


def _cdt(x: torch.Tensor) -> torch.dtype:
    """The gates' dtype: fp64 stays fp64, everything else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


class _ChannelRMSNorm(nn.Module):
    """RMSNorm over each head's channels with one weight per channel `[H * D]` (fla's GroupNorm with
    is_rms_norm=True as FoX's q/k norm), on `[B, T, H, D]`; computed in fp32 (fp64 for fp64)."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.heads, self.dim, self.eps = int(heads), int(dim), float(eps)
        self.weight = nn.Parameter(torch.ones(self.heads * self.dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_cdt(x))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype).view(self.heads, self.dim)).to(x.dtype)


class _CachedSoftmaxFamily(AttentionBase):
    """Shared: chunk_size, scale, optional per-head QK RMSNorm, and the cache logic of `_mix`.

    Subclasses implement `_extras(x, cache, cu_seqlens)` (their per-token gates) and `_forward` /
    `_step` (the operator and its decoding step)."""

    config_fields = AttentionBase.config_fields + ("chunk_size",)

    def __init__(self, d_model: int, n_heads: int, *, chunk_size: int = 64, scale: Optional[float] = None,
                 qk_norm: bool = False, output_norm: bool = False, qk_norm_eps: Optional[float] = None,
                 qk_norm_weight: str = "head", qk_norm_before_rope: bool = False, n_kv_heads: Optional[int] = None,
                 **kwargs):
        """Options for fla's layers (the defaults keep the layer as it was): qk_norm_eps (None: norm_eps);
        qk_norm_weight "head" (one weight [head_dim] shared by the heads) or "channel" (one per channel [H * K],
        fla FoX's GroupNorm(is_rms_norm)); qk_norm_before_rope (fla's order; default after RoPE); n_kv_heads:
        grouped k/v heads (GQA: query head h reads k/v head h // (H / n_kv_heads); None: one per query head)."""
        super().__init__(d_model, n_heads, output_norm=output_norm, **kwargs)
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise LinattnError(f"chunk_size must be a positive int, got {chunk_size!r}")
        if qk_norm_weight not in ("head", "channel"):
            raise LinattnError(f"qk_norm_weight must be 'head' or 'channel', got {qk_norm_weight!r}")
        self.chunk_size = int(chunk_size)
        self.scale = self.resolve_scale(scale, self.head_dim)
        H = self.n_heads
        kvh = H if n_kv_heads is None else n_kv_heads
        if isinstance(kvh, bool) or not isinstance(kvh, int) or kvh < 1 or H % kvh:
            raise LinattnError(f"n_kv_heads must be a positive int that divides n_heads ({H}), got {n_kv_heads!r}")
        if kvh != H and (self.n_value_heads != H or self.short_conv):
            raise LinattnError(f"n_kv_heads ({kvh}) cannot be combined with n_value_heads or short_conv")
        self.n_kv_heads = int(kvh)
        if kvh != H:   # the grouped k/v projections
            bias = self.q_proj.bias is not None
            self.k_proj = nn.Linear(d_model, kvh * self.head_dim, bias=bias)
            self.v_proj = nn.Linear(d_model, kvh * self.head_dim_v, bias=bias)
        self.qk_norm = bool(qk_norm)
        self.qk_norm_before_rope = bool(qk_norm_before_rope)
        if self.qk_norm and self.qk_norm_before_rope and self.short_conv:
            raise LinattnError("qk_norm_before_rope cannot be combined with short_conv")
        if self.qk_norm:
            eps = kwargs.get("norm_eps", 1e-6) if qk_norm_eps is None else float(qk_norm_eps)
            if qk_norm_weight == "head":
                self.q_norm = RMSNorm(self.head_dim, eps=eps)
                self.k_norm = RMSNorm(self.head_dim, eps=eps)
            else:
                self.q_norm = _ChannelRMSNorm(H, self.head_dim, eps)
                self.k_norm = _ChannelRMSNorm(kvh, self.head_dim, eps)

    def _qkv(self, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        if self.n_kv_heads == self.n_heads and not (self.qk_norm and self.qk_norm_before_rope):
            return super()._qkv(x, cache, cu_seqlens)
        B, T, _ = x.shape      # (no short conv here: __init__ refuses it with n_kv_heads or qk_norm_before_rope)
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim_v)
        if self.qk_norm and self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            if cu_seqlens is not None:
                q, k = self.rope(q, k, positions=packed_positions(cu_seqlens, T, x.device))
            else:
                q, k = self.rope(q, k, cache.offset if cache is not None else 0)
        return q, k, v

    def _kv_heads(self, t: torch.Tensor) -> torch.Tensor:
        """k or v `[B, T, n_kv_heads, D]` repeated to the query heads (each k/v head serves its group)."""
        g = self.n_heads // self.n_kv_heads
        return t if g == 1 else t.repeat_interleave(g, dim=2)

    def _extras(self, x, cache, cu_seqlens):  # pragma: no cover
        raise NotImplementedError

    def _forward(self, q, k, v, extras, cu_seqlens=None, output_final_state=False):  # pragma: no cover
        raise NotImplementedError

    def _step(self, q, k, v, extras, state):  # pragma: no cover
        raise NotImplementedError

    def _mix(self, q, k, v, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        if self.qk_norm and not self.qk_norm_before_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        k, v = self._kv_heads(k), self._kv_heads(v)
        extras = self._extras(x, cache, cu_seqlens)
        if cache is None:
            return self._forward(q, k, v, extras, cu_seqlens=cu_seqlens)
        state = cache.state
        if state is None and q.shape[1] > 1:     # prefill: the chunk form, then its final state
            o, state = self._forward(q, k, v, extras, output_final_state=True)
        else:
            o, state = self._step(q, k, v, extras, state)
        cache.state = state
        return o

    def extra_repr(self) -> str:
        return super().extra_repr() + f", chunk_size={self.chunk_size}, qk_norm={self.qk_norm}"


class FoX(_CachedSoftmaxFamily):
    """Forgetting Transformer attention (module docstring): softmax attention with a learned forget gate.

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        window: Keys with i - j < window; None: all.
        rope: Rotary positions on q and k (default False).
        **kwargs: chunk_size (the operator's block length), scale (None: head_dim**-0.5), qk_norm (per-head
            RMSNorm on q and k), and `AttentionBase`'s options; short_conv, output_gate and output_norm
            default to False.

    Raises:
        LinattnError: A bad window or other option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import FoX, LayerCache
        >>> layer = FoX(64, 4, chunk_size=4).double()
        >>> x = torch.randn(2, 10, 64, dtype=torch.float64)
        >>> y = layer(x)
        >>> cache = LayerCache()
        >>> _ = layer(x[:, :9], cache)
        >>> torch.allclose(layer(x[:, 9:], cache), y[:, 9:])
        True
    """

    config_fields = _CachedSoftmaxFamily.config_fields + ("window",)

    def __init__(self, d_model: int, n_heads: int, *, window: Optional[int] = None, rope: bool = False, **kwargs):
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise LinattnError(f"window must be a positive int or None, got {window!r}")
        super().__init__(d_model, n_heads, rope=rope, **kwargs)
        self.window = window
        self.f_proj = nn.Linear(d_model, self.n_heads, bias=True)

    def log_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The forget gate, g = log f = logsigmoid(f_proj(x)).

        Args:
            x: The layer input `[B, T, d_model]`.

        Returns:
            g `[B, T, H]` (fp32).
        """
        return F.logsigmoid(self.f_proj(x).to(_cdt(x)))

    def _extras(self, x, cache, cu_seqlens):
        return self.log_gate(x)

    def _forward(self, q, k, v, g, cu_seqlens=None, output_final_state=False):
        return forgetting_attention(q, k, v, g, window=self.window, scale=self.scale, block_size=self.chunk_size,
                                    cu_seqlens=cu_seqlens, output_final_state=output_final_state)

    def _step(self, q, k, v, g, state):
        return forgetting_attention_step(q, k, v, g, state, window=self.window, scale=self.scale)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", window={self.window}"


class DeltaFormer(_CachedSoftmaxFamily):
    """DeltaFormer attention (module docstring).

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        stage1_query: "k" (the seed's form) or "q".
        rope: Rotary positions on q and k (default True).
        beta_act: beta = sigmoid(b_proj(x)) (default), or None: b_proj(x) itself (fla's DeltaFormer passes the
            projection to its kernel as it is).
        **kwargs: chunk_size (the operator's block length), scale (None: head_dim**-0.5), qk_norm, and
            `AttentionBase`'s options; short_conv and output_norm default to False.

    Raises:
        LinattnError: A bad stage1_query, beta_act or other option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import DeltaFormer
        >>> DeltaFormer(64, 4)(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    def __init__(self, d_model: int, n_heads: int, *, stage1_query: str = "k", rope: bool = True,
                 beta_act: Optional[str] = "sigmoid", **kwargs):
        if beta_act not in ("sigmoid", None):
            raise LinattnError(f"beta_act must be 'sigmoid' or None, got {beta_act!r}")
        if stage1_query not in STAGE1_QUERIES:
            raise LinattnError(f"stage1_query must be one of {STAGE1_QUERIES}, got {stage1_query!r}")
        super().__init__(d_model, n_heads, rope=rope, **kwargs)
        if self.n_kv_heads != self.n_heads:
            raise LinattnError("DeltaFormer: n_kv_heads (grouped k/v heads) is not supported")
        self.stage1_query, self.beta_act = stage1_query, beta_act
        self.b_proj = nn.Linear(d_model, self.n_heads, bias=True)

    def beta(self, x: torch.Tensor) -> torch.Tensor:
        """beta = sigmoid(b_proj(x)) (or b_proj(x) with beta_act None).

        Args:
            x: The layer input `[B, T, d_model]`.

        Returns:
            beta `[B, T, H]` (fp32; fp64 for fp64).
        """
        b = self.b_proj(x).to(_cdt(x))
        return torch.sigmoid(b) if self.beta_act == "sigmoid" else b

    def _extras(self, x, cache, cu_seqlens):
        return self.beta(x)

    def _forward(self, q, k, v, beta, cu_seqlens=None, output_final_state=False):
        return deltaformer(q, k, v, beta, stage1_query=self.stage1_query, scale=self.scale,
                           block_size=self.chunk_size, cu_seqlens=cu_seqlens, output_final_state=output_final_state)

    def _step(self, q, k, v, beta, state):
        return deltaformer_step(q, k, v, beta, state, stage1_query=self.stage1_query, scale=self.scale)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", stage1_query={self.stage1_query!r}"


class PaTH(_CachedSoftmaxFamily):
    """PaTH attention (module docstring).

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        w_rank: The width of the low-rank w projection; None: a full-rank w_proj (fla's use_low_rank_w=False).
        w_conv_size: The w convolution's kernel.
        use_forget_gate: PaTH-FoX: add FoX's gate.
        rope: Rotary positions on q and k (default False).
        w_conv: A short convolution on w; False: none (fla's use_w_shortconv=False).
        w_conv_act: That convolution's activation, "silu" (fla's) or None.
        w_conv_bias: That convolution's bias.
        w_l2norm: "normalize" (x / max(||x||, 1e-6)) or "rsqrt" (x * rsqrt(sum x^2 + 1e-6), fla's l2_norm).
        **kwargs: chunk_size (the operator's block length), scale (None: head_dim**-0.5), qk_norm, and
            `AttentionBase`'s options; short_conv and output_norm default to False.

    Raises:
        LinattnError: A bad option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import PaTH
        >>> PaTH(64, 4, use_forget_gate=True)(torch.randn(2, 10, 64)).shape
        torch.Size([2, 10, 64])
    """

    def __init__(self, d_model: int, n_heads: int, *, w_rank: Optional[int] = 32, w_conv_size: int = 3,
                 use_forget_gate: bool = False, rope: bool = False, w_conv: bool = True,
                 w_conv_act: Optional[str] = None, w_conv_bias: bool = False, w_l2norm: str = "normalize", **kwargs):
        super().__init__(d_model, n_heads, rope=rope, **kwargs)
        if (w_rank is not None and w_rank < 1) or w_conv_size < 1:
            raise LinattnError(f"w_rank (or None) and w_conv_size must be >= 1, got {w_rank}, {w_conv_size}")
        if w_conv_act not in (None, "silu") or w_l2norm not in ("normalize", "rsqrt"):
            raise LinattnError(f"w_conv_act must be None or 'silu' and w_l2norm 'normalize' or 'rsqrt', got "
                               f"{w_conv_act!r}, {w_l2norm!r}")
        # w and beta act on the keys: one per k/v head (grouped heads: fla's PaTH with num_kv_heads)
        HK = self.n_kv_heads * self.head_dim
        if w_rank is None:
            self.w_proj = nn.Linear(d_model, HK, bias=False)
        else:
            self.w_down = nn.Linear(d_model, int(w_rank), bias=False)
            self.w_up = nn.Linear(int(w_rank), HK, bias=False)
        self.w_l2norm = w_l2norm
        self.w_conv = ShortConv(HK, int(w_conv_size), activation=w_conv_act, bias=w_conv_bias) if w_conv else None
        self.b_proj = nn.Linear(d_model, self.n_kv_heads, bias=True)
        self.f_proj = nn.Linear(d_model, self.n_heads, bias=True) if use_forget_gate else None

    def householder(self, x: torch.Tensor, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor]):
        """The Householder directions and strengths of every token.

        The w convolution continues from `cache`'s state (and writes it back) when a cache is given.

        Args:
            x: The layer input `[B, T, d_model]`.
            cache: The layer's `LayerCache`, or None.
            cu_seqlens: int64 `[N+1]` offsets of packed documents, or None.

        Returns:
            (w `[B, T, H, K]` with ||w|| = 1, beta = 2 sigmoid(b_proj(x)) `[B, T, H]`).
        """
        B, T, _ = x.shape
        mods = self._modules
        w = mods["w_proj"](x) if "w_proj" in mods else self.w_up(self.w_down(x))
        if self.w_conv is not None:
            w, conv_state = self.w_conv(w, cache.conv.get("w") if cache is not None else None, cu_seqlens)
            if cache is not None:
                cache.conv["w"] = conv_state
        w = w.view(B, T, self.n_kv_heads, self.head_dim).to(_cdt(x))
        w = F.normalize(w, dim=-1, eps=1e-6) if self.w_l2norm == "normalize" else l2norm(w, "rsqrt")
        beta = 2 * torch.sigmoid(self.b_proj(x).to(_cdt(x)))
        if self.n_kv_heads != self.n_heads:   # each query head of a group sees its k/v head's factors
            g = self.n_heads // self.n_kv_heads
            w, beta = w.repeat_interleave(g, dim=2), beta.repeat_interleave(g, dim=2)
        return w, beta

    def _extras(self, x, cache, cu_seqlens):
        w, beta = self.householder(x, cache, cu_seqlens)
        g = F.logsigmoid(self.f_proj(x).to(_cdt(x))) if self.f_proj is not None else None
        return w, beta, g

    def _forward(self, q, k, v, extras, cu_seqlens=None, output_final_state=False):
        w, beta, g = extras
        return path_attention(q, k, v, w.to(q.dtype), beta, g=g, scale=self.scale, block_size=self.chunk_size,
                              cu_seqlens=cu_seqlens, output_final_state=output_final_state)

    def _step(self, q, k, v, extras, state):
        w, beta, g = extras
        return path_attention_step(q, k, v, w.to(q.dtype), beta, state, g=g, scale=self.scale)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", forget_gate={self.f_proj is not None}"


# the mixers of this module (their registration order is the order of linattn.mixers(): see layers/__init__.py)
register_mixer("fox", FoX, {}, "FoX: softmax attention with a sigmoid forget gate per head (no RoPE)")
register_mixer("deltaformer", DeltaFormer, {}, "DeltaFormer: softmax attention over delta-rule pseudo-values",
               rope=True)
register_mixer("path", PaTH, {}, "PaTH: softmax attention with accumulated Householder position encoding")


__all__ = ["FoX", "DeltaFormer", "PaTH"]
