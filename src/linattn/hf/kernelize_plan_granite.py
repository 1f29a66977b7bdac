"""A kernelized transformers Granite-4.0-H (`GraniteMoeHybridForCausalLM`) decoded through the compiled decode plan:
one call per token for the model.

Its pre-norm blocks (`input_layernorm` -> mixer, `post_attention_layernorm` -> feed-forward) each hold one of two
mixers, both plan blocks as they are:

* `GraniteMoeHybridMambaLayer`, Mamba2's mixer with Granite's class names: the plan's Mamba2 block (kind 5,
  `kernelize_plan_mamba2.mixer_plan`; the grouped gated norm `GraniteMoeHybridRMSNormGated`), the state kept as
  transformers keeps it (`[H, P, N]`);
* `GraniteMoeHybridAttention`: the softmax block with `attention_multiplier` as its score scale, RoPE over the
  whole head (fp32 angles) when `position_embedding_type` is "rope", no position otherwise.

The feed-forward is the shared MLP (`shared_mlp`: `input_linear` `[2 I, d]` = gate rows | up rows, one matrix read
in place, SiLU; `output_linear`), plus, when the model has experts (`num_local_experts` > 0), the sparse MoE block
beside it (`block_sparse_moe`: the router's weight and the experts' fused 3-D `gate_up_proj` / `down_proj` read in
place, `ffn_kind` 1 with the shared MLP as the ungated shared expert). Granite's router takes the top-k LOGITS and
a softmax over them; the plan's router mode 1 takes the top-k of the softmax over all experts and renormalises
them: the same experts (the softmax keeps the order; only two logits so close that their exponentials round to one
value could be chosen otherwise) and the same weights to rounding.

Granite's multipliers are plan fields: the embedded row times `embedding_multiplier` (model plan `emb_scale`),
each block's mixer output and feed-forward output times `residual_multiplier` before its residual add (block plan
`res_scaled` 2 with `res_b1` = `res_b2` = the multiplier), the logits divided by `logits_scaling` (model plan
`logits_div`). The multipliers the modules hold are checked on every token (`decode_plan.PlanGuard`);
`config.logits_scaling`, which the forward reads from the
config, is read when the plan is built.

What the plan does not compute makes the whole model step aside (`undescribed_reason` says why): attention or MLP
biases, a `time_step_limit` other than (0, inf), a RoPE type other than the default, `output_router_logits`,
modules that are not exactly transformers'. The hook's other conditions (grad, torch.compile, left padding,
position ids at the cache's length, the cache) are hf/kernelize_plan.py's.
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
MODELS = ("GraniteMoeHybridForCausalLM",)


def _attention(att, rotary, d: int, wdt) -> Union[_dp.AttentionDescription, str]:
    """transformers' `GraniteMoeHybridAttention` as the softmax kind computes it, or why not."""
    if type(att).__name__ != "GraniteMoeHybridAttention":
        return f"an attention layer of type {type(att).__name__}"
    cfg, m = att.config, att._modules
    H, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, att.head_dim
    why = _parts.gqa_projections_reason(m, H, G, D, d, wdt)
    if why:
        return why
    rot, inv, scale = 0, None, 1.0
    if rotary is not None:
        if (type(rotary).__name__ != "GraniteMoeHybridRotaryEmbedding"
                or getattr(rotary, "rope_type", None) != "default"):
            return "a rotary embedding other than the default RoPE"
        inv = rotary.inv_freq.detach().to(torch.float64)
        rot, scale = 2 * inv.numel(), float(rotary.attention_scaling)
        if rot > D:
            return "a rotary embedding wider than a head"
    return _dp.AttentionDescription(
        q_proj=m["q_proj"], k_proj=m["k_proj"], v_proj=m["v_proj"], o_proj=m["o_proj"], heads=H, kv_heads=G,
        head_dim=D, head_dim_v=D, scale=float(att.scaling), window=None, q_norm=None, k_norm=None, norm_offset=0,
        rot=rot, inv_freq=inv, rope_f32=True, rope_scale=scale, gate=None, g_proj=None, gate_act="silu",
        kv_chunk=_parts.KV_CHUNK)


def _shared_mlp(mlp, d: int, wdt) -> Union[tuple, str]:
    """(gate | up as one matrix, down) of transformers' `GraniteMoeHybridMLP`, or why not."""
    if type(mlp).__name__ != "GraniteMoeHybridMLP":
        return f"a shared MLP of type {type(mlp).__name__}"
    m = mlp._modules
    inp, out = m.get("input_linear"), m.get("output_linear")
    hid = getattr(out, "in_features", 0)
    if not (hid > 0 and _parts.plain_linear(inp, (2 * hid, d), wdt) and _parts.plain_linear(out, (d, hid), wdt)):
        return "a shared MLP whose projections are not bias-free nn.Linear layers of the model's dtype"
    if type(mlp.activation).__name__ not in ("SiLU", "SiLUActivation"):
        return "a shared MLP activation other than SiLU"
    return inp, out


