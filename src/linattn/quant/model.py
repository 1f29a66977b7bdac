"""`linattn.quantize(model, "int8" | "int4")`: a model's linear layers in 8 or 4 bits, for CPU inference.

What is quantized: every `nn.Linear` (exactly that type) of the model: a linattn `LanguageModel`'s projections,
feed-forwards, memory lobe and head, or a (kernelized) transformers model's linear layers including its head;
a linattn `MoE`'s experts (its router stays in float: routing is a discrete choice). The embedding stays in float.
A tied head (`LanguageModel` with `tie_embeddings`, or a transformers head sharing the embedding's weight) gets
its own quantized copy of the matrix, so the logits read 8/4 bits while the embedding lookup reads the float
row. A linear whose shape the format cannot take (int4: in_features not a multiple of the group, out_features
not a multiple of 16) stays in float and is listed in `quantization_summary(model)["skipped"]`.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..cpu import hugepages
from ..errors import LinattnError, LinattnTypeError
from ..models.lm import LanguageModel
from ..models.moe import MoE
from .linear import QuantizedLinear, check_activations, check_compute, check_mode, fits


class QuantizedMoE(MoE):
    """A linattn `MoE` whose experts' SwiGLU matrices are `QuantizedLinear`s (the router stays float)."""

    def __init__(self, moe: MoE, mode: str, group_size: Optional[int], compute: str,
                 activations: Optional[str] = None):
        nn.Module.__init__(self)
        self.d_model, self.n_experts, self.top_k, self.hidden = moe.d_model, moe.n_experts, moe.top_k, moe.hidden
        self.bias_mode, self.aux_loss_coef, self.renormalize = moe.bias_mode, moe.aux_loss_coef, moe.renormalize
        self.init_std, self.out_std = moe.init_std, moe.out_std
        self.router = copy.deepcopy(moe.router)
        # MoE stores x @ W ([E, d, 2h], [E, h, d]): an nn.Linear-layout weight is W[e]ᵀ
        how = (mode, group_size, compute, activations)
        self.experts_gate_up = nn.ModuleList(QuantizedLinear.from_weight(moe.w_gate_up[e].t(), None, *how)
                                             for e in range(self.n_experts))
        self.experts_down = nn.ModuleList(QuantizedLinear.from_weight(moe.w_down[e].t(), None, *how)
                                          for e in range(self.n_experts))

    def reset_parameters(self) -> None:
        raise LinattnError("a QuantizedMoE has no float expert weights to initialise")

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        a, b = self.experts_gate_up[e](x).chunk(2, dim=-1)
        return self.experts_down[e](F.silu(a) * b)


def quantized_modules(model: nn.Module) -> Dict[str, QuantizedLinear]:
    """The model's quantized linear layers.

    Args:
        model: Any module.

    Returns:
        {qualified name: QuantizedLinear}.
    """
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def quantization_summary(model: nn.Module) -> Dict[str, Any]:
    """What `quantize` did to a model.

    Args:
        model: A model (quantized or not).

    Returns:
        {"mode", "group_size", "compute", "activations" (None when nothing is quantized), "modules" (names),
        "bytes" (of the
        integer weights, scales and biases), "skipped" ({name: why it stayed in float})}.
    """
    q = quantized_modules(model)
    first = next(iter(q.values()), None)
    return {"mode": first.mode if first else None, "group_size": first.group_size if first else None,
            "compute": first.compute if first else None, "activations": first.activations if first else None,
            "modules": sorted(q),
            "bytes": sum(m.stored_bytes() for m in q.values()),
            "skipped": dict(getattr(model, "_linattn_quant_skipped", {}))}


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise LinattnTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if quantized_modules(model):
        raise LinattnError("model is already quantized (it holds QuantizedLinear modules); quantize the float model "
                           "once, or load the float checkpoint again")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.device.type != "cpu":
            raise LinattnError(f"model: {name} is on {t.device}; quantized weights run on the CPU only "
                               f"(model.cpu() first)")


