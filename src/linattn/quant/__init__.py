"""8-bit and 4-bit weights for CPU inference: `quantize(model, "int8" | "int4")`, `QuantizedLinear`, and a saved
format of their own (`save_quantized` / `load_quantized`). See docs/quantization.md."""
from .linear import ACTIVATIONS, COMPUTES, GROUP_SIZES, MODES, QuantizedLinear, round_activations
from .model import QuantizedMoE, quantization_summary, quantize, quantized_modules
from .store import is_quantized_dir, load_quantized, refuse_quantized, save_quantized

__all__ = ["quantize", "QuantizedLinear", "QuantizedMoE", "quantized_modules", "quantization_summary",
           "save_quantized", "load_quantized", "is_quantized_dir", "refuse_quantized", "MODES", "GROUP_SIZES",
           "COMPUTES", "ACTIVATIONS", "round_activations"]
