"""Pure operator functions, one module per family, each with its parallel, chunk and recurrent forms.

Each public operator validates and prepares its call once (`prepare_*` -> a problem dataclass), then
runs it on a backend (`backend.py`: the PyTorch forms or the Triton kernels). `reference.py` holds
the fp64 references the tests, benchmarks and demo compare against.
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
from .rwkv7 import prepare_rwkv7, rwkv7
from .softmax import softmax_attention
from .ttt import TTTState, prepare_ttt, titans, ttt


def chunk_size_used(op: str, q, k, v, *args, backend: str = "auto", **kwargs) -> int:
    """The chunk length `op` ("linear_attention", "delta_rule", "comba", "delta_product" or "rwkv7", in sub-steps)
    really uses for this call on the backend it would pick (the Triton kernels round to 16 / 32 / 64; log-space maps and
    diagonal or per-channel gates use blocks of at most 16 on the PyTorch path). Same arguments as the operator."""
    from .backend import select_backend
    from .delta_core import efla_coefficient

    if op == "linear_attention":
        p = prepare_linear_attention(q, k, v, *args, **kwargs)
    elif op == "delta_rule":
        (beta,) = args
        exact = kwargs.pop("exact", False)
        p = prepare_delta(q, k, v, beta, channel_gate=True, coefficient=efla_coefficient if exact else None,
                          **kwargs)
    elif op == "comba":
        (beta,) = args
        read = kwargs.pop("p", None)  # comba always reads with a key of its own (p, or k): no Triton kernel
        p = prepare_delta(q, k, v, beta, r=k if read is None else read, channel_gate=True, **kwargs)
    elif op == "delta_product":  # in sub-steps (n per token), as delta_product's chunk_size
        (beta,) = args
        p, _ = prepare_delta_product(q, k, v, beta, **kwargs)
    elif op == "rwkv7":  # in sub-steps (2 per token), the core's unit; the arguments are rwkv7's (r, w, k, v, a, b)
        p = prepare_rwkv7(q, k, v, *args, **kwargs)
    else:
        from ..errors import LinattnError
        raise LinattnError(f"op must be 'linear_attention', 'delta_rule', 'comba', 'delta_product' or 'rwkv7', "
                           f"got {op!r}")
    return p.chunk_size_used(select_backend(backend, p))


__all__ = ["delta_rule", "linear_attention", "LinearAttentionState", "softmax_attention", "set_checks",
           "comba", "delta_product", "prepare_delta_product", "rwkv7", "prepare_rwkv7",
           "mesa_net", "MesaState", "prepare_mesa_net", "ttt", "titans", "TTTState", "prepare_ttt",
           "forgetting_attention", "forgetting_attention_step", "ForgettingAttentionState",
           "deltaformer", "deltaformer_step", "DeltaFormerState", "path_attention", "path_attention_step", "PaTHState",
           "get_checks", "value_checks_suspended", "FeatureMap", "feature_map_names", "get_feature_map",
           "register_feature_map", "chunk_size_used", "prepare_linear_attention", "prepare_delta"]
