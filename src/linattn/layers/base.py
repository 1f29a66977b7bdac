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

Single-token decoding fast path: a layer that implements `_fast_step` (`LinearAttention`,
`DeltaNet`, `GatedDeltaNet`, `EFLA`) decodes one token on the CPU without autograd (grad disabled,
a `LayerCache`, T == 1, fp32/fp64, no cu_seqlens) by a dedicated recurrent step: the q/k/v (and
gate / beta) projections as one matrix-vector product over a cached concatenation of their weights
(`FusedParams`, rebuilt when a weight changes), the three short convolutions as one, no dtype
round trips, and the same values and cache entries as the general path (tests/test_decode_fast.py).
Anything else (training, prefill, other devices or dtypes) takes the general path.

Config fields: `config_fields` names the model-config fields (`LMConfig`) a mixer takes as
keyword arguments of the same name; a model block passes exactly those (a field set to None
is left out, so the layer's or the registry entry's default applies), plus `layer_idx` when it
is listed. A subclass extends its parent's tuple with the fields it adds.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cpu import decode as _cpu_decode
from ..errors import LinattnError, LinattnTypeError
from .cache import LayerCache
from .common import GATE_ACTIVATIONS, FusedParams, GatedRMSNorm, RotaryEmbedding, ShortConv, gate_activation
from .packing import check_mixer_call, packed_positions

# forward hooks registered for every module (nn.modules.module.register_module_forward_hook / _pre_hook):
# the fast decoding step does not call the submodules, so it steps aside while any is registered
_GLOBAL_HOOKS = (getattr(nn.modules.module, "_global_forward_hooks", {}),
                 getattr(nn.modules.module, "_global_forward_pre_hooks", {}))


def hooked(*modules: Optional[nn.Module]) -> bool:
    """Whether a forward hook is registered globally or on one of `modules`: the fast decoding steps
    compute these modules' forward themselves, so they step aside for any hook."""
    return bool(_GLOBAL_HOOKS[0] or _GLOBAL_HOOKS[1]) or any(
        m is not None and bool(m._forward_hooks or m._forward_pre_hooks) for m in modules)


