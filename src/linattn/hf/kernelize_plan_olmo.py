"""A kernelized transformers OLMo-hybrid decoded through the compiled decode plan: one call per token for the model.

`OlmoHybridForCausalLM` alternates two block kinds, both described to the plan (`models/decode_plan.py`):

* Gated DeltaNet blocks, pre-norm (`input_layernorm` before the mixer, `post_attention_layernorm` before the MLP):
  the plan's delta block (kind 0, gated, `kernelize_plan_parts.gdn_plan`) with `q_proj | k_proj | v_proj | b_proj |
  a_proj | g_proj` fused once into its `[q | k | v | b | a | gate]` projection, the depthwise `conv1d` (SiLU),
  `-exp(A_log)` / `dt_bias`, the gated output RMSNorm `o_norm` (eps 1e-5, SiLU gate), `o_proj`; beta = 2 sigmoid(b)
  with `linear_allow_neg_eigval` (the plan's "doubled" beta), else sigmoid(b);
* softmax-attention blocks, POST-norm: ``h = x + post_attention_layernorm(attn(x))``, ``out = h +
  post_feedforward_layernorm(mlp(h))`` (the block plan's `postnorm` order), the attention's `q_norm` / `k_norm`
  RMSNorms over the whole q and k projections (every head at once, before RoPE: the softmax kind's whole-projection
  q/k norm), full RoPE with fp32 angles when the model has a rotary embedding, none (NoPE, the released
  checkpoints) when it has not; no output gate.

The norms are plain RMSNorms (weights as they are), `gate_proj | up_proj` read in place as one product, the head
tied or not.

What the plan does not compute makes the whole model step aside (every cached token runs transformers' forward, as
kernelize serves it; `undescribed_reason` says why): attention biases, a RoPE type other than the default, q / k
norms of different eps, modules that are not exactly transformers' (a subclass, another activation, a conv bias),
weights in another dtype. The hook's other conditions (grad, torch.compile, left padding, position ids, the cache)
are hf/kernelize_plan.py's.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from ..models import decode_plan as _dp
from . import kernelize_plan_parts as _parts

__all__ = ["MODELS", "describe_model", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("OlmoHybridForCausalLM",)

#: the GDN projections in the order of the plan's fused rows `[q | k | v | b | a | gate]`
_GDN_ROWS = ("q_proj", "k_proj", "v_proj", "b_proj", "a_proj", "g_proj")


class _GDN:
    """A transformers `OlmoHybridGatedDeltaNet` as the plan's delta block reads it: the fused projection W (its parts:
    `kernelize_plan_parts.fused_linear`) and its beta mode."""

    __slots__ = ("layer", "H", "HV", "K", "V", "KC", "W", "beta_mode")

    def __init__(self, layer):
        self.layer, self.H, self.HV = layer, layer.num_k_heads, layer.num_v_heads
        self.K, self.V, self.KC = layer.head_k_dim, layer.head_v_dim, layer.conv_kernel_size
        self.W = _parts.fused_linear(*map(layer._modules.get, _GDN_ROWS))
        self.beta_mode = "doubled" if layer.allow_neg_eigval else "sigmoid"


def _gdn_reason(layer, d: int, wdt) -> Optional[str]:
    """Why the plan's delta block does not compute this Gated DeltaNet layer, or None."""
    if type(layer).__name__ != "OlmoHybridGatedDeltaNet":
        return f"a linear-attention layer of type {type(layer).__name__}"
    H, HV, K, V, KC = (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim,
                       layer.conv_kernel_size)
    m = layer._modules
    shapes = {"q_proj": (H * K, d), "k_proj": (H * K, d), "v_proj": (HV * V, d), "b_proj": (HV, d),
              "a_proj": (HV, d), "g_proj": (HV * V, d), "o_proj": (d, HV * V)}
    if HV % H or not all(_parts.plan_projection(m.get(n), s, wdt) for n, s in shapes.items()):
        return f"projections of the expected shapes that are {_parts.NOT_PLAN_PROJECTIONS}"
    why = _parts.fusion_reason(*map(m.get, _GDN_ROWS))
    if why:
        return why
    conv = m.get("conv1d")
    C = 2 * H * K + HV * V
    if (type(conv) is not nn.Conv1d or conv.bias is not None or tuple(conv.weight.shape) != (C, 1, KC)
            or conv.groups != C or layer.activation not in ("silu", "swish")):
        return "a short convolution that is not a bias-free depthwise SiLU nn.Conv1d"
    norm = m.get("o_norm")
    if (type(norm).__name__ != "OlmoHybridRMSNormGated" or getattr(norm, "activation", None) != "silu"
            or tuple(norm.weight.shape) != (V,)):
        return "an output norm that is not a per-head RMSNorm with a SiLU gate"
    if layer.A_log.shape != (HV,) or layer.dt_bias.shape != (HV,):
        return "A_log / dt_bias of unexpected shapes"
    return None


