"""RWKV-7's time mixing (the mixer `rwkv7`), on `linattn.rwkv7`, after flash-linear-attention's `RWKV7Attention`:

    dx = x_{t-1} - x_t                                          (token shift; zero before a document's first token)
    x_c = x + dx * mu_c   for c in r, w, k, v, a, g             (learned per-channel interpolations x_r .. x_g)
    r = W_r x_r,  k = W_k x_k,  v = W_v x_v
    v = lerp(v, v_first, sigmoid(v0 + lora_v(x_v)))            (later layers: the value residual, below)
    w = -exp(-1/2) * sigmoid(w0 + lora_w(x_w))                  (log decay in (-0.61, 0); lora_w: down, tanh, up)
    a = sigmoid(a0 + lora_a(x_a)),  g = lora_g(x_g)             (lora_g: down, sigmoid, up; no bias)
    kk = normalize(k * k_k) per head,  k <- k * (1 + (a - 1) k_a)
    o = rwkv7(r, w, k, v, a=-kk, b=kk * a, scale=1)             (S_t = D S + b (a^T S) + k v^T, o = S^T r)
    o = GroupNorm_heads(o) + (sum_d r k u) v                    (the "bonus": the current token through u = r_k)
    out = W_o (o * g)

Value residual: RWKV-7 mixes every later layer's v with the first layer's, v <- lerp(v, v_first, sigmoid(v0 +
lora_v(x_v))). The block interface passes a mixer only x, so the LanguageModel hands its RWKV-7 layers one shared
`ValueResidual` at construction (`link_layers`, called in block order): the first RWKV-7 layer (it has no lora_v,
as in fla) publishes its v there in each call, and the later ones read it in the same call. Each token mixes with
its own first-layer value, so causality, packing and decoding are unaffected. The holder keeps the last call's
v_first (one `[B, T, H * head_dim]` tensor) until the next call, so a block recomputed in the backward pass
(activation checkpointing) reads the same tensor. A layer used alone (not linked) uses its own v.
Init: a simplified form of RWKV-7's (interpolations 1 - (i / C)^p per channel i, decay biases spread from fast to
slow channels, k_k = 0.85, k_a = 1, r_k = 0); the linear maps get the LanguageModel's init.

With a `LayerCache` it decodes incrementally: "shift" holds the last input token `[B, d_model]` and "state" the
operator's state `[B, H, K, V]` (and "conv" the short conv's window, when it is on).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError, LinattnError
from ..ops.l2norm import l2norm
from ..ops.rwkv7 import rwkv7
from .cache import LayerCache
from .common import RotaryEmbedding, ShortConv
from .packing import check_mixer_call, packed_positions
from .registry import register_mixer

_MIX = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
_W_SCALE = 0.6065306597126334   # exp(-1/2): fla's bound on -w, so exp(w) >= 0.545 per token
KK_NORMS = ("normalize", "rsqrt")


def _pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"RWKV7: {name} must be a positive int, got {v!r}")
    return int(v)


class _LoRA(nn.Module):
    """down (no bias), activation, up (bias: the 'w0' / 'a0' offsets)."""

    def __init__(self, d_in: int, d_out: int, rank: int, activation: Optional[str], bias: bool):
        super().__init__()
        self.down = nn.Linear(d_in, rank, bias=False)
        self.up = nn.Linear(rank, d_out, bias=False)
        self.activation = activation
        # kept out of nn.Linear, whose biases the LanguageModel's init zeroes (w0 carries the decay spread)
        self.bias = nn.Parameter(torch.zeros(d_out)) if bias else None

    def forward(self, x):
        h = self.down(x)
        if self.activation == "tanh":
            h = torch.tanh(h)
        elif self.activation == "sigmoid":
            h = torch.sigmoid(h)
        h = self.up(h)
        return h + self.bias if self.bias is not None else h


class ValueResidual:
    """The first RWKV-7 layer's values of the current call, shared by a model's RWKV-7 layers (module docstring).
    A plain object, not a module: it holds no parameters and no state across calls."""

    def __init__(self):
        self.v: Optional[torch.Tensor] = None


class RWKV7(nn.Module):
    """RWKV-7 time mixing (module docstring). x `[B, T, d_model]` -> `[B, T, d_model]`.

    The operator's scale is 1 (RWKV-7's): `scale` is that number.

    Args:
        d_model: The model width.
        n_heads: The number of heads.
        head_dim: default d_model // n_heads.
        decay_rank: the low rank of the w (decay) projection.
        a_rank: the low rank of the a projection.
        gate_rank: the low rank of the g (output gate) projection.
        value_rank: the low rank of the v-residual projection (used only where layer_idx > 0).
        norm_eps: the group norm's epsilon per channel (times head_dim, as fla; fla's default 1e-5, not
            LMConfig.norm_eps, the RMSNorms').
        chunk_size: the operator's chunk in training and prefill.
        layer_idx: the index of the layer in its model (the first layer has no v-residual).
        n_layers: the model's number of layers (RWKV-7's initialisation depends on the layer's depth).
        rope: not RWKV-7, an option for ablations: rotary positions on r and k (after the k update; kk is
            taken before).
        rope_base: the rotary embedding's base.
        max_seq_len: the rotary table's initial size.
        short_conv: not RWKV-7 (whose token shift plays the short conv's role), an option for ablations: a
            causal depthwise conv (no activation) over r, k, v after their projections.
        conv_size: that convolution's kernel.
        head_dim_v: the value width per head (default head_dim; fla's value_dim / n_heads): v, the gate, the group
            norm and o_proj's input are n_heads * head_dim_v wide.
        kk_norm: the L2 normalisation of kk, "normalize" (torch's F.normalize, x / max(||x||, 1e-12), fla's
            layer with fuse_norm=False; the default) or "rsqrt" (x * rsqrt(sum x^2 + 1e-6), fla's fused l2_norm:
            fuse_norm=True).

    Raises:
        LinattnError: A bad size or option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import LayerCache, RWKV7
        >>> layer = RWKV7(64, 4, layer_idx=0, n_layers=2).double()
        >>> x = torch.randn(2, 10, 64, dtype=torch.float64)
        >>> y = layer(x)
        >>> cache = LayerCache()                     # prefill 9 tokens, then decode the 10th
        >>> _ = layer(x[:, :9], cache)
        >>> torch.allclose(layer(x[:, 9:], cache), y[:, 9:])
        True
    """

    causal = True
    #: forward takes cu_seqlens (packed documents) and keeps the documents apart (`Block` relies on it)
    supports_cu_seqlens = True
    config_fields = ("head_dim", "rope", "rope_base", "short_conv", "max_seq_len", "chunk_size", "layer_idx",
                     "n_layers")
    scale = 1.0

    def __init__(self, d_model: int, n_heads: int, *, head_dim: Optional[int] = None, decay_rank: int = 32,
                 a_rank: int = 32, gate_rank: int = 64, value_rank: int = 16, norm_eps: float = 1e-5,
                 chunk_size: int = 64,
                 layer_idx: Optional[int] = None, n_layers: Optional[int] = None, rope: bool = False,
                 rope_base: float = 10000.0, max_seq_len: int = 2048, short_conv: bool = False, conv_size: int = 4,
                 kk_norm: str = "normalize", head_dim_v: Optional[int] = None):
        super().__init__()
        if kk_norm not in KK_NORMS:
            raise ConfigError(f"RWKV7: kk_norm must be one of {KK_NORMS}, got {kk_norm!r}")
        self.kk_norm = kk_norm
        d_model, n_heads = _pos_int("d_model", d_model), _pos_int("n_heads", n_heads)
        if head_dim is None:
            if d_model % n_heads:
                raise ConfigError(f"RWKV7: d_model ({d_model}) must be divisible by n_heads ({n_heads}), "
                                  f"or pass head_dim")
            head_dim = d_model // n_heads
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, _pos_int("head_dim", head_dim)
        self.head_dim_v = self.head_dim if head_dim_v is None else _pos_int("head_dim_v", head_dim_v)
        self.chunk_size = _pos_int("chunk_size", chunk_size)
        self.layer_idx = layer_idx
        D, Dv = n_heads * self.head_dim, n_heads * self.head_dim_v
        for name in _MIX:                                             # fla's names x_r .. x_g
            setattr(self, name, nn.Parameter(torch.zeros(d_model)))
        self.r_proj = nn.Linear(d_model, D, bias=False)
        self.k_proj = nn.Linear(d_model, D, bias=False)
        self.v_proj = nn.Linear(d_model, Dv, bias=False)
        self.o_proj = nn.Linear(Dv, d_model, bias=False)
        self.w_lora = _LoRA(d_model, D, _pos_int("decay_rank", decay_rank), "tanh", bias=True)
        self.a_lora = _LoRA(d_model, D, _pos_int("a_rank", a_rank), None, bias=True)
        self.g_lora = _LoRA(d_model, Dv, _pos_int("gate_rank", gate_rank), "sigmoid", bias=False)
        # the value residual's mix (fla: every layer but the first); dropped by link_layers from the first RWKV-7 layer
        value_rank = _pos_int("value_rank", value_rank)
        self.v_lora = _LoRA(d_model, Dv, value_rank, None, bias=True) if layer_idx else None
        self._share: Optional[ValueResidual] = None
        self._first = True
        self.k_k = nn.Parameter(torch.empty(D))
        self.k_a = nn.Parameter(torch.empty(D))
        self.r_k = nn.Parameter(torch.empty(n_heads, self.head_dim))
        self.g_norm = nn.GroupNorm(n_heads, Dv, eps=self.head_dim * norm_eps)   # (eps scaled by the key width, as fla)
        self.short_conv = bool(short_conv)
        self.conv = (ShortConv(2 * D + Dv, _pos_int("conv_size", conv_size), activation=None) if self.short_conv
                     else None)
        if rope and self.head_dim % 2:
            raise ConfigError(f"RWKV7: rope needs an even head_dim, got {self.head_dim}")
        self.rope = RotaryEmbedding(self.head_dim, base=rope_base, max_seq_len=max_seq_len) if rope else None
        self._init_rwkv(layer_idx, n_layers)

    @torch.no_grad()
    def _init_rwkv(self, layer_idx: Optional[int], n_layers: Optional[int]) -> None:
        depth = 0.5 if layer_idx is None or not n_layers or n_layers < 2 else layer_idx / (n_layers - 1)
        ddd = torch.arange(self.d_model, dtype=torch.float32) / self.d_model
        for name, p in zip(_MIX, (0.2, 0.9, 0.7, 0.7, 0.9, 0.2)):   # RWKV-7's exponents for r, w, k, v, a, g
            getattr(self, name).copy_(1 - ddd ** (p * (1 - 0.9 * depth)))
        if self.v_lora is not None:
            self.v_lora.bias.fill_(1.0)                                   # v0 = 1: sigmoid ~ 0.73 towards v_first
        D = self.k_k.numel()
        n = torch.arange(D, dtype=torch.float32) / max(D - 1, 1)
        self.w_lora.bias.copy_(-6 + 8 * n ** (0.85 + depth ** 0.5))  # sigmoid(.): slow to fast decays
        self.k_k.fill_(0.85)
        self.k_a.fill_(1.0)
        self.r_k.zero_()

    def link_layers(self, shared: Optional[ValueResidual]) -> ValueResidual:
        """Join a model's value residual (module docstring).

        Args:
            shared: The holder of the previous RWKV-7 layer, or None: this layer becomes the first (it publishes its
                v and has no lora_v).

        Returns:
            The holder for the next RWKV-7 layer.
        """
        if shared is None:
            shared, self._first, self.v_lora = ValueResidual(), True, None
        else:
            self._first = False
        self._share = shared
        return shared

    def forward(self, x: torch.Tensor, cache: Optional[LayerCache] = None, *,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mix the tokens of x: the training path, prefill or decoding (as `AttentionBase.forward`).

        Args:
            x: The input `[B, T, d_model]` (`[1, T_total, d_model]` with cu_seqlens).
            cache: A `LayerCache` to decode incrementally (continued and updated in place), or None.
            cu_seqlens: int64 `[N+1]` offsets, to run N packed documents independently of each other.

        Returns:
            The output `[B, T, d_model]`, in x's dtype.
        """
        cu_seqlens = check_mixer_call("RWKV7", self.d_model, x, cache, cu_seqlens)
        Bsz, T, _ = x.shape
        H, Dh = self.n_heads, self.head_dim
        dx = _token_shift(x, cache, cu_seqlens)   # a document's first token sees zeros, as if alone
        xr, xw, xk, xv, xa, xg = (x + dx * getattr(self, name) for name in _MIX)
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        if self._share is not None and self._first:
            self._share.v = v
        elif self._share is not None and self.v_lora is not None and self._share.v is not None:
            v_first = self._share.v
            if v_first.shape != v.shape:
                raise LinattnError(f"RWKV7 (layer {self.layer_idx}): the first RWKV-7 layer's values have shape "
                                   f"{tuple(v_first.shape)}, this call's {tuple(v.shape)}; a linked layer runs "
                                   f"after the first one in the same model call")
            v = torch.lerp(v, v_first.to(v.dtype), torch.sigmoid(self.v_lora(xv)))
        if self.conv is not None:
            rkv, conv_state = self.conv(torch.cat([r, k, v], dim=-1),
                                        cache.conv.get("in") if cache is not None else None, cu_seqlens)
            if cache is not None:
                cache.conv["in"] = conv_state
            r, k, v = rkv.split([H * Dh, H * Dh, H * self.head_dim_v], dim=-1)
        w = -_W_SCALE * torch.sigmoid(self.w_lora(xw))
        a = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        kk = (k * self.k_k).view(Bsz, T, H, Dh)
        kk = F.normalize(kk, dim=-1) if self.kk_norm == "normalize" else l2norm(kk, "rsqrt")
        k = k * (1 + (a - 1) * self.k_a)

        def heads(t):
            return t.view(Bsz, T, H, Dh)

        r, w, k, a = (heads(t) for t in (r, w, k, a))
        Dv = self.head_dim_v
        v = v.view(Bsz, T, H, Dv)
        if self.rope is not None:
            if cu_seqlens is not None:
                r, k = self.rope(r, k, positions=packed_positions(cu_seqlens, T, x.device))
            else:
                r, k = self.rope(r, k, cache.offset if cache is not None else 0)
        # the operator in fp32 (fp64 for fp64 inputs): under autocast the projections are bf16 while the decay,
        # computed with fp32 biases, is fp32; the decay must not be rounded to bf16 either
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        o, state = rwkv7(r.to(cd), w.to(cd), k.to(cd), v.to(cd), (-kk).to(cd), (kk * a).to(cd), scale=self.scale,
                         mode="recurrent" if cache is not None and T == 1 else "chunk", chunk_size=self.chunk_size,
                         initial_state=cache.state if cache is not None else None,
                         output_final_state=cache is not None, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.state = state
            cache.offset = cache.offset + T
        o = self.g_norm(o.reshape(Bsz * T, H * Dv)).view(Bsz, T, H, Dv)
        o = o + (r * k * self.r_k).sum(-1, keepdim=True) * v          # the bonus: the current token, weight r.(k*u)
        return self.o_proj((o.reshape(Bsz, T, H * Dv) * g).to(x.dtype))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
                f"short_conv={self.short_conv}, rope={self.rope is not None}")


def _token_shift(x: torch.Tensor, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    """x_{t-1} - x_t (zero before a document's first token, or the cached last token of the previous call);
    stores x's last token in cache.shift."""
    Bsz, T, C = x.shape
    prev = cache.shift if cache is not None else None
    prev = x.new_zeros(Bsz, 1, C) if prev is None else prev.unsqueeze(1).to(x.dtype)
    shifted = torch.cat([prev, x[:, :-1]], dim=1)
    if cu_seqlens is not None:
        shifted = shifted.masked_fill((packed_positions(cu_seqlens, T, x.device) == 0)[None, :, None], 0.0)
    if cache is not None:
        cache.shift = x[:, -1].detach().clone()
    return shifted - x


class RWKV7ChannelMix(nn.Module):
    """RWKV-7's channel mixing, its feed-forward block (`LMConfig.ffn="rwkv7"`; fla's RWKV7FeedForward):

        out = value(relu(key(x + (x_{t-1} - x_t) * x_k))^2)

    x `[B, T, d_model]` -> `[B, T, d_model]`; hidden: key's width (fla: 4 d_model rounded up to 32). Its token
    shift looks one token back, so it takes a `LayerCache` ("shift": the last input token `[B, d_model]`) to
    decode and cu_seqlens to keep packed documents apart, as a mixer does."""

    def __init__(self, d_model: int, hidden: Optional[int] = None):
        super().__init__()
        d_model = _pos_int("d_model", d_model)
        hidden = _pos_int("hidden", hidden) if hidden is not None else 32 * ((4 * d_model + 31) // 32)
        self.d_model, self.hidden = d_model, hidden
        # RWKV-7's init of the mix: 1 - (i / C)^r per channel (r = 1 here: no layer depth at hand)
        self.x_k = nn.Parameter(1 - torch.arange(d_model, dtype=torch.float32) / d_model)
        self.key = nn.Linear(d_model, hidden, bias=False)
        self.value = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor, cache: Optional[LayerCache] = None, *,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        cu_seqlens = check_mixer_call("RWKV7ChannelMix", self.d_model, x, cache, cu_seqlens)
        dx = _token_shift(x, cache, cu_seqlens)
        return self.value(torch.relu(self.key(x + dx * self.x_k)).square())

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, hidden={self.hidden}"


register_mixer("rwkv7", RWKV7, {}, "RWKV-7 time mixing: token shift, low-rank w/a/g, S <- D S + b (a^T S) + k v^T, "
               "value residual, group norm, bonus")
