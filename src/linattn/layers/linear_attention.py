"""`LinearAttention`: the kernelized linear attention layer, with every feature map and gate of
`linattn.linear_attention`.

Gates (all causal, log-space decays <= 0):

* `None`        no decay;
* `"retnet"`    a fixed decay per head, gamma_h = 1 - 2^(-5-h) (RetNet);
* `"scalar"`    a data-dependent decay per head and token (Mamba2 / simple GLA):
                g = -exp(A_log) * softplus(a_proj(x) + dt_bias);
* `"diagonal"`  a data-dependent decay per feature (GLA): g = logsigmoid(gk_proj(x)) / 16, with a
                low-rank (16) gk_proj producing one value per head and feature of phi.

With n_value_heads = HV (grouped value heads, a multiple of n_heads; Mamba2's heads over its n_groups of
B/C) every gate is per value head (retnet: gamma_j for j < HV).
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cpu import decode as _cpu_decode
from ..errors import LinattnError
from ..feature_maps import CosFormer, EluPlusOne, FAVORPlus, FeatureMap, Identity, ReLU, get_feature_map
from ..ops import LinearAttentionState, linear_attention
from .base import AttentionBase, hooked
from .cache import LayerCache
from .common import mamba_log_decay, mamba_neg_a

GATES = (None, "retnet", "scalar", "diagonal")
# feature maps of the fast decoding step that act elementwise (one call on q and k together) and are >= 0
_ELEMENTWISE_MAPS = (Identity, EluPlusOne, ReLU)
_NONNEGATIVE_MAPS = (EluPlusOne, ReLU)
_COMPILED_MAPS = (Identity, EluPlusOne, ReLU)   # exactly these classes: the fused compiled step computes them


def _feature_dim(fmap: FeatureMap, head_dim: int) -> int:
    """K_phi of a feature map, found by applying it to a dummy input."""
    x = torch.zeros(1, 1, 1, head_dim)
    pos = torch.zeros(1, 1, dtype=torch.long)
    return int(fmap.phi(x, pos).shape[-1])


def init_mamba_decay(n_heads: int, A_range=(1.0, 16.0), dt_min: float = 1e-3, dt_max: float = 0.1):
    """Mamba2's initialisation: A ~ U(A_range) (stored as log A), dt ~ logU(dt_min, dt_max)
    (stored through the inverse softplus as dt_bias)."""
    A = torch.empty(n_heads).uniform_(*A_range)
    dt = torch.exp(torch.rand(n_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=1e-4)
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse of softplus
    return torch.log(A), dt_bias


class LinearAttention(AttentionBase):
    """Multi-head kernelized linear attention layer.

    Args (besides those of `AttentionBase`: head_dim, short_conv, rope, output_norm, output_gate...):
        feature_map: a name from `linattn.FEATURE_MAP_NAMES`, a `linattn.FeatureMap`, or None
            (identity). "favor+" builds a `FAVORPlus(head_dim)` submodule (its projection is saved
            with the state dict); "cosformer" uses `max_seq_len` as its horizon.
        normalize: divide by the kernel's normaliser (an average of values) or not (a plain sum,
            as in RetNet/GLA/Mamba2, which rely on the output norm).
        gate: None | "retnet" | "scalar" | "diagonal" (see the module docstring).
        scale: multiplies q before the feature map; None (the default) means head_dim**-0.5, 1.0
            means no scaling (as in ELA and the `linear-*` mixers).
        chunk_size: the operator's chunk size for training and prefill.
        eps: the normaliser's floor.
    """

    config_fields = AttentionBase.config_fields + ("chunk_size", "n_value_heads")

    def __init__(self, d_model: int, n_heads: int, feature_map: Union[str, FeatureMap, None] = "elu+1", *,
                 normalize: bool = True, gate: Optional[str] = None, scale: Optional[float] = None,
                 chunk_size: int = 64, eps: float = 1e-6, feature_seed: int = 0, gate_low_rank: int = 16,
                 gate_normalizer: float = 16.0, **kwargs):
        if gate not in GATES:
            raise LinattnError(f"gate must be one of {GATES}, got {gate!r}")
        super().__init__(d_model, n_heads, **kwargs)
        max_seq_len = kwargs.get("max_seq_len", 2048)
        if isinstance(feature_map, str) and feature_map == "favor+":
            fmap = FAVORPlus(self.head_dim, seed=feature_seed)
        elif isinstance(feature_map, str) and feature_map == "cosformer":
            fmap = CosFormer(max_len=max_seq_len)
        else:
            fmap = get_feature_map(feature_map, self.head_dim)
        self.feature_map = fmap  # registered as a submodule if it is one (FAVOR+)
        self.feature_map_name = getattr(fmap, "name", "custom")
        self.normalize, self.gate = bool(normalize), gate
        self.scale = self.resolve_scale(scale, self.head_dim)
        self.chunk_size, self.eps = int(chunk_size), float(eps)
        H = self.n_value_heads   # the decays are per value head (Mamba2: one dt and A per value head)
        self._gamma: Optional[torch.Tensor] = None
        if gate == "retnet":
            # a plain CPU attribute computed from H (like RoPE's tables), not a buffer: building the
            # layer on the meta device (transformers' from_pretrained) cannot lose it
            self._gamma = (1.0 - 2.0 ** (-5.0 - torch.arange(H, dtype=torch.float64, device="cpu"))).float()
        elif gate == "scalar":
            self.a_proj = nn.Linear(d_model, H, bias=False)
            A_log, dt_bias = init_mamba_decay(H)
            self.A_log = nn.Parameter(A_log)
            self.dt_bias = nn.Parameter(dt_bias)
        elif gate == "diagonal":
            self.feature_dim = _feature_dim(fmap, self.head_dim)
            self.gk_proj = nn.Sequential(nn.Linear(d_model, gate_low_rank, bias=False),
                                         nn.Linear(gate_low_rank, H * self.feature_dim, bias=True))
            self.gate_normalizer = float(gate_normalizer)

    @property
    def gamma(self) -> Optional[torch.Tensor]:
        """RetNet's fixed per-head decay `[H]` (None for the other gates)."""
        return self._gamma

    def _gamma_on(self, device: torch.device) -> Optional[torch.Tensor]:
        if self._gamma is not None and self._gamma.device != device:
            self._gamma = self._gamma.to(device)
        return self._gamma

    def log_gate(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The data-dependent log-decay for x: `[B, T, H]` (scalar) or `[B, T, H, K_phi]` (diagonal)."""
        B, T, _ = x.shape
        if self.gate == "scalar":
            return self._scalar_gate(self.a_proj(x))
        if self.gate == "diagonal":
            return self._diagonal_gate(self.gk_proj(x).view(B, T, self.n_value_heads, self.feature_dim))
        return None

    def _scalar_gate(self, a: torch.Tensor, fast: bool = False) -> torch.Tensor:
        return mamba_log_decay(a, self.A_log, self.dt_bias, self if fast else None)

    def _diagonal_gate(self, gk: torch.Tensor) -> torch.Tensor:
        return F.logsigmoid(gk.to(torch.float64 if gk.dtype == torch.float64 else torch.float32)) / self.gate_normalizer

    # -- single-token decoding (AttentionBase's fast path) ----------------------------------------
    def _fast_supported(self) -> bool:
        fm = self.feature_map
        if self.gate == "diagonal":   # the low-rank gate exactly as built (an adapter may have replaced it)
            g = self._modules["gk_proj"]
            if not (type(g) is nn.Sequential and len(g) == 2 and type(g[1]) is nn.Linear) or hooked(g, g[1]):
                return False
        return type(self) is LinearAttention and not fm.log_space and not fm.positional

    def _fast_extra(self):
        mods = self._modules
        extra = ((mods["a_proj"],) if self.gate == "scalar" else (mods["gk_proj"][0],) if self.gate == "diagonal"
                 else ())
        return extra + ((mods.get("g_proj"),) if mods.get("g_proj") is not None else ())

    def _fast_decay(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """RetNet's per-head decay exp(log gamma) `[1, H, 1, 1]`, as the operator computes it, kept."""
        d = self.__dict__.get("_fast_decay_value")
        if d is None or d.dtype != dtype or d.device != device:
            d = torch.exp(torch.log(self._gamma_on(device).to(dtype))).view(1, -1, 1, 1)
            self.__dict__["_fast_decay_value"] = d
        return d

    def _fast_step(self, x: torch.Tensor, cache: LayerCache, lins) -> Optional[torch.Tensor]:
        """The recurrent form of `linear_attention` for one token, with the state [kv | z] kept as one
        tensor (kv and z in the cache are views of it); linear-space, non-positional maps only."""
        fm = self.feature_map
        B, H, HV, V, cdt = x.shape[0], self.n_heads, self.n_value_heads, self.head_dim_v, x.dtype
        Kf = self.__dict__.get("_fast_kf")
        if Kf is None:
            Kf = self.__dict__["_fast_kf"] = fm.feature_dim(self.head_dim)
        st = cache.get("state")
        if st is not None and not (isinstance(st, LinearAttentionState) and st.log_scale is None
                                   and st.kv.shape == (B, HV, Kf, V) and st.z.shape == (B, HV, Kf)
                                   and st.kv.device == x.device and st.offset.shape == (B,)):
            return None   # the general path checks it and says what is wrong
        if type(fm) in _COMPILED_MAPS and self.gate != "diagonal":
            fused = self._fast_compiled(x, cache, lins)
            if fused is not None:
                return self._fast_step_compiled(cache, st, *fused)
        qk, v, extra = self._fast_project(x, cache, lins)                    # [B, 2H, 1, K], [B, H, 1, V]
        if isinstance(fm, _ELEMENTWISE_MAPS) and self.scale == 1.0:
            fq, fk = fm.phi(qk).split(H, dim=1)
        else:
            q, k = qk.split(H, dim=1)
            if self.scale != 1.0:
                q = q * self.scale
            fq, fk = fm.phi(q.transpose(1, 2)).transpose(1, 2), fm.psi(k.transpose(1, 2)).transpose(1, 2)
        if HV != H:   # grouped value heads: value head j reads the features of q/k head j // (HV / H)
            fq, fk = fq.repeat_interleave(HV // H, dim=1), fk.repeat_interleave(HV // H, dim=1)
        if st is None:
            S = fq.new_zeros(B, HV, Kf, V + 1)
            offset = torch.zeros(B, dtype=torch.int64, device=x.device)
        else:
            fast = cache.__dict__.get("_fast_state")
            if fast is not None and fast[0] is st:
                S = fast[1]
            else:
                S = torch.cat([st.kv, st.z.unsqueeze(-1)], -1).to(cdt)
            offset = st.offset if st.offset.dtype == torch.int64 else st.offset.to(torch.int64)
        gate = extra[-1] if self._modules.get("g_proj") is not None else None
        if self.gate == "retnet":
            S = self._fast_decay(cdt, x.device) * S
        elif self.gate == "scalar":
            g = self._scalar_gate(extra[0], fast=True)
            S = torch.exp(g if g.dtype == cdt else g.to(cdt)).view(B, HV, 1, 1) * S
        elif self.gate == "diagonal":
            gk = F.linear(extra[0], self.gk_proj[1].weight, self.gk_proj[1].bias)
            S = torch.exp(self._diagonal_gate(gk).to(cdt)).view(B, HV, Kf, 1) * S
        S = S + fk.transpose(-1, -2) * F.pad(v, (0, 1), value=1.0)   # (not addcmul: the operator's bits)
        o, den = torch.matmul(fq, S).split([V, 1], dim=-1)                  # [B, H, 1, V], [B, H, 1, 1]
        if self.normalize:
            if isinstance(fm, _NONNEGATIVE_MAPS):
                den = den.clamp_min(self.eps)
            else:   # a floor on |den| that keeps its sign, as the operator
                floor = torch.as_tensor(self.eps, dtype=den.dtype)
                den = torch.where(den < 0, torch.minimum(den, -floor), torch.maximum(den, floor))
            o = o / den
        state = LinearAttentionState(kv=S[..., :V], z=S[..., V], log_scale=None, offset=offset + 1)
        cache["state"] = state
        cache.__dict__["_fast_state"] = (state, S)
        return self._fast_out(o, gate)

    def _fast_step_compiled(self, cache: LayerCache, st: Optional[LinearAttentionState], y: torch.Tensor, conv,
                            heads):
        """`_fast_step` as one compiled call between the fused projection and o_proj (cpu/decode.py), for the
        maps in _COMPILED_MAPS and the gates None, "retnet" and "scalar"."""
        cdt, B, HV, V = y.dtype, y.shape[0], self.n_value_heads, self.head_dim_v
        S, offset = None, torch.zeros(B, dtype=torch.int64)
        if st is not None:
            fast = cache.__dict__.get("_fast_state")
            S = fast[1] if fast is not None and fast[0] is st else torch.cat([st.kv, st.z.unsqueeze(-1)], -1)
            if S.dtype != cdt or not S.is_contiguous():
                S = S.to(cdt).contiguous()
            offset = st.offset if st.offset.dtype == torch.int64 else st.offset.to(torch.int64)
        decay = neg_a = dt_bias = None
        gate_kind = 0
        if self.gate == "retnet":
            gate_kind, decay = 1, self._fast_decay(cdt, y.device).reshape(-1).expand(HV).contiguous()
        elif self.gate == "scalar":
            gate_kind = 2
            neg_a = mamba_neg_a(self.A_log, cdt, self).reshape(-1).expand(HV).contiguous()
            dt_bias = self.dt_bias.detach().to(cdt).reshape(-1).expand(HV).contiguous()
        fm = self.feature_map
        o, S, window = _cpu_decode.linear_step(
            y, heads=heads, conv=conv, fmap=_cpu_decode.FEATURE_MAPS[fm.name], scale=self.scale,
            gate_kind=gate_kind, decay=decay, neg_a=neg_a, dt_bias=dt_bias, S=S, normalize=self.normalize,
            nonneg=isinstance(fm, _NONNEGATIVE_MAPS), eps=float(self.eps), norm=self._fast_norm_args(cdt),
            has_gate=self._modules.get("g_proj") is not None)
        state = LinearAttentionState(kv=S[..., :V], z=S[..., V], log_scale=None, offset=offset + 1)
        cache["state"] = state
        cache.__dict__["_fast_state"] = (state, S)
        return self._fast_compiled_out(cache, o, window)

    def _mix(self, q, k, v, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        T = x.shape[1]
        o, state = linear_attention(
            q, k, v, feature_map=self.feature_map, causal=True, normalize=self.normalize,
            gamma=self._gamma_on(q.device), g=self.log_gate(x), scale=self.scale,
            mode=self._mode(cache, T), chunk_size=self.chunk_size,
            initial_state=cache.get("state") if cache is not None else None,
            output_final_state=cache is not None, cu_seqlens=cu_seqlens, eps=self.eps)
        if cache is not None:
            cache["state"] = state
        return o

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", feature_map={self.feature_map_name!r}, normalize={self.normalize}, "
                f"gate={self.gate}, scale={self.scale}")
