"""The mixer registry's machinery: `register_mixer`, `mixers()`, `mixer_spec`, `build_mixer`,
`mixer_config_kwargs`.

Every layer module registers its own mixers at its bottom (`register_mixer(...)`), so adding a mixer edits no
list elsewhere; `linattn.models.registry` re-exports this module and documents the naming scheme. It imports
nothing from linattn but `errors`, so any layer module can import it without a cycle.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch.nn as nn

from ..errors import ConfigError

#: the pseudo config field a mixer lists to receive its block's index
LAYER_IDX = "layer_idx"


class MixerSpec(NamedTuple):
    """One registered mixer (`mixer_spec`).

    Attributes:
        cls: The layer class or factory.
        defaults: Keyword arguments always passed to cls.
        description: One line for listings.
        rope_default: The rope a mixer uses unless the config or mixer_kwargs say otherwise.
        short_conv_default: The short_conv it uses unless the config or mixer_kwargs say otherwise.
        config_fields: The model-config fields passed to `cls` (same keyword names), plus LAYER_IDX.
    """
    cls: Callable[..., nn.Module]
    defaults: Dict[str, Any]
    description: str
    #: the rope / short_conv a mixer uses unless the config or mixer_kwargs say otherwise
    rope_default: bool = False
    short_conv_default: bool = False
    #: the model-config fields passed to `cls` (same keyword names), plus LAYER_IDX
    config_fields: Tuple[str, ...] = ()


_REGISTRY: Dict[str, MixerSpec] = {}


def register_mixer(name: str, cls: Callable[..., nn.Module], defaults: Optional[Dict[str, Any]] = None,
                   description: str = "", *, rope: bool = False, short_conv: bool = False,
                   config_fields: Optional[Sequence[str]] = None, overwrite: bool = False,
                   before: Optional[str] = None) -> None:
    """Register a token mixer, so that `LMConfig(mixer=name)` builds it.

    `cls(d_model, n_heads, **defaults, **kwargs)` must build an nn.Module mapping `[B, T, d_model]` to
    `[B, T, d_model]` with a `cache=` keyword (see `AttentionBase`) and a `cu_seqlens=` keyword (packed
    documents, see `linattn.layers.packing`).

    Args:
        name: The mixer's name.
        cls: The layer class (or a factory with its signature).
        defaults: Keyword arguments always passed to cls.
        description: One line for listings.
        rope: Whether the mixer uses RoPE by default (`LMConfig.rope=None`).
        short_conv: Whether it uses the short convolution by default (`LMConfig.short_conv=None`).
        config_fields: the model-config fields the mixer takes (default: `cls.config_fields`, or none).
        overwrite: Replace a mixer already registered under `name`.
        before: List the new mixer just ahead of this registered one in `mixers()` (otherwise in registration
            order), to keep a family's names together when two modules register them.

    Raises:
        ConfigError: An empty or taken name, a cls that is not callable, bad config_fields or defaults, a
            `before` that is not registered.

    Examples:
        >>> from linattn import LanguageModel, LMConfig
        >>> from linattn.layers import GatedDeltaNet
        >>> from linattn.models.registry import register_mixer, unregister_mixer
        >>> register_mixer("gdn-wide-conv", GatedDeltaNet, {"conv_size": 8}, "Gated DeltaNet, kernel-8 conv",
        ...                short_conv=True)
        >>> model = LanguageModel(LMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, mixer="gdn-wide-conv"))
        >>> model.blocks[0].mixer.q_conv.kernel_size
        8
        >>> unregister_mixer("gdn-wide-conv")
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a mixer name must be a non-empty string, got {name!r}")
    if name in _REGISTRY and not overwrite:
        raise ConfigError(f"mixer {name!r} is already registered (pass overwrite=True to replace it)")
    if not callable(cls):
        raise ConfigError(f"mixer {name!r}: cls must be a class or factory, got {cls!r}")
    if config_fields is None:
        config_fields = getattr(cls, "config_fields", ())
    if isinstance(config_fields, str) or not all(isinstance(f, str) for f in config_fields):
        raise ConfigError(f"mixer {name!r}: config_fields must be a sequence of field names, got {config_fields!r}")
    if defaults is not None and not isinstance(defaults, dict):
        raise ConfigError(f"mixer {name!r}: defaults must be a dict, got {type(defaults).__name__}")
    if before is not None and before not in _REGISTRY:
        raise ConfigError(f"mixer {name!r}: before={before!r} is not a registered mixer")
    spec = MixerSpec(cls, dict(defaults or {}), description, bool(rope), bool(short_conv), tuple(config_fields))
    if before is None:
        _REGISTRY[name] = spec
        return
    _REGISTRY.pop(name, None)
    items = list(_REGISTRY.items())
    at = [n for n, _ in items].index(before)
    _REGISTRY.clear()
    _REGISTRY.update(items[:at] + [(name, spec)] + items[at:])


