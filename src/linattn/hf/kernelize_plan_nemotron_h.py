"""A kernelized transformers Nemotron-H (`NemotronHForCausalLM`) decoded through the compiled decode plan: one call
per token for the model.

Every Nemotron-H block is ONE module behind one norm, ``out = x + mixer(norm(x))`` (`NemotronHBlock`), of four
types (`config.layers_block_type`), each a plan block:

* "linear_attention", `NemotronHMamba2Mixer`: the plan's Mamba2 block (kind 5, `kernelize_plan_mamba2.mixer_plan`:
  groups of B / C, the grouped gated norm `NemotronHRMSNormGated`), no feed-forward; its `time_step_limit`
  (time_step_min, inf) clamps transformers' chunked prefill only, not the one-token step the plan computes;
* "full_attention", `NemotronHAttention`: the softmax block without a position encoding (no RoPE), no
  feed-forward;
* "mlp", `NemotronHMLP`: a block of only a feed-forward (the block plan's `ffn_only`: h = x, the block's norm as the
  FFN's), non-gated relu^2, ``down(relu(up xn)^2)`` (`ffn_act` 1);
* "moe", `NemotronHMoE`: a block of only a mixture of experts: DeepSeek-V3's grouped sigmoid router with the
  score-correction bias and routed scaling (router mode 2, csrc/decode_moe.h), non-gated relu^2 experts read in
  place (`up_proj` `[E, I, d]`, `down_proj` `[E, d, I]`), the relu^2 shared expert.

The final norm `norm_f`, the head (never tied); the logits in fp32, as transformers' forward returns them.

What the plan does not compute makes the whole model step aside (`undescribed_reason` says why): biases, the MoE's
latent projections (`moe_latent_size`), an activation other than relu2, `output_router_logits`, modules that are
not exactly transformers'. The hook's other conditions (grad, torch.compile, left padding, the cache) are
hf/kernelize_plan.py's; positions are not read (no RoPE). transformers' cache holds no entry for MLP and MoE
blocks (`DummyLayer`s), which the plan leaves as they are.
"""
from __future__ import annotations

from typing import Union

import torch
import torch.nn as nn

from ..cpu import decode as _cpu_decode
from ..models import decode_plan as _dp
from . import kernelize_plan_mamba2 as _mamba2, kernelize_plan_parts as _parts

