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

from typing import Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import LinattnError
from ..ops import linear_attention
from ..ops.feature_maps import FeatureMap, feature_map_names, get_feature_map, on_feature_map_registered
from . import fast_decode
from .base import AttentionBase
from .cache import LayerCache
from .common import init_mamba_decay, mamba_log_decay
from .grouped_kv import group_kv_heads, grouped_qkv, repeat_kv
from .registry import register_mixer

GATES = (None, "retnet", "scalar", "diagonal")


def _feature_dim(fmap: FeatureMap, head_dim: int) -> int:
    """K_phi of a feature map, found by applying it to a dummy input."""
    x = torch.zeros(1, 1, 1, head_dim)
    pos = torch.zeros(1, 1, dtype=torch.long)
    return int(fmap.phi(x, pos).shape[-1])


def sum_normalized(f: torch.Tensor) -> torch.Tensor:
    """Features divided by their sum + 1e-4 (fla's linear_attn norm_q / norm_k)."""
    return f / (f.sum(-1, keepdim=True) + 1e-4)


class _ScaledPhi(FeatureMap):
    """`inner` with phi(x) multiplied by `scale` (psi unchanged): the q scale applied after the feature map; with
    sum_norm_q / sum_norm_k, phi (before the scale) / psi divided by their sum + 1e-4 (`sum_normalized`)."""

    def __init__(self, inner: FeatureMap, scale: float, sum_norm_q: bool = False, sum_norm_k: bool = False):
        if inner.log_space or isinstance(inner, nn.Module):
            raise LinattnError(f"scale_after_map / sum_norm_q / sum_norm_k need a linear-space feature map without "
                               f"parameters, got {inner.name!r}")
        super().__init__()
        self.inner, self.scale = inner, float(scale)
        self.sum_norm_q, self.sum_norm_k = bool(sum_norm_q), bool(sum_norm_k)
        self.name, self.positional = f"{inner.name}*{self.scale:.17g}", inner.positional
        if self.sum_norm_q or self.sum_norm_k:
            self.name += f"/sum({'q' * self.sum_norm_q}{'k' * self.sum_norm_k})"

    def phi(self, x, pos=None):
        f = self.inner.phi(x, pos)
        f = sum_normalized(f) if self.sum_norm_q else f
        return f if self.scale == 1.0 else f * self.scale

    def psi(self, x, pos=None):
        f = self.inner.psi(x, pos)
        return sum_normalized(f) if self.sum_norm_k else f

    def feature_dim(self, head_dim: int) -> int:
        return self.inner.feature_dim(head_dim)


LEARNED_MAPS = ("hadamard", "hedgehog", "t2r", "dpfp")


class LearnedMap(nn.Module, FeatureMap):
    """fla's linear_attn feature maps (fla/modules/feature_map.py), phi for q and psi for k with weights of their
    own (one set for both when tied), for heads of width `dim`:

    * hadamard: l1(x) * l2(x), two biased Linear(dim, dim) (fla's `elementwise_product`), K_phi = dim;
    * hedgehog: softmax([2 l(x), -2 l(x)]) over 2 dim features, l a biased Linear(dim, dim);
    * t2r: relu(l(x)), l an unbiased Linear(dim, dim), K_phi = dim;
    * dpfp: no weights: r = [relu(x), relu(-x)], features r repeated nu = 4 times times r rolled by 1..4, 8 dim.

    phi is multiplied by `phi_scale` (the layer's scale_after_map). The weights are `q.*` and `k.*` (untied)."""
    log_space = False
    positional = False

    def __init__(self, kind: str, dim: int, *, tied: bool = False, phi_scale: float = 1.0):
        nn.Module.__init__(self)
        if kind not in LEARNED_MAPS:
            raise LinattnError(f"learned_map must be one of {LEARNED_MAPS}, got {kind!r}")
        self.kind, self.dim, self.tied, self.phi_scale = kind, int(dim), bool(tied), float(phi_scale)
        self.sum_norm_q = self.sum_norm_k = False   # set by the layer (sum_norm_q / sum_norm_k)
        self.name = f"learned-{kind}"
        self.q = self._weights()
        self.k = None if tied else self._weights()

    def _weights(self) -> Optional[nn.ModuleDict]:
        d = self.dim
        if self.kind == "hadamard":
            return nn.ModuleDict({"layer1": nn.Linear(d, d), "layer2": nn.Linear(d, d)})
        if self.kind in ("hedgehog", "t2r"):
            return nn.ModuleDict({"layer": nn.Linear(d, d, bias=self.kind == "hedgehog")})
        return None

    def _features(self, w: Optional[nn.ModuleDict], x: torch.Tensor) -> torch.Tensor:
        if self.kind == "hadamard":
            return w["layer1"](x) * w["layer2"](x)
        if self.kind == "hedgehog":
            y = 2 * w["layer"](x)
            return torch.cat([y, -y], dim=-1).softmax(-1)
        if self.kind == "t2r":
            return w["layer"](x).relu()
        r = torch.cat([x.relu(), (-x).relu()], dim=-1)
        return torch.cat([r] * 4, dim=-1) * torch.cat([r.roll(shifts=j, dims=-1) for j in range(1, 5)], dim=-1)

    def phi(self, x, pos=None):
        f = self._features(self.q, x)
        f = sum_normalized(f) if self.sum_norm_q else f
        return f if self.phi_scale == 1.0 else f * self.phi_scale

    def psi(self, x, pos=None):
        f = self._features(self.q if self.k is None else self.k, x)
        return sum_normalized(f) if self.sum_norm_k else f

    def feature_dim(self, head_dim: int) -> int:
        return {"hadamard": 1, "hedgehog": 2, "t2r": 1, "dpfp": 8}[self.kind] * head_dim

    def forward(self, x):
        """phi(x), for inspection."""
        return self.phi(x)

    def extra_repr(self) -> str:
        return f"{self.kind!r}, dim={self.dim}, tied={self.tied}, phi_scale={self.phi_scale}"


