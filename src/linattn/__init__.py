"""linattn: exact linear attention for PyTorch.

The public API, re-exported:
    linear_attention, LinearAttentionState   kernelized linear attention (ops/linear.py)
    softmax_attention                          the O(T^2) baseline (ops/softmax.py)
    delta_rule                                 DeltaNet, Gated DeltaNet, EFLA (ops/delta.py)
    comba, delta_product                       Comba, (Gated) DeltaProduct (ops/comba.py, ops/delta_product.py);
                                               Kimi Delta Attention is delta_rule with g [B, T, H, K]
    mesa_net, MesaState                        MesaNet, CG or exact solves (ops/mesa.py)
    forgetting_attention, deltaformer,         the softmax side: FoX, DeltaFormer, PaTH, with their
    path_attention (+ *_step, *State)          decoding steps (ops/forgetting.py, deltaformer.py, path.py)
    ttt, titans, TTTState                      TTT-Linear / TTT-MLP and Titans (ops/ttt.py)
    FeatureMap, FAVORPlus, FEATURE_MAP_NAMES   phi/psi pairs (feature_maps.py)
    mixers, LMConfig, LanguageModel            language models and their mixer registry (models/);
                                               layers in linattn.layers, audit.check_causality
"""
from . import audit
from .errors import LinattnError
from .feature_maps import FEATURE_MAP_NAMES, FAVORPlus, FeatureMap, get_feature_map
from .models import LanguageModel, LMConfig, mixers
from .ops import (
                  DeltaFormerState,
                  ForgettingAttentionState,
                  LinearAttentionState,
                  MesaState,
                  PaTHState,
                  TTTState,
                  chunk_size_used,
                  comba,
                  delta_product,
                  delta_rule,
                  deltaformer,
                  deltaformer_step,
                  forgetting_attention,
                  forgetting_attention_step,
                  get_checks,
                  linear_attention,
                  mesa_net,
                  path_attention,
                  path_attention_step,
                  prepare_delta,
                  prepare_linear_attention,
                  set_checks,
                  softmax_attention,
                  titans,
                  ttt,
)

__version__ = "0.1.0"

__all__ = [
    "LinattnError",
    "linear_attention", "LinearAttentionState", "softmax_attention", "delta_rule", "set_checks", "get_checks",
    "chunk_size_used", "prepare_linear_attention", "prepare_delta",
    "comba", "delta_product",
    "mesa_net", "MesaState", "ttt", "titans", "TTTState",
    "forgetting_attention", "forgetting_attention_step", "ForgettingAttentionState", "deltaformer",
    "deltaformer_step", "DeltaFormerState", "path_attention", "path_attention_step", "PaTHState",
    "FeatureMap", "FAVORPlus", "FEATURE_MAP_NAMES", "get_feature_map",
    "mixers", "LMConfig", "LanguageModel", "audit",
]