def quantize(model: nn.Module, mode: str, *, group_size: Optional[int] = None, compute: str = "bf16",
             activations: Optional[str] = None, inplace: bool = False) -> nn.Module:
    """Quantize a model's linear layers to int8 (per output row) or int4 (per group of inputs), for CPU inference.

    Args:
        model: A linattn `LanguageModel` (or any module), or a transformers model (kernelized or not), on the CPU.
        mode: "int8" or "int4".
        group_size: int4's group of inputs sharing a scale, 32 (default) or 64; not for int8.
        compute: "bf16" (default: PyTorch's packed int8/int4 kernels with bf16 activations, fp32 accumulation)
            or "fp32" (dequantize to fp32 for each product: slower, no bf16 rounding).
        activations: "float" (the products take the activations as they are) or "int8": every product of a
            quantized layer rounds its input to int8 per block of 32 inputs first (an fp32 scale per block, as
            llama.cpp's Q8_0), and the compiled decode multiplies the integers (AVX-512 VNNI, AVX-VNNI, AVX2 or
            plain C): faster decoding, an extra error of at most half a block's scale per input
            (docs/quantization.md). None (default): "int8"; "float" keeps the exact products.
        inplace: Replace the modules of `model` itself (its float weights are dropped); default: a copy.

    Returns:
        The quantized model, in eval mode. A backward pass through it raises `LinattnError`.

    Raises:
        LinattnError: Unknown mode, compute or activations, a bad group size, a model already quantized,
            parameters off the CPU, or a non-finite weight.
        LinattnTypeError: model is not an nn.Module.
    """
    group_size = check_mode(mode, group_size)
    check_compute(compute)
    activations = check_activations(activations, mode)
    _check_model(model)
    if not inplace:
        model = copy.deepcopy(model)
    skipped: Dict[str, str] = {}
    tied = _tied_head(model)
    how = (mode, group_size, compute, activations)
    _replace_children(model, "", how, skipped)
    if tied is not None:
        _quantize_tied_head(model, tied, how, skipped)
    model._linattn_quant_skipped = skipped
    hugepages.place_module(model)   # (the integers every decoded token reads)
    return model.eval()


def _tied_head(model: nn.Module) -> Optional[torch.Tensor]:
    """The embedding matrix a linattn LanguageModel's tied head reads (None otherwise)."""
    if isinstance(model, LanguageModel) and model.lm_head is None:
        return model.embed.weight
    return None


def _quantize_tied_head(model, weight, how, skipped) -> None:
    reason = fits(how[0], how[1], *weight.shape)
    if reason:
        skipped["lm_head"] = reason
        return
    model.lm_head = QuantizedLinear.from_weight(weight, None, *how)


def _replace_children(module: nn.Module, prefix: str, how, skipped) -> None:
    """Replaces module's nn.Linear / MoE children (recursively) by quantized ones; how: (mode, group_size, compute,
    activations)."""
    mode, group_size = how[:2]
    for name, child in module.named_children():
        full = f"{prefix}{name}"
        if type(child) is nn.Linear:
            reason = fits(mode, group_size, child.out_features, child.in_features)
            if reason:
                skipped[full] = reason
                continue
            try:
                setattr(module, name, QuantizedLinear.from_linear(child, *how))
            except LinattnError as e:
                raise LinattnError(f"{full}: {e}") from None
        elif type(child) is MoE:
            if any(fits(mode, group_size, n, k) for n, k in ((2 * child.hidden, child.d_model),
                                                              (child.d_model, child.hidden))):
                skipped[full] = f"experts' shapes do not fit {mode}"
                _replace_children(child, full + ".", how, skipped)
                continue
            setattr(module, name, QuantizedMoE(child, *how))
        else:
            _replace_children(child, full + ".", how, skipped)