def _moe(moe, d: int, wdt) -> Union[_dp.MoEDescription, str]:
    """transformers' `GraniteMoeHybridMoE` as the plan's router mode 1 (renormalised top-k) reads it, or why not."""
    if type(moe).__name__ != "GraniteMoeHybridMoE":
        return f"a MoE block of type {type(moe).__name__}"
    router, experts = moe._modules.get("router"), moe._modules.get("experts")
    if (type(router).__name__ != "GraniteMoeHybridTopKRouter" or set(router._parameters) != {"weight"}
            or type(experts).__name__ != "GraniteMoeHybridExperts"
            or set(experts._parameters) != {"gate_up_proj", "down_proj"}
            or type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation")):
        return "a MoE block whose router or experts are not transformers' top-k router and fused SiLU experts"
    desc = _dp.MoEDescription(router.weight.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(),
                              router.top_k, True)
    if not _dp.moe_usable(desc, d, wdt):
        return "a MoE block whose router or experts the plan does not read (shapes, dtype, layout)"
    return desc


def _norm(module, wdt) -> Optional[object]:
    if type(module).__name__ != "GraniteMoeHybridRMSNorm" or module.weight.dtype != wdt:
        return None
    return _parts.norm(module.weight, module.variance_epsilon)


def _describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer (Mamba2 mixer or None, residual multiplier)) or the reason the plan does not
    compute the model."""
    got = _parts.base_and_embedding(model, MODELS, "model", "embed_tokens")
    if isinstance(got, str):
        return got
    base, embed, wdt = got
    if getattr(model.config, "output_router_logits", False):
        return "output_router_logits set (the plan returns no router logits)"
    d = embed.weight.shape[1]
    blocks, parts = [], []
    for i, layer in enumerate(base.layers):
        if type(layer).__name__ != "GraniteMoeHybridDecoderLayer":
            return f"layer {i}: a block of type {type(layer).__name__}"
        ffn = _shared_mlp(layer._modules.get("shared_mlp"), d, wdt)
        moe = None
        if isinstance(ffn, str):
            return f"layer {i}: {ffn}"
        if layer._modules.get("block_sparse_moe") is not None:
            moe = _moe(layer.block_sparse_moe, d, wdt)
            if isinstance(moe, str):
                return f"layer {i}: {moe}"
        if layer.block_type == "linear_attention" and layer._modules.get("mamba") is not None:
            mixer, att = layer.mamba, None
            why = _mamba2.mixer_reason(mixer, d, wdt, "GraniteMoeHybridMambaLayer", "GraniteMoeHybridRMSNormGated")
        elif layer.block_type == "full_attention" and layer._modules.get("self_attn") is not None:
            mixer = layer.self_attn
            att = _attention(mixer, base.rotary_emb, d, wdt)
            why = att if isinstance(att, str) else None
        else:
            return f"layer {i}: a block of type {layer.block_type}"
        if why is not None:
            return f"layer {i}: {why}"
        n1, n2 = (_norm(layer._modules.get(n), wdt) for n in ("input_layernorm", "post_attention_layernorm"))
        if n1 is None or n2 is None:
            return f"layer {i}: block norms that are not transformers' GraniteMoeHybridRMSNorm"
        blocks.append(_dp.BlockDescription(mixer, "softmax" if att is not None else "mamba2", n1, n2,
                                           "swiglu" if moe is None else "moe", ffn[0], ffn[1], attention=att,
                                           moe=moe))
        parts.append((None if att is not None else mixer, float(layer.residual_multiplier)))
    desc = _parts.model_description(model, embed, blocks, base.norm, "GraniteMoeHybridRMSNorm", wdt)
    if isinstance(desc, str):
        return desc
    return desc, parts


def describe_model(model: nn.Module):
    """(ModelDescription, per-layer (Mamba2 mixer or None, residual multiplier)) of a transformers Granite-4.0-H
    model, or None where the plan does not compute some part of it (`undescribed_reason` says which)."""
    return _parts.description(_describe(model))


def undescribed_reason(model: nn.Module) -> Optional[str]:
    """Why a Granite-4.0-H model does not decode through the compiled plan, or None when it does."""
    return _parts.reason(_describe(model))


def _block_plan(part, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    mx, res = part
    p = _dp.new_softmax_plan(bd, B, d, wdt) if mx is None else _mamba2.mixer_plan(mx, bd, B, d, wdt)
    if p is not None and res != 1.0:
        p.res_scaled, p.res_a1, p.res_b1, p.res_a2, p.res_b2 = 2, 1.0, res, 1.0, res
    return p


def state_spec(part) -> tuple:
    mx = part[0]
    return ("softmax", 0, 0, 0, 0, ()) if mx is None else _mamba2.state_spec(mx)


def model_fields(model: nn.Module) -> dict:
    """The model plan's multipliers: `embedding_multiplier` on the embedded row, `logits_scaling` dividing the
    logits."""
    emb, div = float(model.model.embedding_multiplier), float(model.config.logits_scaling)
    return {"emb_scaled": int(emb != 1.0), "emb_scale": emb, "logits_scaled": int(div != 1.0), "logits_div": div}


def call_usable(cache, B: int, L, attention_mask, position_ids) -> bool:
    """No left padding, position ids (if given) at the cache's length; a model without attention layers (whose
    cache reports no length) takes no positions."""
    if L is None:
        return _parts.unpadded(attention_mask, B)
    return _parts.cached_call_usable(cache, B, L, attention_mask, position_ids)


output_class = _parts.moe_output_class


# -- the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) ----------
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS
FP32_LOGITS = False
describe, block_plan = _describe, _block_plan
base = operator.attrgetter("model")
hookable = _parts.hookable(_describe)
