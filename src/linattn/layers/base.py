"""The shared skeleton of every attention layer (FLA's layer pattern).

    x -> q/k/v projections -> [short causal conv] -> [RoPE] -> operator -> [per-head norm, output gate] -> o_proj

Subclasses implement `_mix(q, k, v, x, cache, cu_seqlens)`. A layer called with `cache=None` runs
the training path (chunk form, no state kept). Called with a `LayerCache`, it continues from the
state stored there and writes the new state back: prefill (many tokens) uses the chunk form with
`output_final_state=True`, single-token decoding the recurrent form.

Called with `cu_seqlens` (int64 `[N+1]`, input `[1, T_total, d_model]`), the layer runs N packed
documents as if each were alone: the short convolution's look-back is zeroed at each document
start, RoPE positions restart at 0, and `_mix` hands `cu_seqlens` to the operator, whose state
restarts at every document (softmax attention becomes block-diagonal causal).

Single-token decoding fast path (`fast_decode.py`): `forward` first offers a call to `fast_decode.step`, which
decodes one token on the CPU without autograd for the layers whose `fast_step_kind()` names a step
(`LinearAttention`, `DeltaNet`, `GatedDeltaNet`, `EFLA`), with the general path's values and cache entries;
anything else (training, prefill, other devices or dtypes) takes the general path.

Config fields: `config_fields` names the model-config fields (`LMConfig`) a mixer takes as
keyword arguments of the same name; a model block passes exactly those (a field set to None
is left out, so the layer's or the registry entry's default applies), plus `layer_idx` when it
is listed. A subclass extends its parent's tuple with the fields it adds.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn

from ..cpu import gatednorm as _cpu_gnorm
from ..errors import LinattnError, LinattnTypeError
from . import fast_decode as _fast
from .cache import LayerCache
from .common import GATE_ACTIVATIONS, FusedParams, GatedRMSNorm, RotaryEmbedding, ShortConv, gate_activation
from .fast_decode import hooked
from .grouped_kv import grouped_qkv
from .packing import check_mixer_call

__all__ = ["AttentionBase", "hooked"]


class AttentionBase(nn.Module):
    """Projections, short convolution, RoPE and output norm/gate shared by all mixers.

    A mixer maps x `[B, T, d_model]` to `[B, T, d_model]` (module docstring); subclasses implement `_mix`.

    Args:
        d_model: model width.
        n_heads: number of heads.
        head_dim: key/query width per head (default d_model // n_heads).
        head_dim_v: value width per head (default head_dim).
        short_conv: causal depthwise convolution (kernel `conv_size`, SiLU) on q, k and v.
        conv_size: the short convolution's kernel length.
        rope: rotary position embedding on q and k (before any feature map).
        rope_base: the rotary embedding's base.
        max_seq_len: the rotary table's initial size (extended on demand).
        output_norm: per-head RMSNorm on the operator output.
        output_gate: multiply the (normed) output by act(g_proj(x)).
        qkv_bias: biases on the q/k/v projections.
        norm_eps: the output norm's epsilon.
        layer_idx: the index of the layer in its model (set by the model that builds it).
        n_value_heads: HV, the value heads (default n_heads): grouped value heads (Qwen3-Next's GVA, Mamba2's
            groups) with HV = n * n_heads; value head j reads q/k head j // n. v_proj, the output gate and
            norm, o_proj (and the layers' beta and decays) are per value head. Layers that support it list
            "n_value_heads" in their `config_fields` (linear attention and the delta rule's DeltaNet, Gated
            DeltaNet, EFLA and KDA).
        gate_act: the output gate's activation, "silu" (default) or "sigmoid" (Kimi Linear).
        gate_before_norm: False (default) norm(o) * act(gate) (FLA, Kimi); True norm(o * act(gate)) (Mamba2).
        norm_group_size: None (default) the norm is per head (over head_dim_v, one weight [head_dim_v] shared
            by the heads, FLA's); an int normalises the whole output [HV * head_dim_v] in groups of that many
            channels with one weight per channel (Mamba2's MambaRMSNormGated, group = width / n_groups).

    Raises:
        LinattnError: A bad size or option (the message names it).
    """

    #: whether the mixer looks only at earlier tokens
    causal = True
    #: single-token decoding may take the fast path (module docstring); False: always the general path
    fast_decode = True
    #: the fast step may run as one compiled call (cpu/decode.py) where it covers the layer; False: the PyTorch
    #: fast step (bench decode --decode-step both compares them); LINATTN_CPU_KERNELS=0 turns it off everywhere
    compiled_decode = True
    #: forward takes cu_seqlens (packed documents) and keeps the documents apart (`Block` relies on it)
    supports_cu_seqlens = True
    #: the model-config fields this layer takes (same names as its keyword arguments), plus the
    #: block's "layer_idx"; subclasses extend it with their own (module docstring)
    config_fields: Tuple[str, ...] = ("head_dim", "rope", "rope_base", "short_conv", "max_seq_len", "norm_eps",
                                      "layer_idx")

    def __init__(self, d_model: int, n_heads: int, *, head_dim: Optional[int] = None,
                 head_dim_v: Optional[int] = None, short_conv: bool = False, conv_size: int = 4,
                 rope: bool = False, rope_base: float = 10000.0, max_seq_len: int = 2048,
                 output_norm: bool = True, output_gate: bool = False, qkv_bias: bool = False,
                 norm_eps: float = 1e-6, layer_idx: Optional[int] = None, n_value_heads: Optional[int] = None,
                 gate_act: str = "silu", gate_before_norm: bool = False, norm_group_size: Optional[int] = None):
        super().__init__()
        if d_model < 1 or n_heads < 1:
            raise LinattnError(f"d_model and n_heads must be positive, got {d_model}, {n_heads}")
        if head_dim is None:
            if d_model % n_heads:
                raise LinattnError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads}), "
                                 f"or pass head_dim explicitly")
            head_dim = d_model // n_heads
        self.d_model, self.n_heads = int(d_model), int(n_heads)
        if n_value_heads is None:
            n_value_heads = self.n_heads
        if (isinstance(n_value_heads, bool) or not isinstance(n_value_heads, int) or n_value_heads < 1
                or n_value_heads % self.n_heads):
            raise LinattnError(f"n_value_heads must be a positive multiple of n_heads ({self.n_heads}): value head "
                               f"j reads q/k head j // (n_value_heads / n_heads); got {n_value_heads!r}")
        if gate_act not in GATE_ACTIVATIONS:
            raise LinattnError(f"gate_act must be one of {GATE_ACTIVATIONS}, got {gate_act!r}")
        self.n_value_heads = int(n_value_heads)
        self.head_dim = int(head_dim)
        self.head_dim_v = int(head_dim_v) if head_dim_v is not None else self.head_dim
        self.layer_idx = layer_idx
        H, HV, Dk, Dv = self.n_heads, self.n_value_heads, self.head_dim, self.head_dim_v
        self.q_proj = nn.Linear(d_model, H * Dk, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, H * Dk, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, HV * Dv, bias=qkv_bias)
        self.o_proj = nn.Linear(HV * Dv, d_model, bias=False)
        self.short_conv = bool(short_conv)
        if self.short_conv:
            self.q_conv = ShortConv(H * Dk, conv_size)
            self.k_conv = ShortConv(H * Dk, conv_size)
            self.v_conv = ShortConv(HV * Dv, conv_size)
        self.rope = RotaryEmbedding(Dk, base=rope_base, max_seq_len=max_seq_len) if rope else None
        self.gate_act = gate_act
        self.norm_group_size = norm_group_size
        self.o_norm = None
        if output_norm:
            # per head (one weight [Dv] shared by the heads), or grouped over the whole output width (Mamba2)
            self.o_norm = GatedRMSNorm(Dv if norm_group_size is None else HV * Dv, eps=norm_eps, gate_act=gate_act,
                                       gate_before_norm=gate_before_norm, group_size=norm_group_size)
        self.g_proj = nn.Linear(d_model, HV * Dv, bias=False) if output_gate else None
        # single-token decoding (fast_decode.py): concatenated projection / conv weights, not parameters
        self._fused = FusedParams()

    # -- pieces ------------------------------------------------------------------------------
    def _qkv(self, x: torch.Tensor, cache: Optional[LayerCache],
             cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ...]:
        return grouped_qkv(self, x, cache, cu_seqlens, self.n_heads, v_heads=self.n_value_heads)

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        HV, Dv = self.n_value_heads, self.head_dim_v
        if self.o_norm is not None:
            gate = None
            if self.g_proj is not None:
                gate = self.g_proj(x).view(B, T, HV, Dv)
            if self.norm_group_size is not None:   # the norm spans the heads (Mamba2's groups)
                o = self.o_norm(o.reshape(B, T, HV * Dv), None if gate is None else gate.reshape(B, T, HV * Dv))
            else:   # on the compiled kernel when it covers the call (cpu/gatednorm.py), else o_norm itself
                o = _cpu_gnorm.gated_rms_norm(self.o_norm, o, gate)
        elif self.g_proj is not None:
            o = o * gate_activation(self.gate_act, self.g_proj(x).view(B, T, HV, Dv))
        return self.o_proj(o.reshape(B, T, HV * Dv))

    # -- single-token decoding fast path (fast_decode.py) ------------------------------------------
    def fast_step_kind(self) -> Optional[str]:
        """The name of this layer's single-token step in `fast_decode.STEPS` ("delta", "linear"), or None (the
        general path decodes). Subclasses that change the operator or its inputs must return None."""
        return None

    @staticmethod
    def _mode(cache: Optional[LayerCache], T: int) -> str:
        return "recurrent" if cache is not None and T == 1 else "chunk"

    @staticmethod
    def resolve_scale(scale: Optional[float], head_dim: int) -> float:
        """The q scale as a number: None means head_dim**-0.5 (the default of every layer).

        Args:
            scale: A number, or None.
            head_dim: The head width.

        Returns:
            The scale.

        Raises:
            LinattnTypeError: scale is neither a number nor None.
        """
        if scale is None:
            return head_dim ** -0.5
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise LinattnTypeError(f"scale must be a number or None (None: head_dim**-0.5), got {scale!r}")
        return float(scale)

    # -- interface ---------------------------------------------------------------------------
    def _mix(self, q, k, v, x, cache: Optional[LayerCache],
             cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:  # pragma: no cover
        """The operator: q, k `[B, T, H, K]`, v `[B, T, H, V]` -> o `[B, T, H, V]`; x is the layer
        input (for data-dependent gates); cache as in `forward`; cu_seqlens goes to the operator."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor, cache: Optional[LayerCache] = None, *,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mix the tokens of x: the training path, prefill or decoding (module docstring).

        Args:
            x: The input `[B, T, d_model]` (`[1, T_total, d_model]` with cu_seqlens).
            cache: A `LayerCache` to decode incrementally: the call continues from the state stored there and
                writes the new state back (prefill with many tokens, decoding with one). None: the training path,
                no state kept.
            cu_seqlens: int64 `[N+1]` offsets, to run N packed documents independently of each other.

        Returns:
            The output `[B, T, d_model]`, in x's dtype.
        """
        cu_seqlens = check_mixer_call(type(self).__name__, self.d_model, x, cache, cu_seqlens)
        out = _fast.step(self, x, cache, cu_seqlens)
        if out is not None:
            return out
        q, k, v = self._qkv(x, cache, cu_seqlens)
        o = self._mix(q, k, v, x, cache, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache.offset = cache.offset + x.shape[1]
        return self._out(o, x)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
                + (f"n_value_heads={self.n_value_heads}, " if self.n_value_heads != self.n_heads else "")
                + f"short_conv={self.short_conv}, rope={self.rope is not None}")