class LinearAttention(AttentionBase):
    """Multi-head kernelized linear attention layer: the `linear-*`, RetNet, GLA and Mamba2-GLA mixers.

    Args:
        d_model: The model width; the layer maps `[B, T, d_model]` to `[B, T, d_model]`.
        n_heads: The number of heads.
        feature_map: a registered name (`linattn.feature_map_names()`), a `linattn.FeatureMap`, or None
            (identity). A name builds itself: `cls.build(head_dim, max_seq_len=max_seq_len, seed=feature_seed)`
            ("favor+" makes a `FAVORPlus(head_dim)` submodule whose projection is saved with the state dict;
            "cosformer" uses `max_seq_len` as its horizon).
        normalize: divide by the kernel's normaliser (an average of values) or not (a plain sum,
            as in RetNet/GLA/Mamba2, which rely on the output norm).
        gate: None | "retnet" | "scalar" | "diagonal" (see the module docstring).
        scale: multiplies q before the feature map; None (the default) means head_dim**-0.5, 1.0
            means no scaling (as in ELA and the `linear-*` mixers).
        chunk_size: the operator's chunk size for training and prefill.
        eps: the normaliser's floor.
        feature_seed: the seed a named feature map builds itself with (FAVOR+'s random projection).
        gate_low_rank: the diagonal gate's low-rank width.
        gate_normalizer: the divisor of the diagonal gate's logsigmoid.
        gate_min: an optional floor on the diagonal gate's log decay (fla's GLA `clamp_min`; None: none).
        scale_after_map: phi(q) * scale (fla's linear_attn) instead of phi(scale * q); needs a linear-space
            feature map without parameters.
        sum_norm_q: divide phi(q) (before scale_after_map's scale) by its sum + 1e-4 (fla's linear_attn norm_q);
            linear-space maps without parameters, or learned_map.
        sum_norm_k: the same for psi(k) (fla's norm_k).
        normalize_add: with normalize=False, divide by the normaliser phi(q) . sum psi(k) plus this number (fla's
            linear_attn norm_feature_map: 1e-10) instead of normalize's floor at eps; None: no such division.
        learned_map: one of LEARNED_MAPS, a feature map with its own weights (fla's linear_attn
            maps; `LearnedMap`) used instead of feature_map.
        learned_map_tied: q and k share the learned map's weights.
        n_kv_heads: grouped key/value heads (fla's num_kv_heads): k, v and the diagonal decay have n_kv_heads
            heads, each serving n_heads / n_kv_heads query heads; None: one per query head. Not with n_value_heads.
        **kwargs: `AttentionBase`'s options: head_dim, short_conv, rope, output_norm, output_gate,
            n_value_heads, ...

    Raises:
        LinattnError: A bad gate, feature map or other option (the message names it).

    Examples:
        >>> import torch
        >>> from linattn.layers import LayerCache, LinearAttention
        >>> layer = LinearAttention(64, 4, "elu+1", gate="scalar").double()
        >>> x = torch.randn(2, 10, 64, dtype=torch.float64)
        >>> y = layer(x)
        >>> cache = LayerCache()                     # prefill 9 tokens, then decode the 10th
        >>> _ = layer(x[:, :9], cache)
        >>> torch.allclose(layer(x[:, 9:], cache), y[:, 9:])
        True
    """

    config_fields = AttentionBase.config_fields + ("chunk_size", "n_value_heads")

    def __init__(self, d_model: int, n_heads: int, feature_map: Union[str, FeatureMap, None] = "elu+1", *,
                 normalize: bool = True, gate: Optional[str] = None, scale: Optional[float] = None,
                 chunk_size: int = 64, eps: float = 1e-6, feature_seed: int = 0, gate_low_rank: int = 16,
                 gate_normalizer: float = 16.0, gate_min: Optional[float] = None, scale_after_map: bool = False,
                 n_kv_heads: Optional[int] = None, learned_map: Optional[str] = None, learned_map_tied: bool = False,
                 sum_norm_q: bool = False, sum_norm_k: bool = False, normalize_add: Optional[float] = None,
                 **kwargs):
        if gate not in GATES:
            raise LinattnError(f"gate must be one of {GATES}, got {gate!r}")
        super().__init__(d_model, n_heads, **kwargs)
        kvh = self.n_heads if n_kv_heads is None else n_kv_heads
        if isinstance(kvh, bool) or not isinstance(kvh, int) or kvh < 1 or self.n_heads % kvh or (
                kvh != self.n_heads and self.n_value_heads != self.n_heads):
            raise LinattnError(f"n_kv_heads must be a positive int that divides n_heads ({self.n_heads}), without "
                               f"n_value_heads; got {n_kv_heads!r}")
        self.n_kv_heads = int(kvh)
        group_kv_heads(self, self.n_kv_heads)
        # a named map builds itself from what the layer knows (cosformer: its horizon; favor+: its draw)
        if learned_map is not None:   # fla's maps with weights: they replace feature_map
            fmap = LearnedMap(learned_map, self.head_dim, tied=learned_map_tied)
        else:
            fmap = get_feature_map(feature_map, self.head_dim, max_seq_len=kwargs.get("max_seq_len", 2048),
                                   seed=feature_seed)
        self.feature_map = fmap  # registered as a submodule if it is one (FAVOR+, LearnedMap)
        self.feature_map_name = getattr(fmap, "name", "custom")
        self.normalize, self.gate = bool(normalize), gate
        if normalize_add is not None and self.normalize:
            raise LinattnError("normalize_add replaces normalize's floored normaliser: pass normalize=False with it")
        self.normalize_add = None if normalize_add is None else float(normalize_add)
        self.scale = self.resolve_scale(scale, self.head_dim)
        self.scale_after_map = bool(scale_after_map)
        if self.scale_after_map or sum_norm_q or sum_norm_k:
            # phi(q) * scale (fla's linear_attn) instead of phi(scale * q); features divided by their sums
            post = self.scale if self.scale_after_map else 1.0
            if isinstance(fmap, LearnedMap):
                fmap.phi_scale, fmap.sum_norm_q, fmap.sum_norm_k = post, bool(sum_norm_q), bool(sum_norm_k)
            else:
                self.feature_map = _ScaledPhi(fmap, post, sum_norm_q, sum_norm_k)
            self.feature_map_name = self.feature_map.name
            if self.scale_after_map:
                self.scale = 1.0
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
            # one decay per value head (grouped value heads: HV of them), or per k/v head with grouped k/v heads
            # (n_kv_heads, widened with k in log_gate)
            gate_heads = self.n_kv_heads if self.n_kv_heads != self.n_heads else H
            self.gk_proj = nn.Sequential(nn.Linear(d_model, gate_low_rank, bias=False),
                                         nn.Linear(gate_low_rank, gate_heads * self.feature_dim, bias=True))
            self.gate_normalizer = float(gate_normalizer)
            # fla's GLA clamp_min: a floor on the log decay (None: none)
            self.gate_min = None if gate_min is None else float(gate_min)

    @property
    def gamma(self) -> Optional[torch.Tensor]:
        """RetNet's fixed per-head decay `[H]` (None for the other gates)."""
        return self._gamma

    def _gamma_on(self, device: torch.device) -> Optional[torch.Tensor]:
        if self._gamma is not None and self._gamma.device != device:
            self._gamma = self._gamma.to(device)
        return self._gamma

    def log_gate(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The data-dependent log-decay for x (gate "scalar" or "diagonal").

        Args:
            x: The layer input `[B, T, d_model]`.

        Returns:
            g `[B, T, H]` (scalar) or `[B, T, H, K_phi]` (diagonal); None for the other gates.
        """
        B, T, _ = x.shape
        if self.gate == "scalar":
            return self._scalar_gate(self.a_proj(x))
        if self.gate == "diagonal":
            if self.n_kv_heads != self.n_heads:
                gk = self.gk_proj(x).view(B, T, self.n_kv_heads, self.feature_dim)
                return self._diagonal_gate(repeat_kv(gk, self.n_heads // self.n_kv_heads))
            return self._diagonal_gate(self.gk_proj(x).view(B, T, self.n_value_heads, self.feature_dim))
        return None

    def _scalar_gate(self, a: torch.Tensor, fast: bool = False) -> torch.Tensor:
        return mamba_log_decay(a, self.A_log, self.dt_bias, self if fast else None)

    def _diagonal_gate(self, gk: torch.Tensor) -> torch.Tensor:
        g = F.logsigmoid(gk.to(torch.float64 if gk.dtype == torch.float64 else torch.float32)) / self.gate_normalizer
        return g if self.gate_min is None else g.clamp_min(self.gate_min)

    # -- single-token decoding (fast_decode.py's "linear" step) -------------------------------------
    def fast_step_kind(self) -> Optional[str]:
        return ("linear" if type(self) is LinearAttention and self.n_kv_heads == self.n_heads
                and self.normalize_add is None and fast_decode.linear_supported(self) else None)

    def _qkv(self, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        if self.n_kv_heads == self.n_heads:
            return super()._qkv(x, cache, cu_seqlens)
        q, k, v = grouped_qkv(self, x, cache, cu_seqlens, self.n_kv_heads)
        g = self.n_heads // self.n_kv_heads
        return q, repeat_kv(k, g), repeat_kv(v, g)

    def _mix(self, q, k, v, x, cache: Optional[LayerCache], cu_seqlens: Optional[torch.Tensor] = None):
        T = x.shape[1]
        if self.normalize_add is not None:   # the normaliser phi(q) . sum psi(k) as one more value column of ones
            v = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
        o, state = linear_attention(
            q, k, v, feature_map=self.feature_map, causal=True, normalize=self.normalize,
            gamma=self._gamma_on(q.device), g=self.log_gate(x), scale=self.scale,
            mode=self._mode(cache, T), chunk_size=self.chunk_size,
            initial_state=cache.state if cache is not None else None,
            output_final_state=cache is not None, cu_seqlens=cu_seqlens, eps=self.eps)
        if cache is not None:
            cache.state = state
        if self.normalize_add is not None:
            return o[..., :-1] / (o[..., -1:] + self.normalize_add)
        return o

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", feature_map={self.feature_map_name!r}, normalize={self.normalize}, "
                f"gate={self.gate}, scale={self.scale}")


# the mixers of this module (their registration order is the order of linattn.mixers(): see layers/__init__.py)
def _register_linear_mixer(fm: str) -> None:
    """`linear-<fm>`: normalised linear attention with the registered feature map `fm`."""
    defaults = {"feature_map": fm, "normalize": fm != "identity"}
    if fm != "favor+":
        defaults["scale"] = 1.0   # no q scaling; FAVOR+ keeps the default head_dim**-0.5
    register_mixer(f"linear-{fm}", LinearAttention, defaults,
                   f"normalised linear attention with the {fm} feature map" if fm != "identity"
                   else "unnormalised linear attention (phi = identity)")


for _fm in feature_map_names():
    _register_linear_mixer(_fm)
on_feature_map_registered(_register_linear_mixer)   # a map registered later gets its linear-<name> too
for _fm in ("hadamard_exp", "sum_sq_euclid"):
    register_mixer(f"ela-{_fm}", LinearAttention, {"feature_map": _fm, "output_norm": False, "scale": 1.0},
                   f"the ELA paper's layer: {_fm} kernel, RoPE, no scaling, no output norm", rope=True)
_GATED = {"feature_map": "identity", "normalize": False}   # scale: the default head_dim**-0.5
register_mixer("retnet", LinearAttention, dict(_GATED, gate="retnet"), "RetNet: fixed per-head decay 1 - 2^(-5-h)")
register_mixer("mamba2-gla", LinearAttention, dict(_GATED, gate="scalar", output_gate=True),
               "gated linear attention with a Mamba2-style scalar data-dependent decay per head (the mixer "
               "named mamba2 in version-1 configs)", short_conv=True)
register_mixer("gla", LinearAttention, dict(_GATED, gate="diagonal", output_gate=True),
               "GLA: data-dependent decay per feature, logsigmoid(.)/16")
