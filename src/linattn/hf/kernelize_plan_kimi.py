"""A kernelized transformers Kimi Linear decoded through the compiled decode plan: one call per token for the model.

`KimiLinearForCausalLM`'s KDA layers map onto the plan's KDA block (kind 4, `cpu/csrc/decode_kda.h`) with one
regrouping, made once when the plan is built:

* `q_proj | k_proj | v_proj | b_proj | forget_gate.f_a_proj | g_a_proj` fused into the plan's one first product
  `[q | k | v | b | f1 | g1]` (the forget gate's and the output gate's low-rank first stages among them);
* `conv1d` (depthwise over q | k | v, SiLU) as the plan's short convolution, its conv state kept as transformers';
* `forget_gate`: `f_b_proj` is the gate's second stage, `dt_bias` per key channel, `-exp(A_log)` per head, the
  softplus log-decay per key channel (transformers' threshold 20 is the plan's);
* beta = sigmoid(b), q / k L2-normalised (transformers' `x / sqrt(sum x^2 + 1e-6)`, fla's; the plan's "rsqrt" row
  agrees to rounding), scale `head_dim ** -0.5`;
* `o_norm` (per-head RMSNorm, then times sigmoid of the gate) with `g_b_proj` as the gate's second stage;
* the block norms and the final norm as they are (plain RMSNorm weights), `gate_proj | up_proj` read in place.

Its MLA layers (`KimiLinearAttention`: every real checkpoint has them) map onto the plan's latent-attention block
(kind 7, `cpu/csrc/decode_mla.h`; `kernelize_plan_parts.mla_plan`): `q_proj` (or `q_a_proj`, its norm and
`q_b_proj`) and `kv_a_proj_with_mqa` read in place as one first product, the latent's RMSNorm `kv_a_layernorm`,
`kv_b_proj` applied to q and to the weighted latents (never to the whole cache), no position (NoPE: the rope part of
the key is the raw shared `k_rot`), softmax over the cache, `o_proj`. transformers' cache holds the layer's normed
latents `[B, 1, T, kv_lora_rank]` as its keys and the shared `k_rot` `[B, 1, T, qk_rope_head_dim]` as its values:
the plan writes the new row into a mirror buffer of which the cache's tensors are views after every token.

Its MoE feed-forwards (`KimiLinearMoE`, DeepSeek-V3's) are the plan's MoE FFN with router mode 2
(`kernelize_plan_parts.deepseek_moe`, `csrc/decode_moe.h`): sigmoid scores, the `e_score_correction_bias` for the
choice only, grouped top-k, renormalised (`moe_renormalize`) and times `routed_scaling_factor`, each chosen expert
read in place from the fused 3-D `gate_up_proj` / `down_proj`, the ungated shared experts; the dense first layers
are SwiGLU MLPs.

What the plan does not compute makes the whole model step aside (every cached token then runs transformers'
forward, as kernelize serves it; `describe_model` says why): another activation, conv bias, attention biases,
grouped key/value heads, `output_router_logits`, modules that are not exactly transformers'.

A model with MLA layers decodes as transformers' does (the cache reports its length; an attention mask and
position ids, if given, must keep every position and be at the cache's length). A model of KDA layers only: its
cache cannot report a sequence length (`DynamicCache.get_seq_length` raises without an attention layer), so its
`generate` and a plain cached forward fail on them; transformers' forward runs them given explicit `position_ids`
and the per-layer-type masks as a dict (`{"full_attention": None, "linear_attention": None}`), and so does the hook.

transformers' cache objects stay valid after every token: each KDA layer's recurrent state becomes a view of the
step's output buffer (a copy where the layer keeps another dtype), its conv state (the last K inputs; the plan keeps
K - 1) is shifted and copied; each MLA layer's keys / values are views of its mirror. The hook steps aside for:
grad enabled, torch.compile tracing, more than one token, `inputs_embeds`, labels, a KDA-only model called without
`position_ids`, an attention mask with a zero (left padding; in a dict of masks, a "linear_attention" mask; a model
with MLA layers given a dict), a cache that is not a `DynamicCache` of exactly these layers or that records its
past, a hook on a described module, non-CPU tensors or dtypes without a plan, `LINATTN_CPU_KERNELS=0`.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from ..models import decode_plan as _dp
from . import kernelize_plan_parts as _parts

__all__ = ["MODELS", "describe_model", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("KimiLinearForCausalLM",)


class _KDA:
    """A transformers `KimiLinearDeltaAttention` as the plan's KDA block reads it: the fused first product W (its
    six projections: `kernelize_plan_parts.fused_linear`)."""

    __slots__ = ("layer", "H", "K", "KC", "W")

    def __init__(self, layer):
        self.layer, self.H, self.K, self.KC = layer, layer.num_heads, layer.head_dim, layer.conv_kernel_size
        self.W = _parts.fused_linear(*_first(layer))


def _first(layer) -> tuple:
    """The projections of a KDA layer's fused first product, in the plan's order."""
    m, fg = layer._modules, layer._modules["forget_gate"]._modules
    return m["q_proj"], m["k_proj"], m["v_proj"], m["b_proj"], fg["f_a_proj"], m["g_a_proj"]


def _kda_reason(layer, d: int, wdt) -> Optional[str]:
    """Why the plan's KDA block does not compute this layer, or None."""
    if type(layer).__name__ != "KimiLinearDeltaAttention":
        return f"an attention layer of type {type(layer).__name__}"
    m = layer._modules
    fg = m.get("forget_gate")
    H, K = layer.num_heads, layer.head_dim
    HK = H * K
    if type(fg).__name__ != "KimiLinearForgetGate" or fg.num_heads != H or fg.head_dim != K:
        return "a forget gate that is not transformers' KimiLinearForgetGate of the layer's heads"
    f = fg._modules
    shapes = {"q_proj": (HK, d), "k_proj": (HK, d), "v_proj": (HK, d), "b_proj": (H, d), "g_a_proj": (K, d),
              "g_b_proj": (HK, K), "o_proj": (d, HK)}
    ok = _parts.plan_projection
    if not all(ok(m.get(n), s, wdt) for n, s in shapes.items()) or not (
            ok(f.get("f_a_proj"), (K, d), wdt) and ok(f.get("f_b_proj"), (HK, K), wdt)):
        return f"projections of the expected shapes that are {_parts.NOT_PLAN_PROJECTIONS}"
    why = _parts.fusion_reason(*_first(layer))
    if why:
        return why
    return _parts.kda_conv_norm_reason(layer, "KimiLinearRMSNormGated", wdt)


def describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer part: `_KDA` or `kernelize_plan_parts.MLA`, with its router for an MoE block)
    or the reason the plan does not compute the model."""
    return _parts.describe_mla_kda_model(model, MODELS, _kda_reason, _KDA, "KimiLinearAttention", "KimiLinearMLP",
                                         "KimiLinearRMSNorm")


describe_model, undescribed_reason = _parts.public_description(describe, "a transformers Kimi Linear model")


def _kda_plan(k: _KDA, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    """The plan's KDA block (kind 4) for a transformers KDA layer: y = [q | k | v | b | f1 | g1]."""
    m, fg = k.layer._modules, k.layer.forget_gate
    return _parts.kda_plan(k.H, k.K, k.KC, k.W, m["conv1d"], fg.A_log, fg.dt_bias, m["o_norm"], m["o_proj"], bd, B,
                           d, wdt, Wf=fg._modules["f_b_proj"], Wg2=m["g_b_proj"])


def call_usable(cache, B: int, L, attention_mask, position_ids) -> bool:
    if L is not None:   # MLA layers: the position is the cache's length, as transformers' forward takes it
        return type(attention_mask) is not dict and _parts.cached_call_usable(cache, B, L, attention_mask,
                                                                               position_ids)
    if not isinstance(position_ids, torch.Tensor):
        return False   # (transformers' forward reports the missing length)
    if type(attention_mask) is dict:   # (the per-layer-type masks transformers' forward takes as they are)
        attention_mask = attention_mask.get("linear_attention", 0)
    return _parts.unpadded(attention_mask, B)


output_class = _parts.moe_output_class


# -- the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) ----------
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS
FP32_LOGITS = False
block_plan = _parts.mla_kda_block_plan(_kda_plan)
base = _parts.base_model
hookable = _parts.hookable(describe)   # (False where `undescribed_reason` says why)


def _kda_state_spec(k: _KDA) -> tuple:
    return ("delta", k.H, k.K, k.K, k.KC, (k.H * k.K,) * 3)


state_spec = _parts.mla_kda_state_spec(_kda_state_spec)
