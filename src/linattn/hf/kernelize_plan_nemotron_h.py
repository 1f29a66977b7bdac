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

import operator
from typing import Optional, Union

import torch
import torch.nn as nn

from ..cpu import decode as _cpu_decode
from ..models import decode_plan as _dp
from . import kernelize_plan_mamba2 as _mamba2, kernelize_plan_parts as _parts

__all__ = ["MODELS", "describe_model", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("NemotronHForCausalLM",)

_RELU2 = ("ReLUSquaredActivation",)


def _attention(att, d: int, wdt) -> Union[_dp.AttentionDescription, str]:
    """transformers' `NemotronHAttention` (no position encoding) as the softmax kind computes it, or why not."""
    if type(att).__name__ != "NemotronHAttention":
        return f"an attention layer of type {type(att).__name__}"
    cfg, m = att.config, att._modules
    H, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, att.head_dim
    why = _parts.gqa_projections_reason(m, H, G, D, d, wdt)
    if why:
        return why
    if getattr(cfg, "sliding_window", None) is not None:
        return "a sliding window"
    return _dp.AttentionDescription(
        q_proj=m["q_proj"], k_proj=m["k_proj"], v_proj=m["v_proj"], o_proj=m["o_proj"], heads=H, kv_heads=G,
        head_dim=D, head_dim_v=D, scale=float(att.scaling), window=None, q_norm=None, k_norm=None, norm_offset=0,
        rot=0, inv_freq=None, rope_f32=True, rope_scale=1.0, gate=None, g_proj=None, gate_act="silu",
        kv_chunk=_parts.KV_CHUNK)


def _mlp(mlp, d: int, wdt) -> Union[tuple, str]:
    """(up, down) of transformers' `NemotronHMLP` (non-gated relu^2), or why not."""
    if type(mlp).__name__ != "NemotronHMLP":
        return f"an MLP of type {type(mlp).__name__}"
    up, down = mlp._modules.get("up_proj"), mlp._modules.get("down_proj")
    hid = getattr(up, "out_features", 0)
    if not (hid > 0 and _parts.plain_linear(up, (hid, d), wdt) and _parts.plain_linear(down, (d, hid), wdt)):
        return "an MLP whose projections are not bias-free nn.Linear layers of the model's dtype"
    if type(mlp.act_fn).__name__ not in _RELU2:
        return "an MLP activation other than relu2"
    return up, down


def _moe(moe, d: int, wdt) -> Union[tuple, str]:
    """(shared expert's up, its down, MoEDescription, router) of transformers' `NemotronHMoE`, or why not."""
    m = moe._modules
    router, experts, shared = m.get("gate"), m.get("experts"), m.get("shared_experts")
    if type(m.get("fc1_latent_proj")) is not nn.Identity or type(m.get("fc2_latent_proj")) is not nn.Identity:
        return "a MoE block with latent projections (moe_latent_size)"
    if (type(router).__name__ != "NemotronHTopkRouter" or set(router._parameters) != {"weight"}
            or set(router._buffers) != {"e_score_correction_bias"} or type(experts).__name__ != "NemotronHExperts"
            or set(experts._parameters) != {"up_proj", "down_proj"}
            or type(getattr(experts, "act_fn", None)).__name__ not in _RELU2):
        return "a MoE block whose router or experts are not transformers' grouped sigmoid router and relu2 experts"
    E, G, kg, k = router.num_experts, router.num_group, router.topk_group, router.top_k
    if not (G >= 1 and E % G == 0 and E // G >= 2 and 1 <= kg <= G and 1 <= k <= kg * (E // G)):
        return "a MoE router whose groups the plan does not choose among (E / groups < 2, k too large)"
    w, bias = router.weight, router.e_score_correction_bias
    if (tuple(w.shape) != (E, d) or w.dtype not in (wdt, torch.float32) or not w.is_contiguous()
            or tuple(bias.shape) != (E,) or not bias.dtype.is_floating_point):
        return "a MoE router whose weight or correction bias the plan does not read (shapes, dtype)"
    got = _mlp(shared, d, wdt) if shared is not None else "no shared expert"
    if isinstance(got, str):
        return f"a MoE block's shared expert: {got}"
    # (the router's weight as `MoEDescription` checks it: the plan reads the router itself, `set_router2`)
    desc = _dp.MoEDescription(w.detach().to(wdt) if w.dtype != wdt else w.detach(), experts.up_proj.detach(),
                              experts.down_proj.detach(), k, router.norm_topk_prob, gated=False)
    if not _dp.moe_usable(desc, d, wdt):
        return "a MoE block whose experts the plan does not read (shapes, dtype, layout)"
    return got[0], got[1], desc, router


def _describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer part: a Mamba2 mixer, None (attention), "ffn" (an MLP block) or ("moe",
    router)) or the reason the plan does not compute the model."""
    got = _parts.base_and_embedding(model, MODELS, "model", "embeddings")
    if isinstance(got, str):
        return got
    base, embed, wdt = got
    if getattr(model.config, "output_router_logits", False):
        return "output_router_logits set (the plan returns no router logits)"
    d = embed.weight.shape[1]
    blocks, parts = [], []
    for i, layer in enumerate(base.layers):
        norm = layer._modules.get("norm")
        if type(layer).__name__ != "NemotronHBlock" or type(norm).__name__ != "NemotronHRMSNorm" \
                or norm.weight.dtype != wdt:
            return f"layer {i}: a block that is not transformers' NemotronHBlock with its NemotronHRMSNorm"
        n, mixer, kind = _parts.norm(norm.weight, norm.variance_epsilon), layer.mixer, layer.block_type
        if kind == "linear_attention":
            why = _mamba2.mixer_reason(mixer, d, wdt, "NemotronHMamba2Mixer", "NemotronHRMSNormGated",
                                       any_dt_limit=True)
            bd, part = _dp.BlockDescription(mixer, "mamba2", n), mixer
        elif kind == "full_attention":
            att = _attention(mixer, d, wdt)
            why = att if isinstance(att, str) else None
            bd, part = _dp.BlockDescription(mixer, "softmax", n, attention=att), None
        elif kind == "mlp":
            ffn = _mlp(mixer, d, wdt)
            why = ffn if isinstance(ffn, str) else None
            bd = None if why else _dp.BlockDescription(mixer, "ffn_only", n, n, "relu2", ffn[0], ffn[1])
            part = "ffn"
        elif kind == "moe":
            if type(mixer).__name__ != "NemotronHMoE":
                return f"layer {i}: a MoE block of type {type(mixer).__name__}"
            ffn = _moe(mixer, d, wdt)
            why = ffn if isinstance(ffn, str) else None
            bd = None if why else _dp.BlockDescription(mixer, "ffn_only", n, n, "moe", ffn[0], ffn[1], moe=ffn[2])
            part = None if why else ("moe", ffn[3])
        else:
            return f"layer {i}: a block of type {kind}"
        if why is not None:
            return f"layer {i}: {why}"
        blocks.append(bd)
        parts.append(part)
    desc = _parts.model_description(model, embed, blocks, base.norm_f, "NemotronHRMSNorm", wdt)
    if isinstance(desc, str):
        return desc
    return desc, parts


def describe_model(model: nn.Module):
    """(ModelDescription, per-layer part) of a transformers Nemotron-H model, or None where the plan does not
    compute some part of it (`undescribed_reason` says which)."""
    return _parts.description(_describe(model))


def undescribed_reason(model: nn.Module) -> Optional[str]:
    """Why a Nemotron-H model does not decode through the compiled plan, or None when it does."""
    return _parts.reason(_describe(model))


def _ffn_only_plan(bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    """A block plan without a mixer (`ffn_only`): h = x, out = h + ffn(norm(h))."""
    keep = []
    addr = _dp.plan_addresser(keep, _dp.compute_dtype(wdt))
    p = _cpu_decode.BlockPlan(B=B, H=1, HV=1, K=1, V=1, d=d, hid=bd.ffn_down.in_features, kind=0,
                              nthreads=max(1, torch.get_num_threads()), has_ffn=1, wbf16=int(wdt == torch.bfloat16),
                              ffn_only=1)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


def _block_plan(part, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
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


def call_usable(cache, B: int, L, attention_mask, position_ids) -> bool:
    """No left padding (the positions are not read: no RoPE)."""
    if L is None:
        return _parts.unpadded(attention_mask, B)
    return _parts.cached_call_usable(cache, B, L, attention_mask, None)


output_class = _parts.moe_output_class


# -- the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) ----------
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS
#: the logits in fp32, as transformers returns them
FP32_LOGITS = True
describe, block_plan = _describe, _block_plan
base = operator.attrgetter("model")
hookable = _parts.hookable(_describe)
