"""A kernelized transformers Bailing hybrid decoded through the compiled decode plan: one call per token for the model.

`BailingHybridForCausalLM`'s blocks are pre-norm (`input_layernorm`, `post_attention_layernorm`, plain RMSNorm
weights). Its KDA layers (`BailingHybridDeltaAttention`) map onto the plan's KDA block (kind 4,
`cpu/csrc/decode_kda.h`) with FULL-RANK gates, made once when the plan is built:

* `q_proj | k_proj | v_proj | b_proj | forget_gate.f_proj | g_proj` fused into the plan's one first product
  `[q | k | v | b | f | gate]` (the forget gate `[H K, d]` and the output gate `[H K, d]` full rank: the block's
  `rank_f` / `rank_g` 0);
* `conv1d` (depthwise over q | k | v, SiLU) as the plan's short convolution;
* the forget gate per key channel: `kda_lower_bound * sigmoid(exp(A_log) (f + dt_bias))` with `kda_safe_gate` (the
  plan's lower-bounded gate), else `-exp(A_log) softplus(f + dt_bias)`;
* beta = sigmoid(b), q / k L2-normalised as transformers' (`x * rsqrt(sum x^2 + 1e-6)`), scale `head_dim ** -0.5`;
* `o_norm` (per-head RMSNorm times sigmoid of the gate), `o_proj`; the MLP's `gate_proj | up_proj` concatenated
  once.

Its MLA layers (`BailingHybridAttention`: every released checkpoint has them, the last of each group of
`layer_group_size`) map onto the plan's latent-attention block (kind 7, `cpu/csrc/decode_mla.h`;
`kernelize_plan_parts.mla_plan`): `q_proj` (or `q_a_proj`, its norm, `q_b_proj`), `kv_a_proj_with_mqa` and the
head-wise gate `g_proj` read in place as one first product; the latent's RMSNorm `kv_a_layernorm`; DeepSeek's
interleaved RoPE (the base model's default rotary embedding, angles in fp32 as transformers') on q's rope part and
the shared key part; `kv_b_proj` applied to q and to the weighted latents; softmax over the cache; each head's output
times sigmoid of its gate; `o_proj`. transformers' cache holds the normed latents as the layer's keys and the
rotated shared keys as its values, views of the plan's mirror buffer after every token. Its MoE feed-forwards
(`BailingHybridMoE`, DeepSeek-V3's: sigmoid scores, correction bias for the choice, grouped top-k, routed scaling
factor, shared experts) are the plan's MoE FFN with router mode 2 (`kernelize_plan_parts.deepseek_moe`); the first
`first_k_dense_replace` layers' dense MLPs are SwiGLU MLPs.

What the plan does not compute makes the whole model step aside (every cached token then runs transformers'
forward, as kernelize serves it; `undescribed_reason` says why): another activation, conv bias, attention biases,
a RoPE other than the default one (YaRN), grouped key/value heads, `output_router_logits`, modules that are not
exactly transformers'.

The call checks and the output class are Kimi Linear's (hf/kernelize_plan_kimi.py): a model with MLA layers decodes
as transformers' does; a KDA-only one (its cache reports no length, so its `generate` fails before and after
kernelize) given explicit `position_ids` and the per-layer-type masks as a dict. The cache objects stay valid after
every token (each KDA layer's recurrent state a view of the step's buffer, its conv state shifted and copied; each
MLA layer's keys and values views of its mirror).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from ..models import decode_plan as _dp
from . import kernelize_plan_kimi as _kimi, kernelize_plan_parts as _parts

__all__ = ["MODELS", "describe_model", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("BailingHybridForCausalLM",)


class _KDA:
    """A transformers `BailingHybridDeltaAttention` as the plan's KDA block reads it: the fused first product W."""

    __slots__ = ("layer", "H", "K", "KC", "W")

    def __init__(self, layer):
        self.layer, self.H, self.K, self.KC = layer, layer.num_heads, layer.head_dim, layer.conv_kernel_size
        self.W = _parts.fused_linear(*_first(layer))


def _first(layer) -> tuple:
    """The projections of a KDA layer's fused first product, in the plan's order."""
    m = layer._modules
    return m["q_proj"], m["k_proj"], m["v_proj"], m["b_proj"], m["forget_gate"].f_proj, m["g_proj"]


def _kda_reason(layer, d: int, wdt) -> Optional[str]:
    """Why the plan's KDA block does not compute this layer, or None."""
    if type(layer).__name__ != "BailingHybridDeltaAttention":
        return f"an attention layer of type {type(layer).__name__}"
    m = layer._modules
    fg = m.get("forget_gate")
    H, K = layer.num_heads, layer.head_dim
    HK = H * K
    if type(fg).__name__ != "BailingHybridForgetGate" or fg.num_heads != H or fg.head_dim != K:
        return "a forget gate that is not transformers' BailingHybridForgetGate of the layer's heads"
    shapes = {"q_proj": (HK, d), "k_proj": (HK, d), "v_proj": (HK, d), "b_proj": (H, d), "g_proj": (HK, d),
              "o_proj": (d, HK)}
    if not all(_parts.plan_projection(m.get(n), s, wdt) for n, s in shapes.items()) or not _parts.plan_projection(
            fg._modules.get("f_proj"), (HK, d), wdt):
        return f"projections of the expected shapes that are {_parts.NOT_PLAN_PROJECTIONS}"
    why = _parts.fusion_reason(*_first(layer))
    if why:
        return why
    return _parts.kda_conv_norm_reason(layer, "BailingHybridRMSNormGated", wdt)


def describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer part: `_KDA` or `kernelize_plan_parts.MLA`, with its router for an MoE block)
    or the reason the plan does not compute the model."""
    return _parts.describe_mla_kda_model(model, MODELS, _kda_reason, _KDA, "BailingHybridAttention",
                                         "BailingHybridMLP", "BailingHybridRMSNorm",
                                         rotary=getattr(model.model, "rotary_emb", None), gated=True)


describe_model, undescribed_reason = _parts.public_description(describe, "a transformers Bailing hybrid")


def _kda_plan(k: _KDA, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    """The plan's KDA block (kind 4) with full-rank gates: y = [q | k | v | b | f | gate]."""
    m, fg = k.layer._modules, k.layer.forget_gate
    return _parts.kda_plan(k.H, k.K, k.KC, k.W, m["conv1d"], fg.A_log, fg.dt_bias, m["o_norm"], m["o_proj"], bd, B,
                           d, wdt, gate_lb=fg.lower_bound if fg.safe_gate else None)


# -- the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol): Kimi
#    Linear's but for the blocks ---------------------------------------------------------------------------------
FAST_KWARGS, FP32_LOGITS = _parts.CAUSAL_LM_KWARGS, False
call_usable, output_class = _kimi.call_usable, _kimi.output_class
block_plan = _parts.mla_kda_block_plan(_kda_plan)
base = _parts.base_model
hookable = _parts.hookable(describe)   # (False where `undescribed_reason` says why)


state_spec = _kimi.state_spec
