"""`linattn.feature_maps`: the feature maps, which live beside the operators that use them in
`linattn.ops.feature_maps` (see there). This module re-exports that one's names, read on first access, so
importing it never imports the operators ahead of their own package."""
from __future__ import annotations

_NAMES = ("FeatureMap", "Identity", "EluPlusOne", "ReLU", "CosFormer", "Taylor2", "HadamardExp", "SumSqEuclid",
          "SubSqEuclid", "MagnitudeDirection", "FAVORPlus", "FEATURE_MAPS", "FEATURE_MAP_NAMES", "feature_map_names",
          "get_feature_map", "register_feature_map", "unregister_feature_map", "on_feature_map_registered")
__all__ = list(_NAMES)


def __getattr__(name: str):
    # lazily: linattn.ops imports this module (through ops/linear.py) while it loads
    from .ops import feature_maps
    if name in _NAMES:
        return getattr(feature_maps, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(_NAMES)