__all__ = ["MODELS", "describe_model", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("NemotronHForCausalLM",)

_RELU2 = ("ReLUSquaredActivation",)


def _mlp(mlp, d: int, wdt) -> Union[tuple, str]:
    """(up, down) of transformers' `NemotronHMLP` (non-gated relu^2), or why not."""
    if type(mlp).__name__ != "NemotronHMLP":
        return f"an MLP of type {type(mlp).__name__}"
    up, down = mlp._modules.get("up_proj"), mlp._modules.get("down_proj")
    hid = getattr(up, "out_features", 0)
    if not (hid > 0 and _parts.plan_projection(up, (hid, d), wdt) and _parts.plan_projection(down, (d, hid), wdt)):
        return f"an MLP whose projections are {_parts.NOT_PLAN_PROJECTIONS}"
    if type(mlp.act_fn).__name__ not in _RELU2:
        return "an MLP activation other than relu2"
    return up, down


def _moe(moe, d: int, wdt) -> Union[tuple, str]:
    """(shared expert's up, its down, MoEDescription, router) of transformers' `NemotronHMoE`, or why not."""
    m = moe._modules
    router, experts, shared = m.get("gate"), m.get("experts"), m.get("shared_experts")
    if type(m.get("fc1_latent_proj")) is not nn.Identity or type(m.get("fc2_latent_proj")) is not nn.Identity:
        return "an MoE block with latent projections (moe_latent_size)"
    if (type(router).__name__ != "NemotronHTopkRouter" or set(router._parameters) != {"weight"}
            or set(router._buffers) != {"e_score_correction_bias"} or type(experts).__name__ != "NemotronHExperts"
            or set(experts._parameters) != {"up_proj", "down_proj"}
            or type(getattr(experts, "act_fn", None)).__name__ not in _RELU2):
        return "an MoE block whose router or experts are not transformers' grouped sigmoid router and relu2 experts"
    got = _mlp(shared, d, wdt) if shared is not None else "no shared expert"
    if isinstance(got, str):
        return f"an MoE block's shared expert: {got}"
    desc = _parts.grouped_router_moe(router, experts.up_proj, experts.down_proj, d, wdt, gated=False)
    return desc if isinstance(desc, str) else (got[0], got[1], desc, router)


def _block(layer, base, d: int, wdt) -> Union[tuple, str]:
    """(BlockDescription, part: a Mamba2 mixer, None (attention), "ffn" (an MLP block) or ("moe", router)) of a
    Nemotron-H block, or why not."""
    norm = layer._modules.get("norm")
    if type(layer).__name__ != "NemotronHBlock" or type(norm).__name__ != "NemotronHRMSNorm" \
            or norm.weight.dtype != wdt:
        return "a block that is not transformers' NemotronHBlock with its NemotronHRMSNorm"
    n, mixer, kind = _parts.norm(norm.weight, norm.variance_epsilon), layer.mixer, layer.block_type
    if kind == "linear_attention":
        why = _mamba2.mixer_reason(mixer, d, wdt, "NemotronHMamba2Mixer", "NemotronHRMSNormGated", any_dt_limit=True)
        return why or (_dp.BlockDescription(mixer, "mamba2", n), mixer)
    if kind == "full_attention":
        att = _parts.softmax_attention(mixer, "NemotronHAttention", d, wdt)   # (no RoPE)
        return att if isinstance(att, str) else (_dp.BlockDescription(mixer, "softmax", n, attention=att), None)
    if kind == "mlp":
        ffn = _mlp(mixer, d, wdt)
        return ffn if isinstance(ffn, str) else (_dp.BlockDescription(mixer, "ffn_only", n, n, "relu2", *ffn), "ffn")
    if kind == "moe":
        if type(mixer).__name__ != "NemotronHMoE":
            return f"an MoE block of type {type(mixer).__name__}"
        ffn = _moe(mixer, d, wdt)
        if isinstance(ffn, str):
            return ffn
        return _dp.BlockDescription(mixer, "ffn_only", n, n, "moe", ffn[0], ffn[1], moe=ffn[2]), ("moe", ffn[3])
    return f"a block of type {kind}"


def describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer part: a Mamba2 mixer, None (attention), "ffn" (an MLP block) or ("moe",
    router)) or the reason the plan does not compute the model."""
    return _parts.describe_layers(model, MODELS, "model", "embeddings", _block, "norm_f", "NemotronHRMSNorm")


describe_model, undescribed_reason = _parts.public_description(describe, "a transformers Nemotron-H model")


def _ffn_only_plan(bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    """A block plan without a mixer (`ffn_only`): h = x, out = h + ffn(norm(h))."""
    keep = []
    addr = _dp.plan_addresser(keep, _dp.compute_dtype(wdt))
    p = _cpu_decode.BlockPlan(B=B, H=1, HV=1, K=1, V=1, d=d, hid=bd.ffn_down.in_features, kind=0,
                              nthreads=max(1, torch.get_num_threads()), has_ffn=1, wbf16=int(wdt == torch.bfloat16),
                              ffn_only=1)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


def block_plan(part, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    if part is None:
        return _dp.new_softmax_plan(bd, B, d, wdt)
    if part == "ffn":
        return _ffn_only_plan(bd, B, d, wdt)
    if type(part) is tuple:
        return _parts.set_router2(_ffn_only_plan(bd, B, d, wdt), part[1], wdt)
    return _mamba2.mixer_plan(part, bd, B, d, wdt)


def state_spec(part) -> tuple:
    if part is None:
        return ("softmax", 0, 0, 0, 0, ())
    if part == "ffn" or type(part) is tuple:
        return ("none", 0, 0, 0, 0, ())   # (no state: the cache's DummyLayer)
    return _mamba2.state_spec(part)


#: no left padding (the positions are not read: no RoPE)
call_usable = _parts.call_usable("ignored")
output_class = _parts.moe_output_class


# -- the rest of the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) -
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS
#: the logits in fp32, as transformers returns them
FP32_LOGITS = True
base = _parts.base_model
hookable = _parts.hookable(describe)
