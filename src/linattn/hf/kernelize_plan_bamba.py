"""A kernelized transformers Bamba decoded through the compiled decode plan: one call per token for the model.

`BambaForCausalLM`'s pre-norm blocks (`input_layernorm` -> mixer -> residual, `pre_ff_layernorm` -> `feed_forward`
-> residual) each hold one of two mixers, both plan blocks as they are:

* `BambaMixer`, Mamba2's mixer with Bamba's class names: the plan's Mamba2 block (kind 5,
  `kernelize_plan_mamba2.mixer_plan`: `in_proj` as `[z | xBC | dt]` read in place, the depthwise SiLU conv,
  `-exp(A_log)` / `dt_bias` / `D`, the grouped gated norm `BambaRMSNormGated`, `out_proj`), the state kept as
  transformers keeps it (`[H, P, N]`, the cache's tensor is the plan's);
* `BambaAttention`: the softmax block (no q / k norm, no output gate, partial RoPE on the first half of each head
  with fp32 angles, as `BambaRotaryEmbedding` computes them).

The feed-forward is `BambaMLP` (SiLU gate | up read in place as one product), the norms plain `BambaRMSNorm`s, the
head tied or not; the logits in the model's dtype, as transformers returns them.

What the plan does not compute makes the whole model step aside (`undescribed_reason` says why): projection or MLP
biases, a `time_step_limit` other than (0, inf), a RoPE type other than the default, modules that are not exactly
transformers'. A call without `position_ids` steps aside too (Bamba's forward then rotates the token as if at
position 0, whatever the cache holds; `generate` passes them). The hook's other conditions (grad, torch.compile,
left padding, position ids, the cache) are hf/kernelize_plan.py's.
"""
from __future__ import annotations

import operator
from typing import Optional, Union

import torch
import torch.nn as nn

from ..models import decode_plan as _dp
from . import kernelize_plan_mamba2 as _mamba2, kernelize_plan_parts as _parts

__all__ = ["MODELS", "describe_model", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("BambaForCausalLM",)


def _attention(att, rotary, d: int, wdt) -> Union[_dp.AttentionDescription, str]:
    """transformers' `BambaAttention` as the softmax kind computes it, or why not."""
    if type(att).__name__ != "BambaAttention":
        return f"an attention layer of type {type(att).__name__}"
    cfg, m = att.config, att._modules
    H, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, att.head_dim
    why = _parts.gqa_projections_reason(m, H, G, D, d, wdt)
    if why:
        return why
    if type(rotary).__name__ != "BambaRotaryEmbedding" or getattr(rotary, "rope_type", None) != "default":
        return "a rotary embedding other than the default RoPE"
    inv = rotary.inv_freq.detach().to(torch.float64)
    if 2 * inv.numel() > D:
        return "a rotary embedding wider than a head"
    return _dp.AttentionDescription(
        q_proj=m["q_proj"], k_proj=m["k_proj"], v_proj=m["v_proj"], o_proj=m["o_proj"], heads=H, kv_heads=G,
        head_dim=D, head_dim_v=D, scale=float(att.scaling), window=None, q_norm=None, k_norm=None, norm_offset=0,
        rot=2 * inv.numel(), inv_freq=inv, rope_f32=True, rope_scale=float(rotary.attention_scaling), gate=None,
        g_proj=None, gate_act="silu", kv_chunk=_parts.KV_CHUNK)


def _norm(module, wdt) -> Optional[object]:
    if type(module).__name__ != "BambaRMSNorm" or module.weight.dtype != wdt:
        return None
    return _parts.norm(module.weight, module.variance_epsilon)


def _describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer mixer or None) or the reason the plan does not compute the model."""
    got = _parts.base_and_embedding(model, MODELS, "model", "embed_tokens")
    if isinstance(got, str):
        return got
    base, embed, wdt = got
    d = embed.weight.shape[1]
    blocks, parts = [], []
    for i, layer in enumerate(base.layers):
        if type(layer).__name__ != "BambaDecoderLayer":
            return f"layer {i}: a block of type {type(layer).__name__}"
        ffn = _parts.swiglu_ffn(layer._modules.get("feed_forward"), "BambaMLP", d, wdt)
        if isinstance(ffn, str):
            return f"layer {i}: {ffn}"
        if layer.block_type == "linear_attention":
            mixer, att = layer.mamba, None
            why = _mamba2.mixer_reason(mixer, d, wdt, "BambaMixer", "BambaRMSNormGated")
        elif layer.block_type == "full_attention":
            mixer = layer.self_attn
            att = _attention(mixer, base.rotary_emb, d, wdt)
            why = att if isinstance(att, str) else None
        else:
            return f"layer {i}: a block of type {layer.block_type}"
        if why is not None:
            return f"layer {i}: {why}"
        n1, n2 = (_norm(layer._modules.get(n), wdt) for n in ("input_layernorm", "pre_ff_layernorm"))
        if n1 is None or n2 is None:
            return f"layer {i}: block norms that are not transformers' BambaRMSNorm"
        blocks.append(_dp.BlockDescription(mixer, "softmax" if att is not None else "mamba2", n1, n2, "swiglu",
                                           ffn[0], ffn[1], attention=att))
        parts.append(None if att is not None else mixer)
    desc = _parts.model_description(model, embed, blocks, base.final_layernorm, "BambaRMSNorm", wdt)
    if isinstance(desc, str):
        return desc
    return desc, parts


def describe_model(model: nn.Module):
    """(ModelDescription, per-layer Mamba2 mixer or None) of a transformers Bamba model, or None where the plan does
    not compute some part of it (`undescribed_reason` says which)."""
    return _parts.description(_describe(model))


def undescribed_reason(model: nn.Module) -> Optional[str]:
    """Why a Bamba model does not decode through the compiled plan, or None when it does."""
    return _parts.reason(_describe(model))


def _block_plan(mx, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    if mx is None:
        return _dp.new_softmax_plan(bd, B, d, wdt)
    return _mamba2.mixer_plan(mx, bd, B, d, wdt)


def state_spec(mx) -> tuple:
    return ("softmax", 0, 0, 0, 0, ()) if mx is None else _mamba2.state_spec(mx)


def _call_usable(cache, B: int, L, attention_mask, position_ids) -> bool:
    # (Bamba's forward takes a missing `position_ids` as 0, 1, ... whatever the cache holds; `generate` passes them)
    return position_ids is not None and _parts.cached_call_usable(cache, B, L, attention_mask, position_ids)


def output_class():
    from transformers.modeling_outputs import CausalLMOutputWithPast
    return CausalLMOutputWithPast


# -- the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) ----------
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS
FP32_LOGITS = False
describe, block_plan, call_usable = _describe, _block_plan, _call_usable
base = operator.attrgetter("model")
hookable = _parts.hookable(_describe)
