"""Mamba2's own block (the mixer `mamba2`), with the SSD recurrence computed by `linear_attention`.

    x -> in_proj -> z | xBC | dt
    xBC -> causal depthwise conv (SiLU) -> x [H, P] | B [G, N] | C [G, N]
    dt = clamp(softplus(dt + dt_bias), dt_limit), A = -exp(A_log)           (one value per head)
    y  = SSD(x, dt, A, B, C) + D x                                          (per head)
    out = out_proj(RMSNorm_grouped(y * silu(z)))                            (Mamba2's gated norm, gate before norm)

The SSD recurrence h_t = exp(dt_t A) h_{t-1} + (dt_t x_t) B_t^T, y_t = h_t C_t is scalar-gated linear attention
with q = C, k = B, v = dt * x and the log-gate g = dt * A: linattn's `linear_attention(feature_map=None,
normalize=False, scale=1)`. B and C have n_groups heads shared by the H value heads (head h reads group
h // (H / G), transformers' repeat_interleave), which is linear_attention's grouped value heads.

Names follow transformers' `Mamba2Mixer` (in_proj, conv, dt_bias, A_log, D, norm; out_proj is called o_proj, the
name linattn's model init scales), so `mamba2_state_dict_from_hf` maps a Mamba2Mixer's state dict by renaming.
In configs of mixer names version 1 the mixer `mamba2` was `LinearAttention` with a Mamba2-style gate; that layer
is now `mamba2-gla` (old configs are mapped, see `LMConfig.mixer_names`).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import LinattnError
from ..ops.linear import linear_attention
from .cache import LayerCache
from .common import GatedRMSNorm, RotaryEmbedding, ShortConv
from .packing import check_mixer_call, packed_positions
from .registry import register_mixer


def _pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise LinattnError(f"Mamba2Block: {name} must be a positive int, got {v!r}")
    return int(v)


class Mamba2Block(nn.Module):
    """Mamba2's mixer (module docstring). x `[B, T, d_model]` -> `[B, T, d_model]`.

    With a `LayerCache` it decodes incrementally (entries "conv": the conv window, "state": the
    `LinearAttentionState`, whose kv `[B, H, N, P]` is transformers' ssm state `[B, H, P, N]` transposed).

    Args:
        d_model: model width.
        n_heads: H, Mamba2's heads (value heads; `num_heads` in transformers).
        head_dim: P, the width of a head (default expand * d_model // n_heads); d_inner = H * P.
        expand: used only for the default head_dim (Mamba2's expand, default 2).
        state_size: N, the width of B and C per group (`state_size` / d_state).
        n_groups: G, the heads of B and C (H must be a multiple of G).
        conv_size: the short convolution's kernel (`conv_kernel`).
        conv_bias: the short convolution's bias (`use_conv_bias`).
        proj_bias: biases on in_proj and o_proj (`use_bias`).
        short_conv: False leaves the convolution out (SiLU stays); True is Mamba2.
        rope: rotary positions on C and B (q and k); not Mamba2, an option for ablations (N must be even).
        rope_base: the rotary embedding's base.
        max_seq_len: the rotary table's initial size (extended on demand).
        dt_min: the low end of the initial dt range (log-uniform) of dt_bias.
        dt_max: the high end of that range.
        dt_floor: the floor of the initial dt (the range is floored).
        dt_limit: dt's clamp.
        A_init_range: A = -exp(A_log) starts uniform in -range (mamba_ssm's (1, 16)).
        norm_eps: the gated RMSNorm's epsilon.
        chunk_size: linear_attention's chunk in training and prefill.
        layer_idx: the index of the layer in its model (set by the model that builds it).
        d_per_channel: D has one value per channel `[H * P]` instead of one per head (mamba_ssm's D_has_hdim).
        gated_norm: False replaces the gated RMSNorm by y * silu(z) (mamba_ssm's rmsnorm=False; no norm weight).
        norm_before_gate: the gated norm as RMSNorm(y) * silu(z) (mamba_ssm's norm_before_gate=True) instead of
            Mamba2's default RMSNorm(y * silu(z)).

    Raises:
        LinattnError: A bad size or option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import LayerCache, Mamba2Block
        >>> layer = Mamba2Block(64, 4, state_size=16).double()
        >>> x = torch.randn(2, 10, 64, dtype=torch.float64)
        >>> y = layer(x)
        >>> cache = LayerCache()                     # prefill 9 tokens, then decode the 10th
        >>> _ = layer(x[:, :9], cache)
        >>> torch.allclose(layer(x[:, 9:], cache), y[:, 9:])
        True
    """

    causal = True
    #: the q (= C) scale: the SSD reads the state with C as it is
    scale = 1.0
    #: forward takes cu_seqlens (packed documents) and keeps the documents apart (`Block` relies on it)
    supports_cu_seqlens = True
    #: a decoded token may run as the compiled block step (models/decode_plan.py, kind "mamba2"); False for either
    #: switch: the PyTorch path
    fast_decode = compiled_decode = True
    config_fields = ("head_dim", "rope", "rope_base", "short_conv", "max_seq_len", "norm_eps", "chunk_size",
                     "layer_idx")

    def __init__(self, d_model: int, n_heads: int, *, head_dim: Optional[int] = None, expand: int = 2,
                 state_size: int = 64, n_groups: int = 1, conv_size: int = 4, conv_bias: bool = True,
                 proj_bias: bool = False, short_conv: bool = True, rope: bool = False, rope_base: float = 10000.0,
                 max_seq_len: int = 2048, dt_min: float = 0.001, dt_max: float = 0.1, dt_floor: float = 1e-4,
                 dt_limit: Sequence[float] = (0.0, float("inf")), A_init_range: Sequence[float] = (1.0, 16.0),
                 norm_eps: float = 1e-5, chunk_size: int = 64, layer_idx: Optional[int] = None,
                 d_per_channel: bool = False, gated_norm: bool = True, norm_before_gate: bool = False):
        super().__init__()
        d_model, n_heads = _pos_int("d_model", d_model), _pos_int("n_heads", n_heads)
        if head_dim is None:
            if (_pos_int("expand", expand) * d_model) % n_heads:
                raise LinattnError(f"Mamba2Block: expand * d_model ({expand * d_model}) must be divisible by "
                                   f"n_heads ({n_heads}), or pass head_dim")
            head_dim = expand * d_model // n_heads
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, _pos_int("head_dim", head_dim)
        self.state_size, self.n_groups = _pos_int("state_size", state_size), _pos_int("n_groups", n_groups)
        if n_heads % n_groups:
            raise LinattnError(f"Mamba2Block: n_heads ({n_heads}) must be a multiple of n_groups ({n_groups}): "
                               f"head h reads the B/C group h // (n_heads / n_groups)")
        self.chunk_size = _pos_int("chunk_size", chunk_size)
        if len(dt_limit) != 2 or not dt_limit[0] <= dt_limit[1]:
            raise LinattnError(f"Mamba2Block: dt_limit must be (low, high) with low <= high, got {dt_limit!r}")
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.layer_idx = layer_idx
        H, P, G, N = n_heads, self.head_dim, n_groups, self.state_size
        self.d_inner = H * P
        self.conv_dim = self.d_inner + 2 * G * N
        self.in_proj = nn.Linear(d_model, self.d_inner + self.conv_dim + H, bias=proj_bias)
        self.short_conv = bool(short_conv)
        self.conv = ShortConv(self.conv_dim, _pos_int("conv_size", conv_size), activation="silu",
                              bias=conv_bias) if self.short_conv else None
        if rope and N % 2:
            raise LinattnError(f"Mamba2Block: rope needs an even state_size, got {N}")
        self.rope = RotaryEmbedding(N, base=rope_base, max_seq_len=max_seq_len) if rope else None
        self.dt_bias = nn.Parameter(torch.empty(H))
        self.A_log = nn.Parameter(torch.empty(H))
        self.d_per_channel = bool(d_per_channel)
        self.D = nn.Parameter(torch.empty(H * P if self.d_per_channel else H))
        # Mamba2's MambaRMSNormGated: y * silu(z) first, then the RMS over each group's d_inner / G channels
        self.norm = GatedRMSNorm(self.d_inner, eps=norm_eps, gate_before_norm=not norm_before_gate,
                                 group_size=self.d_inner // G) if gated_norm else None
        self.o_proj = nn.Linear(self.d_inner, d_model, bias=proj_bias)
        self._init_ssm(dt_min, dt_max, dt_floor, A_init_range)

    @torch.no_grad()
    def _init_ssm(self, dt_min: float, dt_max: float, dt_floor: float, A_init_range: Sequence[float]) -> None:
        """mamba_ssm's init: dt log-uniform in [dt_min, dt_max] (floored), stored as softplus^-1 in dt_bias;
        A uniform in A_init_range; D = 1."""
        if not 0 < dt_min <= dt_max or not 0 < A_init_range[0] <= A_init_range[1]:
            raise LinattnError(f"Mamba2Block: need 0 < dt_min <= dt_max and 0 < A_init_range[0] <= A_init_range[1], "
                               f"got dt {dt_min}, {dt_max}, A_init_range {A_init_range}")
        H = self.n_heads
        dt = torch.exp(torch.rand(H) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=dt_floor)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.A_log.copy_(torch.log(torch.empty(H).uniform_(*A_init_range)))
        self.D.fill_(1.0)

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
        cu_seqlens = check_mixer_call("Mamba2Block", self.d_model, x, cache, cu_seqlens)
        Bsz, T, _ = x.shape
        H, P, G, N = self.n_heads, self.head_dim, self.n_groups, self.state_size
        z, xbc, dt = self.in_proj(x).split([self.d_inner, self.conv_dim, H], dim=-1)
        if self.conv is not None:
            xbc, conv_state = self.conv(xbc, cache.conv.get("in") if cache is not None else None, cu_seqlens)
            if cache is not None:
                cache.conv["in"] = conv_state
        else:
            xbc = F.silu(xbc)
        xs, b, c = xbc.split([self.d_inner, G * N, G * N], dim=-1)
        b, c = b.view(Bsz, T, G, N), c.view(Bsz, T, G, N)
        if self.rope is not None:
            if cu_seqlens is not None:
                c, b = self.rope(c, b, positions=packed_positions(cu_seqlens, T, x.device))
            else:
                c, b = self.rope(c, b, cache.offset if cache is not None else 0)
        # dt, A and the SSD in fp32 (fp64 for fp64 inputs), as Mamba2's kernels do
        cd = torch.float64 if x.dtype == torch.float64 else torch.float32
        dt = F.softplus(dt.to(cd) + self.dt_bias.to(cd)).clamp(self.dt_limit[0], self.dt_limit[1])   # [B, T, H]
        a = -torch.exp(self.A_log.to(cd))                                                             # [H]
        xs = xs.reshape(Bsz, T, H, P).to(cd)
        y, state = linear_attention(c.to(cd), b.to(cd), xs * dt[..., None], feature_map=None, normalize=False,
                                    g=dt * a, scale=1.0, mode="recurrent" if cache is not None and T == 1 else "chunk",
                                    chunk_size=self.chunk_size,
                                    initial_state=cache.state if cache is not None else None,
                                    output_final_state=cache is not None, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.state = state
            cache.offset = cache.offset + T
        y = y + self.D.to(cd).view(H, -1) * xs                          # D per head [H, 1] or per channel [H, P]
        y = y.reshape(Bsz, T, self.d_inner)
        y = self.norm(y, z.to(cd)) if self.norm is not None else y * F.silu(z.to(cd))
        return self.o_proj(y.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
                f"state_size={self.state_size}, n_groups={self.n_groups}, short_conv={self.short_conv}, "
                f"rope={self.rope is not None}")


#: transformers' Mamba2Mixer parameter name -> Mamba2Block's
HF_NAMES = {"in_proj.weight": "in_proj.weight", "in_proj.bias": "in_proj.bias", "conv1d.weight": "conv.weight",
            "conv1d.bias": "conv.bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D",
            "norm.weight": "norm.weight", "out_proj.weight": "o_proj.weight", "out_proj.bias": "o_proj.bias"}


def mamba2_state_dict_from_hf(state_dict: Dict[str, torch.Tensor], prefix: str = "") -> Dict[str, torch.Tensor]:
    """A transformers `Mamba2Mixer`'s state dict (keys under `prefix`, e.g. "backbone.layers.0.mixer.") as a
    `Mamba2Block`'s, by renaming (`HF_NAMES`); the tensors are the same. A key under prefix that is not a
    Mamba2Mixer parameter raises LinattnError, naming it."""
    out = {}
    for key, value in state_dict.items():
        if not key.startswith(prefix):
            continue
        name = key[len(prefix):]
        if name not in HF_NAMES:
            raise LinattnError(f"mamba2_state_dict_from_hf: {key!r} is not a Mamba2Mixer parameter; expected "
                               f"{prefix}<one of {sorted(HF_NAMES)}>")
        out[HF_NAMES[name]] = value
    if not out:
        raise LinattnError(f"mamba2_state_dict_from_hf: no key starts with prefix {prefix!r}")
    return out


def mamba2_block_kwargs_from_hf(config) -> Dict[str, object]:
    """`Mamba2Block` keyword arguments (besides d_model and n_heads) for a transformers `Mamba2Config`."""
    return dict(head_dim=config.head_dim, state_size=config.state_size, n_groups=config.n_groups,
                conv_size=config.conv_kernel, conv_bias=config.use_conv_bias, proj_bias=config.use_bias,
                dt_limit=tuple(config.time_step_limit), norm_eps=config.layer_norm_epsilon,
                chunk_size=config.chunk_size)


# listed between mamba2-gla and gla (layers/linear_attention.py), beside the other Mamba2-style mixer
register_mixer("mamba2", Mamba2Block, {}, "Mamba2's block: in_proj, conv, SSD (grouped scalar-gated linear "
               "attention), D skip, grouped gated RMSNorm, out_proj", short_conv=True, before="gla")


__all__ = ["Mamba2Block", "HF_NAMES", "mamba2_state_dict_from_hf", "mamba2_block_kwargs_from_hf"]
