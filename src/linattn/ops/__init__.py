"""Pure operator functions, one module per family, each with its parallel, chunk and recurrent forms."""
from .delta import delta_rule
from .linear import LinearAttentionState, linear_attention
from .softmax import softmax_attention

__all__ = ["delta_rule", "linear_attention", "LinearAttentionState", "softmax_attention"]
