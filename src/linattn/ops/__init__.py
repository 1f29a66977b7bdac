"""Pure operator functions, one module per family, each with its parallel, chunk and recurrent forms.

Each public operator validates and prepares its call once (`prepare_*` -> a problem dataclass), then
runs it on a backend (`backend.py`: the PyTorch forms or the Triton kernels). `reference.py` holds
the fp64 references the tests, benchmarks and demo compare against. Each operator registers itself at the
bottom of its module (`registry.register_op`): `chunk_size_used`, `op_names()` and the registry-derived tests
(tests/test_registry_conformance.py) read that registry, so adding an operator edits no list here beyond its
import.
"""
from . import feature_map_relu2  # noqa: F401  (registers the "relu2" feature map)
from ._common import get_checks, set_checks, value_checks_suspended
from .comba import comba
from .delta import delta_rule
from .delta_core import prepare_delta
from .delta_product import delta_product, prepare_delta_product
from .deltaformer import DeltaFormerState, deltaformer, deltaformer_step
from .feature_maps import FeatureMap, feature_map_names, get_feature_map, register_feature_map
from .forgetting import ForgettingAttentionState, forgetting_attention, forgetting_attention_step
from .linear import LinearAttentionState, linear_attention, prepare_linear_attention
from .mesa import MesaState, mesa_net, prepare_mesa_net
from .path import PaTHState, path_attention, path_attention_step
from .registry import chunk_size_used, explain, op_names, op_spec, register_op
from .rwkv7 import prepare_rwkv7, rwkv7
from .softmax import softmax_attention
from .ttt import TTTState, prepare_ttt, titans, ttt

__all__ = ["delta_rule", "linear_attention", "LinearAttentionState", "softmax_attention", "set_checks",
           "comba", "delta_product", "prepare_delta_product", "rwkv7", "prepare_rwkv7",
           "mesa_net", "MesaState", "prepare_mesa_net", "ttt", "titans", "TTTState", "prepare_ttt",
           "forgetting_attention", "forgetting_attention_step", "ForgettingAttentionState",
           "deltaformer", "deltaformer_step", "DeltaFormerState", "path_attention", "path_attention_step", "PaTHState",
           "get_checks", "value_checks_suspended", "FeatureMap", "feature_map_names", "get_feature_map",
           "register_feature_map", "op_names", "op_spec", "register_op", "chunk_size_used", "prepare_linear_attention",
           "prepare_delta", "explain"]
