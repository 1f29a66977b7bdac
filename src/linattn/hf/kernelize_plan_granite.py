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

from typing import Union

import torch
import torch.nn as nn

from ..models import decode_plan as _dp
from . import kernelize_plan_mamba2 as _mamba2, kernelize_plan_parts as _parts

__all__ = ["MODELS", "describe_model", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("GraniteMoeHybridForCausalLM",)


def _shared_mlp(mlp, d: int, wdt) -> Union[tuple, str]:
    """(gate | up as one matrix, down) of transformers' `GraniteMoeHybridMLP`, or why not."""
    if type(mlp).__name__ != "GraniteMoeHybridMLP":
        return f"a shared MLP of type {type(mlp).__name__}"
    m = mlp._modules
    inp, out = m.get("input_linear"), m.get("output_linear")
    hid = getattr(out, "in_features", 0)
    if not (hid > 0 and _parts.plan_projection(inp, (2 * hid, d), wdt) and _parts.plan_projection(out, (d, hid), wdt)):
        return f"a shared MLP whose projections are {_parts.NOT_PLAN_PROJECTIONS}"
    if type(mlp.activation).__name__ not in ("SiLU", "SiLUActivation"):
        return "a shared MLP activation other than SiLU"
    return inp, out


def _moe(moe, d: int, wdt) -> Union[_dp.MoEDescription, str]:
    """transformers' `GraniteMoeHybridMoE` as the plan's router mode 1 (renormalised top-k) reads it, or why not."""
    if type(moe).__name__ != "GraniteMoeHybridMoE":
        return f"an MoE block of type {type(moe).__name__}"
    router, experts = moe._modules.get("router"), moe._modules.get("experts")
    if (type(router).__name__ != "GraniteMoeHybridTopKRouter" or set(router._parameters) != {"weight"}
            or type(experts).__name__ != "GraniteMoeHybridExperts"
            or set(experts._parameters) != {"gate_up_proj", "down_proj"}
            or type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation")):
        return "an MoE block whose router or experts are not transformers' top-k router and fused SiLU experts"
    return _parts.renormalised_topk_moe(router, experts, d, wdt)


def _block(layer, base, d: int, wdt) -> Union[tuple, str]:
    """(BlockDescription, (Mamba2 mixer or None, residual multiplier)) of a Granite-4.0-H block, or why not."""
    if type(layer).__name__ != "GraniteMoeHybridDecoderLayer":
        return f"a block of type {type(layer).__name__}"
    ffn = _shared_mlp(layer._modules.get("shared_mlp"), d, wdt)
    if isinstance(ffn, str):
        return ffn
    moe = None
    if layer._modules.get("block_sparse_moe") is not None:
        moe = _moe(layer.block_sparse_moe, d, wdt)
        if isinstance(moe, str):
            return moe
    if layer.block_type == "linear_attention" and layer._modules.get("mamba") is not None:
        mixer, att = layer.mamba, None
        why = _mamba2.mixer_reason(mixer, d, wdt, "GraniteMoeHybridMambaLayer", "GraniteMoeHybridRMSNormGated")
    elif layer.block_type == "full_attention" and layer._modules.get("self_attn") is not None:
        mixer, rotary = layer.self_attn, base.rotary_emb
        att = _parts.softmax_attention(mixer, "GraniteMoeHybridAttention", d, wdt, rotary,
                                       None if rotary is None else "part")
        why = att if isinstance(att, str) else None
    else:
        return f"a block of type {layer.block_type}"
    if why is not None:
        return why
    norms = _parts.block_norms(layer, ("input_layernorm", "post_attention_layernorm"), "GraniteMoeHybridRMSNorm",
                               wdt)
    if isinstance(norms, str):
        return norms
    bd = _dp.BlockDescription(mixer, "softmax" if att is not None else "mamba2", *norms,
                              "swiglu" if moe is None else "moe", ffn[0], ffn[1], attention=att, moe=moe)
    return bd, (None if att is not None else mixer, float(layer.residual_multiplier))


def describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer (Mamba2 mixer or None, residual multiplier)) or the reason the plan does not
    compute the model."""
    return _parts.describe_layers(model, MODELS, "model", "embed_tokens", _block, "norm", "GraniteMoeHybridRMSNorm")


describe_model, undescribed_reason = _parts.public_description(describe, "a transformers Granite-4.0-H model")


def block_plan(part, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
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


#: no left padding, position ids (if given) at the cache's length; a model without attention layers (whose cache
#: reports no length) takes no positions
call_usable = _parts.call_usable("cache")
output_class = _parts.moe_output_class


# -- the rest of the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) -
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS
FP32_LOGITS = False
base = _parts.base_model
hookable = _parts.hookable(describe)
