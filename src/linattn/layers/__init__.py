"""Attention layers (nn.Modules) on top of the operators, plus their building blocks.

Every layer maps x `[B, T, d_model]` to `[B, T, d_model]`; `layer(x, cache=LayerCache())` keeps
a decoding state (prefill with many tokens, then one token at a time), and
`layer(x, cu_seqlens=offsets)` runs packed documents (x `[1, T_total, d_model]`) independently.
"""
from .base import AttentionBase
from .cache import Cache, KVCache, LayerCache, tensor_nbytes
from .common import GatedRMSNorm, RMSNorm, RotaryEmbedding, ShortConv, SwiGLU, l2_normalize
from .packing import check_cu_seqlens, packed_positions

# isort: off
# the layer modules register their mixers when imported: this order is the order of linattn.mixers()
from .softmax import SoftmaxAttention
from .linear_attention import GATES, LinearAttention
from .mamba2 import Mamba2Block
from .delta import EFLA, DeltaNet, GatedDeltaNet
from .softmax_family import DeltaFormer, FoX, PaTH
from .delta_family import KDA, Comba, DeltaProduct
from .mesa import MesaNet
from .ttt import TTT, Titans
from .rwkv7 import RWKV7
# isort: on

__all__ = [
    "AttentionBase", "LinearAttention", "DeltaNet", "GatedDeltaNet", "EFLA", "SoftmaxAttention",
    "Comba", "DeltaProduct", "KDA",
    "FoX", "DeltaFormer", "PaTH",
    "MesaNet", "TTT", "Titans", "Mamba2Block", "RWKV7",
    "Cache", "LayerCache", "KVCache", "tensor_nbytes",
    "RMSNorm", "GatedRMSNorm", "RotaryEmbedding", "ShortConv", "SwiGLU", "l2_normalize", "GATES",
    "check_cu_seqlens", "packed_positions",
]
