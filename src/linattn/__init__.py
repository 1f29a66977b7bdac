"""linattn: exact linear attention for PyTorch.

The public API, re-exported:
    linear_attention, LinearAttentionState   kernelized linear attention (ops/linear.py)
    softmax_attention                          the O(T^2) baseline (ops/softmax.py)
    delta_rule                                 DeltaNet, Gated DeltaNet, EFLA (ops/delta.py)
    FeatureMap, FAVORPlus, FEATURE_MAP_NAMES   phi/psi pairs (feature_maps.py)
    mixers, LMConfig, LanguageModel            language models and their mixer registry (models/);
                                               layers in linattn.layers, audit.check_causality
"""
from .errors import LinattnError
from .feature_maps import FEATURE_MAP_NAMES, FAVORPlus, FeatureMap, get_feature_map
from .ops import (LinearAttentionState, chunk_size_used, delta_rule, get_checks, linear_attention, prepare_delta,
                  prepare_linear_attention, set_checks, softmax_attention)
from .models import LanguageModel, LMConfig, mixers
from . import audit

__version__ = "0.1.0"

__all__ = [
    "LinattnError",
    "linear_attention", "LinearAttentionState", "softmax_attention", "delta_rule", "set_checks", "get_checks",
    "chunk_size_used", "prepare_linear_attention", "prepare_delta",
    "FeatureMap", "FAVORPlus", "FEATURE_MAP_NAMES", "get_feature_map",
    "mixers", "LMConfig", "LanguageModel", "audit",
]
