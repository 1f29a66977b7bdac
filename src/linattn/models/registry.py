"""The mixer registry: a name for every token mixer a `LanguageModel` block can use.

Naming scheme:

* `softmax`, `swa`                     softmax attention (RoPE, KV cache); `swa` = sliding window
                                       (`LMConfig.window`, default 256)
* `linear-<feature map>`               normalised kernelized linear attention with one feature map
                                       of `linattn.FEATURE_MAP_NAMES` (`linear-elu+1`,
                                       `linear-hadamard_exp`, `linear-sum_sq_euclid`, ...); per-head
                                       output norm, no RoPE, no q scaling (FAVOR+: head_dim**-0.5).
                                       `linear-identity` is the unnormalised sum (a normaliser
                                       q . sum k has no sign).
* `ela-hadamard_exp`, `ela-sum_sq_euclid`  the ELA paper's attention: RoPE on q/k, no 1/sqrt(d)
                                       scaling, no output norm, no short conv.
* `retnet`, `mamba2`, `gla`            gated (unnormalised) linear attention: fixed per-head decay,
                                       Mamba2-style scalar data-dependent decay, GLA diagonal decay
* `deltanet`, `gated-deltanet`         the delta rule (FLA layer pattern, short conv)
* `efla`, `efla-adaptive`, `efla-loose`    error-free linear attention and its two beta variants

`build_mixer(name, d_model, n_heads, **kwargs)` builds one; `register_mixer` adds new ones.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple

import torch.nn as nn

from ..feature_maps import FEATURE_MAP_NAMES
from ..layers import EFLA, DeltaNet, GatedDeltaNet, LinearAttention, SoftmaxAttention


class MixerSpec(NamedTuple):
    cls: Callable[..., nn.Module]
    defaults: Dict[str, Any]
    description: str
    #: False for mixers whose layer signature has no rope/short_conv of their own choosing
    rope_default: bool = False
    short_conv_default: bool = False


_REGISTRY: Dict[str, MixerSpec] = {}


def register_mixer(name: str, cls: Callable[..., nn.Module], defaults: Dict[str, Any] = None,
                   description: str = "", *, rope: bool = False, short_conv: bool = False,
                   overwrite: bool = False) -> None:
    """Register a mixer. `cls(d_model, n_heads, **defaults, **kwargs)` must build an nn.Module
    mapping `[B, T, d_model]` to `[B, T, d_model]` with a `cache=` keyword (see `AttentionBase`)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a mixer name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"mixer {name!r} is already registered (pass overwrite=True to replace it)")
    _REGISTRY[name] = MixerSpec(cls, dict(defaults or {}), description, rope, short_conv)


def mixers() -> List[str]:
    """Names of every registered token mixer, in registration order."""
    return list(_REGISTRY)


def mixer_spec(name: str) -> MixerSpec:
    if name not in _REGISTRY:
        raise ValueError(f"unknown mixer {name!r}; valid mixers are: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def build_mixer(name: str, d_model: int, n_heads: int, **kwargs) -> nn.Module:
    """Build mixer `name`; kwargs override its defaults (rope, short_conv, head_dim, max_seq_len...)."""
    spec = mixer_spec(name)
    args = dict(spec.defaults)
    args.setdefault("rope", spec.rope_default)
    args.setdefault("short_conv", spec.short_conv_default)
    args.update(kwargs)
    head_dim = args.get("head_dim") or (d_model // n_heads)
    for key, value in list(args.items()):
        if value == "head_dim**-0.5":
            args[key] = head_dim ** -0.5
    return spec.cls(d_model, n_heads, **args)


def _register_builtins() -> None:
    register_mixer("softmax", SoftmaxAttention, {}, "causal softmax attention with RoPE and a KV cache", rope=True)
    register_mixer("swa", SoftmaxAttention, {"window": 256},
                   "sliding-window softmax attention (LMConfig.window sets the window)", rope=True)
    for fm in FEATURE_MAP_NAMES:
        defaults: Dict[str, Any] = {"feature_map": fm, "normalize": fm != "identity"}
        if fm == "favor+":
            defaults["scale"] = "head_dim**-0.5"
        register_mixer(f"linear-{fm}", LinearAttention, defaults,
                       f"normalised linear attention with the {fm} feature map" if fm != "identity"
                       else "unnormalised linear attention (phi = identity)")
    for fm in ("hadamard_exp", "sum_sq_euclid"):
        register_mixer(f"ela-{fm}", LinearAttention, {"feature_map": fm, "output_norm": False, "scale": 1.0},
                       f"the ELA paper's layer: {fm} kernel, RoPE, no scaling, no output norm", rope=True)
    gated = {"feature_map": "identity", "normalize": False, "scale": "head_dim**-0.5"}
    register_mixer("retnet", LinearAttention, dict(gated, gate="retnet"),
                   "RetNet: fixed per-head decay 1 - 2^(-5-h)")
    register_mixer("mamba2", LinearAttention, dict(gated, gate="scalar", output_gate=True),
                   "Mamba2-style scalar data-dependent decay per head", short_conv=True)
    register_mixer("gla", LinearAttention, dict(gated, gate="diagonal", output_gate=True),
                   "GLA: data-dependent decay per feature, logsigmoid(.)/16")
    register_mixer("deltanet", DeltaNet, {}, "DeltaNet: delta rule, sigmoid beta, L2-normalised q/k", short_conv=True)
    register_mixer("gated-deltanet", GatedDeltaNet, {}, "Gated DeltaNet: delta rule with a scalar decay",
                   short_conv=True)
    register_mixer("efla", EFLA, {"beta_mode": "sigmoid"}, "EFLA: exactly integrated delta rule", short_conv=True)
    register_mixer("efla-adaptive", EFLA, {"beta_mode": "adaptive"}, "EFLA + adaptive decay softplus(alpha)*beta",
                   short_conv=True)
    register_mixer("efla-loose", EFLA, {"beta_mode": "loose"}, "EFLA + loose beta (softplus)", short_conv=True)


_register_builtins()