class AttentionBase(nn.Module):
    """Projections, short convolution, RoPE and output norm/gate shared by all mixers.

    Args:
        d_model: model width.
        n_heads: number of heads.
        head_dim: key/query width per head (default d_model // n_heads).
        head_dim_v: value width per head (default head_dim).
        short_conv: causal depthwise convolution (kernel `conv_size`, SiLU) on q, k and v.
        rope: rotary position embedding on q and k (before any feature map).
        output_norm: per-head RMSNorm on the operator output.
        output_gate: multiply the (normed) output by act(g_proj(x)).
        qkv_bias: biases on the q/k/v projections.
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
    """

    #: whether the mixer looks only at earlier tokens
    causal = True
    #: single-token decoding may take the fast path (module docstring); False: always the general path
    fast_decode = True
    #: the fast step may run as one compiled call (cpu/decode.py) where it covers the layer; False: the PyTorch
    #: fast step (bench decode --decode-step both compares them); LINATTN_CPU_KERNELS=0 turns it off everywhere
    compiled_decode = True
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
        # single-token decoding (module docstring): concatenated projection / conv weights, not parameters
        self._fused = FusedParams()

    # -- pieces ------------------------------------------------------------------------------
    def _qkv(self, x: torch.Tensor, cache: Optional[LayerCache],
             cu_seqlens: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, ...]:
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.short_conv:
            get = (lambda n: cache.get(n)) if cache is not None else (lambda n: None)
            q, sq = self.q_conv(q, get("conv_q"), cu_seqlens)
            k, sk = self.k_conv(k, get("conv_k"), cu_seqlens)
            v, sv = self.v_conv(v, get("conv_v"), cu_seqlens)
            if cache is not None:
                cache["conv_q"], cache["conv_k"], cache["conv_v"] = sq, sk, sv
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_heads, self.head_dim)
        v = v.view(B, T, self.n_value_heads, self.head_dim_v)
        if self.rope is not None:
            if cu_seqlens is not None:
                q, k = self.rope(q, k, positions=packed_positions(cu_seqlens, T, x.device))
            else:
                q, k = self.rope(q, k, cache.offset if cache is not None else 0)
        return q, k, v

    def _out(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        HV, Dv = self.n_value_heads, self.head_dim_v
        if self.o_norm is not None:
            gate = None
            if self.g_proj is not None:
                gate = self.g_proj(x).view(B, T, HV, Dv)
            if self.norm_group_size is not None:   # the norm spans the heads (Mamba2's groups)
                o = self.o_norm(o.reshape(B, T, HV * Dv), None if gate is None else gate.reshape(B, T, HV * Dv))
            else:
                o = self.o_norm(o, gate)
        elif self.g_proj is not None:
            o = o * gate_activation(self.gate_act, self.g_proj(x).view(B, T, HV, Dv))
        return self.o_proj(o.reshape(B, T, HV * Dv))

    # -- single-token decoding fast path (module docstring) --------------------------------------
    def _fast_step(self, x: torch.Tensor, cache: LayerCache, lins) -> Optional[torch.Tensor]:
        """One decoded token x `[B, 1, d_model]` -> `[B, 1, d_model]`, or None to take the general path
        (which must then find the cache untouched); lins: the projections `_fast_ok` returned.
        Subclasses that implement it give the general path's values."""
        return None

    def _fast_supported(self) -> bool:
        """Whether this layer has a fast step (subclasses that implement `_fast_step` say when)."""
        return False

    def _fast_extra(self) -> Tuple[nn.Module, ...]:
        """The projections of x, besides q, k, v, that the fast step takes from the fused product."""
        return ()

    def _fast_project(self, x: torch.Tensor, cache: LayerCache, lins):
        """q and k as one `[B, 2H, 1, K]` (q's heads, then k's), v `[B, H, 1, V]` (after the short convolution
        and RoPE) and the outputs of the projections after q, k, v in lins `[B, n_i]`, for one token
        x `[B, 1, d_model]`; updates the conv states in cache."""
        B = x.shape[0]
        H, HV, Dk, Dv = self.n_heads, self.n_value_heads, self.head_dim, self.head_dim_v
        convs, y, cw, cb = self._fast_fused(x, lins)
        nq, nv = H * Dk, HV * Dv
        if convs:
            parts = y.split([2 * nq + nv] + [m.out_features for m in lins[3:]], dim=1)
            qk, v = self._fast_conv(parts[0], cache, convs, cw, cb).split([2 * nq, nv], dim=1)
            extra = parts[1:]
        else:
            qk, v, *extra = y.split([2 * nq, nv] + [m.out_features for m in lins[3:]], dim=1)
        if self.rope is not None:   # the same rotation for q and k
            qk = self.rope.apply(qk.view(B, 1, 2 * H, Dk), cache.offset)
        return qk.view(B, 2 * H, 1, Dk), v.view(B, HV, 1, Dv), extra

    def _fast_fused(self, x: torch.Tensor, lins):
        """(convs, y, cw, cb): the short convolutions (or ()), the fused projection y `[B, sum of widths]` of
        one token x `[B, 1, d_model]`, and the convolutions' fused weights `[C, 1, K]` and biases (or None)."""
        mods = self._modules
        convs = (mods["q_conv"], mods["k_conv"], mods["v_conv"]) if self.short_conv else ()
        w, b, cw, cb = self._fused.get([m.weight for m in lins],
                                       [m.bias if m.bias is not None else m.out_features for m in lins]
                                       if any(m.bias is not None for m in lins) else [],
                                       [c.weight for c in convs], [c.bias for c in convs if c.bias is not None])
        return convs, F.linear(x.reshape(x.shape[0], -1), w, b), cw, cb

    @staticmethod
    def _fast_window(cache: LayerCache, B: int, C: int, K: int, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The q | k | v conv windows as one contiguous `[B, C, K - 1]` (None before the first token)."""
        old = (cache.get("conv_q"), cache.get("conv_k"), cache.get("conv_v"))
        fast = cache.__dict__.get("_fast_conv")
        if fast is not None and fast[0] is old[0] and fast[1] is old[1] and fast[2] is old[2]:
            return fast[3]
        if old[0] is None:
            return None
        return torch.cat([s.to(dtype) for s in old], dim=1)

    @staticmethod
    def _fast_store_window(cache: LayerCache, convs, new: torch.Tensor) -> None:
        """conv_q/k/v in cache as views of the new window `[B, C, K - 1]` (kept whole for the next step)."""
        sq, sk, sv = new.split([convs[0].dim, convs[1].dim, convs[2].dim], dim=1)
        cache["conv_q"], cache["conv_k"], cache["conv_v"] = sq, sk, sv
        cache.__dict__["_fast_conv"] = (sq, sk, sv, new)

    @classmethod
    def _fast_conv(cls, u: torch.Tensor, cache: LayerCache, convs, w: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
        """The q, k and v short convolutions of one token as one: u `[B, C]` (q | k | v before the
        convolution), w their weights `[C, 1, K]` -> `[B, C]`; the states conv_q/k/v in cache are
        views of one `[B, C, K]` window."""
        K, C = convs[0].kernel_size, u.shape[1]
        state = cls._fast_window(cache, u.shape[0], C, K, u.dtype)
        if state is None:
            state = u.new_zeros(u.shape[0], C, K - 1)
        xp = torch.cat([state, u.unsqueeze(-1)], dim=-1)                      # [B, C, K]
        y = (xp * w.view(C, K)).sum(-1)
        if bias is not None:
            y = y + bias
        if convs[0].activation is not None:
            y = F.silu(y)
        cls._fast_store_window(cache, convs, xp[..., 1:])
        return y

    def _fast_compiled(self, x: torch.Tensor, cache: LayerCache, lins):
        """For the fused compiled step (cpu/decode.py): (y, conv, heads) or None when it does not apply
        (switched off or not buildable, RoPE); the layer's step then runs the PyTorch form. y: the fused
        projection `[B, sum of widths]`; conv: (window in, weights [C, K], bias, silu) or None without a short
        convolution; heads: (H, HV, K, V)."""
        if not self.compiled_decode or self.rope is not None or not _cpu_decode.available():
            return None
        convs, y, cw, cb = self._fast_fused(x, lins)
        heads = (self.n_heads, self.n_value_heads, self.head_dim, self.head_dim_v)
        conv = None
        if convs:
            C, KC = cw.shape[0], convs[0].kernel_size
            conv = (self._fast_window(cache, y.shape[0], C, KC, y.dtype), cw.view(C, KC), cb,
                    convs[0].activation is not None)
            if conv[0] is not None and not conv[0].is_contiguous():
                conv = (conv[0].contiguous(),) + conv[1:]
        return y, conv, heads

    def _fast_compiled_out(self, cache: LayerCache, o: torch.Tensor, window: Optional[torch.Tensor]) -> torch.Tensor:
        """Stores the compiled step's new conv window and applies o_proj to its output o `[B, HV * V]`."""
        if window is not None:
            mods = self._modules
            self._fast_store_window(cache, (mods["q_conv"], mods["k_conv"], mods["v_conv"]), window)
        return F.linear(o.view(o.shape[0], 1, -1), self._modules["o_proj"].weight)

    def _fast_norm_args(self, dtype: torch.dtype):
        """(has_norm, weight or None, eps) of the output RMSNorm as `_fast_out` applies it, for the compiled step."""
        norm = self._modules.get("o_norm")
        if norm is None:
            return False, None, 0.0
        eps = norm.eps if norm.eps is not None else torch.finfo(dtype).eps
        w = norm.weight
        if w is not None and (w.dtype != dtype or not w.is_contiguous()):
            w = w.detach().to(dtype).contiguous()
        return True, w, float(eps)

    def _fast_out(self, o: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        """`_out` for one token: o `[B, H, 1, V]`, gate the g_proj output `[B, H * V]` or None -> `[B, 1, d_model]`."""
        B, H, _, Dv = o.shape
        norm = self._modules.get("o_norm")
        if norm is not None:
            o = F.rms_norm(o, (Dv,), norm.weight, norm.eps)
        if gate is not None:
            o = o * F.silu(gate.view(B, H, 1, Dv))
        return F.linear(o.reshape(B, 1, H * Dv), self._modules["o_proj"].weight)

    def _fast_ok(self, x: torch.Tensor, cache: Optional[LayerCache], cu_seqlens):
        """Whether this call may take the fast path (module docstring): a one-token decoding call
        without autograd on the CPU in fp32/fp64, and submodules that are exactly the library's
        (nn.Linear, ShortConv, GatedRMSNorm: no adapter replaced them) without hooks, since the fast
        step computes their forward itself. Returns the fused projections (q, k, v, then
        `_fast_extra()`), or None."""
        if not (self.fast_decode and cache is not None and cu_seqlens is None and x.shape[1] == 1
                and x.device.type == "cpu" and not torch.is_grad_enabled()
                and x.dtype in (torch.float32, torch.float64) and self._fast_supported()):
            return None
        if self.gate_act != "silu" or self.norm_group_size is not None:
            return None   # the fast step computes the default gated norm only
        mods = self._modules
        lins = (mods["q_proj"], mods["k_proj"], mods["v_proj"]) + self._fast_extra()
        for m in lins + (mods["o_proj"],):
            if type(m) is not nn.Linear or m.weight.dtype != x.dtype:
                return None
        norm = mods.get("o_norm")
        if (norm is not None and (type(norm) is not GatedRMSNorm or not norm.plain)) \
                or hooked(*lins, mods["o_proj"], norm):
            return None
        if self.short_conv:
            c0, c1, c2 = mods["q_conv"], mods["k_conv"], mods["v_conv"]
            for c in (c0, c1, c2):
                if (type(c) is not ShortConv or hooked(c)
                        or c.kernel_size != c0.kernel_size or c.activation != c0.activation
                        or (c._parameters.get("bias") is None) != (c0._parameters.get("bias") is None)):
                    return None
            if c0._parameters["weight"].dtype != x.dtype:
                return None
        return lins

    @staticmethod
    def _mode(cache: Optional[LayerCache], T: int) -> str:
        return "recurrent" if cache is not None and T == 1 else "chunk"

    @staticmethod
    def resolve_scale(scale: Optional[float], head_dim: int) -> float:
        """The q scale as a number: None means head_dim**-0.5 (the default of every layer)."""
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
        """x `[B, T, d_model]` -> `[B, T, d_model]`. Pass a `LayerCache` to decode incrementally,
        or `cu_seqlens` (int64 `[N+1]`, x `[1, T_total, d_model]`) to run packed documents
        independently of each other (module docstring)."""
        cu_seqlens = check_mixer_call(type(self).__name__, self.d_model, x, cache, cu_seqlens)
        lins = self._fast_ok(x, cache, cu_seqlens)
        if lins is not None:
            out = self._fast_step(x, cache, lins)
            if out is not None:
                cache["offset"] = cache.offset + 1
                return out
        q, k, v = self._qkv(x, cache, cu_seqlens)
        o = self._mix(q, k, v, x, cache, cu_seqlens=cu_seqlens)
        if cache is not None:
            cache["offset"] = cache.offset + x.shape[1]
        return self._out(o, x)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, head_dim={self.head_dim}, "
                + (f"n_value_heads={self.n_value_heads}, " if self.n_value_heads != self.n_heads else "")
                + f"short_conv={self.short_conv}, rope={self.rope is not None}")
