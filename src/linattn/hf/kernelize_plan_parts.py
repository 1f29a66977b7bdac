"""What the architecture descriptions of the kernelized whole-model plan share (hf/kernelize_plan.py and its
per-architecture modules import this; it imports none of them)."""
from __future__ import annotations

import types
from typing import Optional, Union

import torch
import torch.nn as nn

from ..cpu import decode as _cpu_decode
from ..models import decode_plan as _dp


def norm(weight: torch.Tensor, eps) -> types.SimpleNamespace:
    """An RMSNorm as the plan reads it: `weight` (what the plan multiplies by), `eps`."""
    return types.SimpleNamespace(weight=weight, eps=float(eps))


def fused_linear(*weights: torch.Tensor) -> _dp.StackedRows:
    """A projection the plan reads, fused from several of transformers' bias-free `nn.Linear` weights stacked by
    rows: read in place (no copy), or one matrix when a single weight is given (e.g. rows regrouped once)."""
    return _dp.StackedRows(weights)


def base_and_embedding(model: nn.Module, models: tuple, base: str, embedding: str) -> Union[tuple, str]:
    """(base model `model.<base>`, its embedding `<embedding>`, the weights' dtype) of a model whose class is one of
    `models`, or why the plan cannot compute it."""
    if type(model).__name__ not in models:
        return f"{type(model).__name__} is not one of {models}"
    inner = getattr(model, base)
    embed = getattr(inner, embedding)
    wdt = embed.weight.dtype
    if _dp.compute_dtype(wdt) is None:
        return f"weights in {wdt} (the plan reads fp32, fp64, bf16)"
    return inner, embed, wdt


def model_description(model: nn.Module, embed: nn.Module, blocks: list, final_norm: nn.Module, norm_class: str,
                      wdt: torch.dtype) -> Union[_dp.ModelDescription, str]:
    """The ModelDescription of described blocks with transformers' plain RMSNorm `final_norm` (of class
    `norm_class`: its eps is `variance_epsilon`) and `model.lm_head` (tied or not), or why the plan cannot read
    them."""
    if type(final_norm).__name__ != norm_class or final_norm.weight.dtype != wdt:
        return f"a final norm that is not transformers' {norm_class}"
    head = model.lm_head
    desc = _dp.ModelDescription(embed, blocks, None, None if head.weight is embed.weight else head)
    if not _dp.model_weights_usable(desc, wdt):   # (the final norm checked above)
        return "an embedding or head the plan does not read (a bias, another dtype, a hook)"
    desc.norm = norm(final_norm.weight, final_norm.variance_epsilon)
    return desc


def description(got: Union[tuple, str]) -> Optional[tuple]:
    """A `describe` answer as `describe_model` returns it: the description, or None."""
    return None if isinstance(got, str) else got


def reason(got: Union[tuple, str]) -> Optional[str]:
    """A `describe` answer as `undescribed_reason` returns it: why not, or None."""
    return got if isinstance(got, str) else None


def unpadded(attention_mask, B: int) -> bool:
    """Whether an attention mask (2-D, B rows, or None) keeps every position: no left padding."""
    return attention_mask is None or (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2
                                      and attention_mask.shape[0] == B and bool(attention_mask.all()))


def hookable(describe):
    """A description's `hookable(model)` where every model `describe` describes is hooked: described, and the
    compiled decode available."""
    return lambda model: not isinstance(describe(model), str) and _cpu_decode.available()