def _attention(att, rotary, d: int, wdt) -> Union[_dp.AttentionDescription, str]:
    """transformers' `OlmoHybridAttention` as the softmax kind computes it (its q / k norms over the whole
    projections), or why not."""
    desc = _parts.softmax_attention(att, "OlmoHybridAttention", d, wdt, rotary, None if rotary is None else "whole")
    if isinstance(desc, str):
        return desc
    m = att._modules
    qn, kn = (_parts.rms_norm(m.get(n), "OlmoHybridRMSNorm", wdt) for n in ("q_norm", "k_norm"))
    if (qn is None or kn is None or qn.weight.shape != (desc.heads * desc.head_dim,)
            or kn.weight.shape != (desc.kv_heads * desc.head_dim,) or qn.eps != kn.eps):
        return "q / k norms that are not RMSNorms over the whole projections with one eps"
    desc.q_norm, desc.k_norm, desc.norm_whole = qn, kn, True
    return desc


def _block(layer, base, d: int, wdt) -> Union[tuple, str]:
    """(BlockDescription, `_GDN` or None) of an OLMo-hybrid block, or why not."""
    ffn = _parts.swiglu_ffn(layer.mlp, "OlmoHybridMLP", d, wdt)
    if isinstance(ffn, str):
        return ffn
    kind = type(layer).__name__
    if kind == "OlmoHybridLinearAttentionDecoderLayer":   # pre-norm
        names, residual, mixer = ("input_layernorm", "post_attention_layernorm"), "prenorm", layer.linear_attn
        why = _gdn_reason(mixer, d, wdt)
        att, part = None, None if why else _GDN(mixer)
    elif kind == "OlmoHybridAttentionDecoderLayer":   # post-norm: the norms on the mixer's and the MLP's outputs
        names, residual, mixer = ("post_attention_layernorm", "post_feedforward_layernorm"), "postnorm", \
            layer.self_attn
        att, part = _attention(mixer, base.rotary_emb, d, wdt), None
        why = att if isinstance(att, str) else None
    else:
        return f"a block of type {kind}"
    if why is not None:
        return why
    norms = _parts.block_norms(layer, names, "OlmoHybridRMSNorm", wdt)
    if isinstance(norms, str):
        return norms
    bd = _dp.BlockDescription(mixer, "delta" if part is not None else "softmax", *norms, "swiglu", ffn[0], ffn[1],
                              residual=residual, attention=att)
    return bd, part


def describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer `_GDN` or None) or the reason the plan does not compute the model."""
    return _parts.describe_layers(model, MODELS, "model", "embed_tokens", _block, "norm", "OlmoHybridRMSNorm")


describe_model, undescribed_reason = _parts.public_description(describe, "a transformers OLMo-hybrid model")


def block_plan(g: Optional[_GDN], bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    if g is None:
        return _dp.new_softmax_plan(bd, B, d, wdt)
    m = g.layer._modules
    return _parts.gdn_plan(g.layer, g.W, m["o_norm"], m["o_proj"], bd, B, d, wdt, g.beta_mode)


def state_spec(g: Optional[_GDN]) -> tuple:
    if g is None:
        return ("softmax", 0, 0, 0, 0, ())
    return ("delta", g.HV, g.K, g.V, g.KC, (g.H * g.K, g.H * g.K, g.HV * g.V))


call_usable = _parts.cached_call_usable
output_class = _parts.causal_lm_output_class


# -- the rest of the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) -
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS
FP32_LOGITS = False
base = _parts.base_model
hookable = _parts.hookable(describe)
