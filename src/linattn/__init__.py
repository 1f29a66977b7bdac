"""linattn: exact linear attention for PyTorch.

The public API, re-exported:
    linear_attention, LinearAttentionState   kernelized linear attention (ops/linear.py)
    softmax_attention                          the O(T^2) baseline (ops/softmax.py)
    delta_rule                                 DeltaNet, Gated DeltaNet, EFLA (ops/delta.py)
    comba, delta_product                       Comba, (Gated) DeltaProduct (ops/comba.py, ops/delta_product.py);
    rwkv7                                      RWKV-7's state update, fla's chunk_rwkv7 arguments (ops/rwkv7.py);
                                               Kimi Delta Attention is delta_rule with g [B, T, H, K]
    mesa_net, MesaState                        MesaNet, CG or exact solves (ops/mesa.py)
    forgetting_attention, deltaformer,         the softmax side: FoX, DeltaFormer, PaTH, with their
    path_attention (+ *_step, *State)          decoding steps (ops/forgetting.py, deltaformer.py, path.py)
    ttt, titans, TTTState                      TTT-Linear / TTT-MLP and Titans (ops/ttt.py)
    explain                                    which backend a call takes and why (ops/registry.py)
    FeatureMap, FAVORPlus, FEATURE_MAP_NAMES   phi/psi pairs (ops/feature_maps.py); register_feature_map adds one
    mixers, LMConfig, LanguageModel            language models and their mixer registry (models/);
                                               layers in linattn.layers, audit.check_causality
    quantize                                   int8 / int4 weights for CPU inference (quant/)
    LinattnError and every other exception     what a user can meet, all LinattnError subclasses (errors.py and
    (ERRORS: their names)                      the modules that raise them; those load on first use)
"""
import importlib

from . import audit
from .errors import CheckpointError, ConfigError, DataError, LinattnError, LinattnTypeError, UsageError
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
                  explain,
                  forgetting_attention,
                  forgetting_attention_step,
                  get_checks,
                  linear_attention,
                  mesa_net,
                  path_attention,
                  path_attention_step,
                  prepare_delta,
                  prepare_linear_attention,
                  rwkv7,
                  set_checks,
                  softmax_attention,
                  titans,
                  ttt,
)
from .ops.feature_maps import feature_map_names, register_feature_map
from .quant import quantize

__version__ = "0.1.0"

# Every other exception a user can meet, by the module that defines it. They are exported lazily (PEP 562):
# importing those modules here would make `import linattn` load checkpoints, training, data, vision and
# experiments code (and experiments -> bench.common imports linattn itself). All derive from LinattnError.
_LAZY_ERRORS = {
    "CheckpointWriteError": "checkpoint", "DanglingLatest": "checkpoint",
    "TrainError": "training.config", "TrainConfigError": "training.config", "TrainingDiverged": "training.config",
    "RunFolderBusy": "training.lock", "StopRequested": "signals",
    "TokenizerError": "data.tokenizer", "CorpusError": "data.sources", "MNISTError": "data.mnist",
    "GenerateError": "generate", "ExperimentError": "experiments.common",
    "BackendUnavailableError": "ops.backend", "BackendDeviceError": "ops.backend",
    "VisionDependencyError": "vision.boxes", "ExportError": "vision.export", "VisionTrainError": "vision.train",
    "ChatTemplateError": "serve.chat", "ServerDidNotStart": "serve.process",
}
ERRORS = ("LinattnError", "LinattnTypeError", "ConfigError", "CheckpointError", "DataError", "UsageError",
          *_LAZY_ERRORS)


def __getattr__(name):
    module = _LAZY_ERRORS.get(name)
    if module is None:
        raise AttributeError(f"module 'linattn' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value   # later lookups skip this function
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY_ERRORS))


__all__ = [
    "LinattnError",
    "linear_attention", "LinearAttentionState", "softmax_attention", "delta_rule", "set_checks", "get_checks",
    "chunk_size_used", "prepare_linear_attention", "prepare_delta", "explain",
    "comba", "delta_product", "rwkv7",
    "mesa_net", "MesaState", "ttt", "titans", "TTTState",
    "forgetting_attention", "forgetting_attention_step", "ForgettingAttentionState", "deltaformer",
    "deltaformer_step", "DeltaFormerState", "path_attention", "path_attention_step", "PaTHState",
    "FeatureMap", "FAVORPlus", "FEATURE_MAP_NAMES", "get_feature_map", "feature_map_names", "register_feature_map",
    "mixers", "LMConfig", "LanguageModel", "audit", "quantize",
    "ERRORS", "LinattnTypeError", "ConfigError", "CheckpointError", "DataError", "UsageError",
    "CheckpointWriteError", "DanglingLatest", "TrainError", "TrainConfigError", "TrainingDiverged", "RunFolderBusy",
    "StopRequested", "TokenizerError", "CorpusError", "MNISTError", "GenerateError", "ExperimentError",
    "BackendUnavailableError", "BackendDeviceError", "VisionDependencyError", "ExportError", "VisionTrainError",
    "ChatTemplateError", "ServerDidNotStart",
]