def unregister_mixer(name: str) -> None:
    """Remove a registered mixer (for plugins and tests).

    Args:
        name: The mixer's name.

    Raises:
        ConfigError: An unknown mixer.
    """
    mixer_spec(name)
    del _REGISTRY[name]


def mixers() -> List[str]:
    """Names of every registered token mixer, in registration order.

    Each is a value of `LMConfig.mixer`; `register_mixer` adds one.

    Returns:
        The names.

    Examples:
        >>> import linattn
        >>> {"softmax", "gated-deltanet", "linear-elu+1", "mamba2"} <= set(linattn.mixers())
        True
    """
    return list(_REGISTRY)


def mixer_spec(name: str) -> MixerSpec:
    """The registration of mixer `name`.

    Args:
        name: A name of `mixers()`.

    Returns:
        Its `MixerSpec` (class, defaults, description, rope / short_conv defaults, config fields).

    Raises:
        ConfigError: An unknown mixer (the message lists the valid ones).
    """
    if name not in _REGISTRY:
        raise ConfigError(f"unknown mixer {name!r}; valid mixers are: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def mixer_config_kwargs(name: str, config: Any, layer_idx: Optional[int] = None) -> Dict[str, Any]:
    """The keyword arguments `config` (an `LMConfig`) gives mixer `name` in layer `layer_idx`.

    The config fields the mixer declares (those set to None left out), `layer_idx` when declared,
    then `config.mixer_kwargs[name]` on top.

    Args:
        name: The mixer's name.
        config: The model config.
        layer_idx: The block's index.

    Returns:
        {keyword: value} for `build_mixer`.
    """
    spec = mixer_spec(name)
    kw: Dict[str, Any] = {}
    for field in spec.config_fields:
        if field == LAYER_IDX:
            if layer_idx is not None:
                kw[LAYER_IDX] = layer_idx
            continue
        if not hasattr(config, field):
            raise ConfigError(f"mixer {name!r} takes the config field {field!r}, which "
                              f"{type(config).__name__} does not have")
        value = getattr(config, field)
        if value is not None:
            kw[field] = value
    kw.update((getattr(config, "mixer_kwargs", None) or {}).get(name, {}))
    return kw


def build_mixer(name: str, d_model: int, n_heads: int, **kwargs) -> nn.Module:
    """Build mixer `name`.

    Args:
        name: A name of `mixers()`.
        d_model: The model width.
        n_heads: The number of heads.
        **kwargs: Override its defaults (rope, short_conv, head_dim, max_seq_len...). A layer class with a
            `config_kwargs(kwargs)` classmethod maps them to its own keywords first (the delta rule's layers fold a
            model config's `l2norm_convention` and old options into `qk_norm`, silently: a saved config keeps its
            meaning).

    Returns:
        The layer, a module from `[B, T, d_model]` to `[B, T, d_model]`.

    Raises:
        ConfigError: An unknown mixer.

    Examples:
        >>> import torch
        >>> from linattn.models import build_mixer
        >>> build_mixer("gated-deltanet", 64, 4)(torch.randn(1, 5, 64)).shape
        torch.Size([1, 5, 64])
    """
    spec = mixer_spec(name)
    args = dict(spec.defaults)
    args.setdefault("rope", spec.rope_default)
    args.setdefault("short_conv", spec.short_conv_default)
    args.update(kwargs)
    adapt = getattr(spec.cls, "config_kwargs", None)   # a layer that reads old config fields its own way
    if adapt is not None:
        args = adapt(args)
    try:
        return spec.cls(d_model, n_heads, **args)
    except TypeError as e:
        if "unexpected keyword argument" in str(e) or "got multiple values" in str(e):
            raise ConfigError(f"mixer {name!r} ({getattr(spec.cls, '__name__', spec.cls)}) does not take these "
                              f"arguments: {e}") from e
        raise


__all__ = ["MixerSpec", "LAYER_IDX", "register_mixer", "unregister_mixer", "mixers", "mixer_spec",
           "mixer_config_kwargs", "build_mixer"]
