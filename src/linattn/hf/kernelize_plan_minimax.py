"""A kernelized transformers MiniMax decoded through the compiled decode plan: one call per token for the model.

`MiniMaxForCausalLM`'s blocks (`MiniMaxDecoderLayer`) hold one of two mixers on the layer pattern `layer_types`,
each with a sparse MoE feed-forward, in MiniMax's own residual order (the plan's scaled residual, `res_scaled`):
the NORMED input is the residual, scaled,

    h = a1 n1(x) + b1 mixer(n1(x)),   out = a2 n2(h) + b2 moe(n2(h))

with (a1, b1) the layer type's `*_attn_alpha_factor` / `*_attn_beta_factor` and (a2, b2) `mlp_alpha_factor` /
`mlp_beta_factor`. The mixers:

* `MiniMaxLightningAttention`: the plan's lightning kind (8, csrc/decode_lightning.h) on the fused product
  `[qkv_proj | output_gate]` read in place: SiLU on q, k, v (per head `q | k | v` rows), the state `kv [H, K, V]`
  decayed by exp(-slope) per head (`slope_rate`, the layer's buffer, as transformers' cached step exponentiates
  it), no scale and no normaliser, one RMSNorm over all heads' outputs, times sigmoid(output_gate(n1(x))),
  `out_proj`; the cache's `linear_cache[i]` is the plan's state (a view of its buffer after every token);
* `MiniMaxAttention`: the softmax kind (full RoPE, fp32 angles, no q / k norm, no gate).

The feed-forward is `MiniMaxSparseMoeBlock`: softmax router in float, top-k as torch.topk picks it, the k
probabilities renormalised (`ffn_kind` 1, router mode 0), the experts' fused 3-D weights read in place, no shared
expert. transformers' `MiniMaxCache` is the cache: lightning states in its `linear_cache` list, softmax keys and
values in its layers, both written after every token (the handoff both ways: a cache filled or advanced by
transformers' own code is read as it is).

The token's position is transformers' own: `position_ids` when given, else `cache.get_seq_length()` (the FIRST
layer's length: 0 when layer 0 is a lightning layer, whose cache layer holds no keys; transformers then rotates
every decoded token as if at position 0, and the plan does the same). What the plan does not compute makes the
whole model step aside (`undescribed_reason` says why): projection biases, a sliding window, a RoPE type other
than the default, router jitter in training mode, `output_router_logits`, modules that are not exactly
transformers'. The hook's other conditions (grad, torch.compile, left padding, the cache) are hf/kernelize_plan.py's.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn

from ..cpu import decode as _cpu_decode
from ..models import decode_plan as _dp
from . import kernelize_plan_parts as _parts

__all__ = ["MODELS", "describe_model", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("MiniMaxForCausalLM",)


class _Lightning:
    """A transformers `MiniMaxLightningAttention` as the plan's lightning kind reads it: the fused product
    `W = [qkv_proj | output_gate]` (`kernelize_plan_parts.fused_linear`) and the block's residual factors."""

    __slots__ = ("layer", "W", "factors")

    def __init__(self, layer, factors):
        m = layer._modules
        self.layer, self.factors = layer, factors
        self.W = _parts.fused_linear(m["qkv_proj"], m["output_gate"])


class _Softmax:
    """A softmax block's residual factors (its plan is `decode_plan.new_softmax_plan`'s)."""

    __slots__ = ("factors",)

    def __init__(self, factors):
        self.factors = factors


def _silu(cfg) -> bool:
    return getattr(cfg, "hidden_act", None) in ("silu", "swish")


def _lightning_reason(layer, cfg, d: int, wdt) -> Optional[str]:
    """Why the plan's lightning kind does not compute this layer, or None."""
    if type(layer).__name__ != "MiniMaxLightningAttention":
        return f"a linear-attention layer of type {type(layer).__name__}"
    H, D, m = layer.num_attention_heads, layer.head_dim, layer._modules
    shapes = {"qkv_proj": (3 * H * D, d), "output_gate": (H * D, d), "out_proj": (d, H * D)}
    if not all(_parts.plan_projection(m.get(n), s, wdt) for n, s in shapes.items()):
        return f"lightning projections of the expected shapes that are {_parts.NOT_PLAN_PROJECTIONS}"
    why = _parts.fusion_reason(m["qkv_proj"], m["output_gate"])
    if why:
        return f"lightning qkv | gate: {why}"
    if not _silu(cfg) or type(layer.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        return "a lightning activation other than SiLU"
    if _parts.rms_norm(m.get("norm"), "MiniMaxRMSNorm", wdt, (H * D,)) is None:
        return "a lightning output norm that is not transformers' MiniMaxRMSNorm over all heads"
    if tuple(layer.slope_rate.shape) != (H, 1, 1):
        return "a slope rate of unexpected shape"
    return None


def _moe(mlp, cfg, d: int, wdt) -> Union[_dp.MoEDescription, str]:
    """`MiniMaxSparseMoeBlock` as the plan's MoE feed-forward (router mode 0, renormalised top-k, no shared
    expert), or why not."""
    if type(mlp).__name__ != "MiniMaxSparseMoeBlock":
        return f"a {type(mlp).__name__} feed-forward"
    router, experts = mlp._modules.get("gate"), mlp._modules.get("experts")
    if (type(router).__name__ != "MiniMaxTopKRouter" or type(experts).__name__ != "MiniMaxExperts"
            or set(router._parameters) != {"weight"} or set(experts._parameters) != {"gate_up_proj", "down_proj"}):
        return "an MoE block whose router or experts are not transformers' softmax top-k router and fused experts"
    if not _silu(cfg) or type(getattr(experts, "act_fn", None)).__name__ not in ("SiLU", "SiLUActivation"):
        return "an MoE activation other than SiLU"
    if mlp.training and mlp.jitter_noise > 0:
        return "router jitter noise (training mode)"
    return _parts.renormalised_topk_moe(router, experts, d, wdt)


def _block(layer, base, d: int, wdt) -> Union[tuple, str]:
    """(BlockDescription, `_Lightning` or `_Softmax`) of a MiniMax block, or why not."""
    if type(layer).__name__ != "MiniMaxDecoderLayer":
        return f"a block of type {type(layer).__name__}"
    cfg = base.config
    moe = _moe(layer._modules.get("mlp"), cfg, d, wdt)
    if isinstance(moe, str):
        return moe
    mixer = layer.self_attn
    factors = tuple(float(f) for f in (layer.attn_alpha_factor, layer.attn_beta_factor, layer.mlp_alpha_factor,
                                       layer.mlp_beta_factor))
    if layer.block_type == "linear_attention":
        why, att = _lightning_reason(mixer, cfg, d, wdt), None
        part = None if why else _Lightning(mixer, factors)
    elif layer.block_type == "full_attention":
        att = _parts.softmax_attention(mixer, "MiniMaxAttention", d, wdt, base.rotary_emb, "whole")
        why, part = (att, None) if isinstance(att, str) else (None, _Softmax(factors))
    else:
        return f"a block of type {layer.block_type}"
    if why is not None:
        return why
    norms = _parts.block_norms(layer, ("input_layernorm", "post_attention_layernorm"), "MiniMaxRMSNorm", wdt)
    if isinstance(norms, str):
        return norms
    bd = _dp.BlockDescription(mixer, "lightning" if att is None else "softmax", *norms, "moe", attention=att,
                              moe=moe)
    return bd, part


def describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer `_Lightning` or `_Softmax`) or the reason the plan does not compute the model."""
    return _parts.describe_layers(model, MODELS, "model", "embed_tokens", _block, "norm", "MiniMaxRMSNorm")


describe_model, undescribed_reason = _parts.public_description(describe, "a transformers MiniMax model")


def _lightning_plan(part: _Lightning, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    """The plan's lightning block (kind 8): y = [qkv (per head q | k | v) | gate], decay exp(-slope_rate) per head
    (computed in the buffer's dtype, as transformers' cached step), the norm over all heads."""
    layer, m = part.layer, part.layer._modules
    cdt, keep = _dp.compute_dtype(wdt), []
    addr = _dp.plan_addresser(keep, cdt)
    H, D = layer.num_attention_heads, layer.head_dim
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=H, K=D, V=D, d=d, ny=part.W.out_features, kind=8, scale=1.0,
                              nthreads=max(1, torch.get_num_threads()), wbf16=int(wdt == torch.bfloat16))
    _dp.set_weight(p, "W", part.W, wdt, addr)
    p.decay = addr(torch.exp(-layer.slope_rate.detach()).reshape(H))
    norm = m["norm"]
    p.has_norm, p.nw, p.norm_eps = 1, addr(norm.weight), float(norm.variance_epsilon)
    _dp.set_weight(p, "Wo", m["out_proj"], wdt, addr)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


def block_plan(part, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    if type(part) is _Lightning:
        p = _lightning_plan(part, bd, B, d, wdt)
    else:
        p = _dp.new_softmax_plan(bd, B, d, wdt)
    if p is not None:
        # (the norm before an MoE without a shared expert: `finish_block_plan` sets it with a dense FFN only)
        w = bd.norm2.weight.detach().to(_dp.compute_dtype(wdt)).contiguous()
        p.keep.append(w)
        p.n2w, p.n2eps = w.data_ptr(), float(bd.norm2.eps)
        p.res_scaled = 1
        p.res_a1, p.res_b1, p.res_a2, p.res_b2 = part.factors
    return p


def state_spec(part) -> tuple:
    if type(part) is _Softmax:
        return ("softmax", 0, 0, 0, 0, ())
    D = part.layer.head_dim
    return ("delta", part.layer.num_attention_heads, D, D, 0, ())


# -- MiniMax's cache (the `cache_type` / `get_state` / `set_state` of `_ARCHITECTURES`' protocol) ---------------
def cache_type():
    from transformers.models.minimax.modeling_minimax import MiniMaxCache
    return MiniMaxCache


def get_state(cache, i: int):
    """Lightning layer i's state `[B, H, K, V]` in the cache, or None (not filled yet)."""
    states = cache.linear_cache
    st = states[i] if i < len(states) else None
    return st if isinstance(st, torch.Tensor) else None


def set_state(cache, i: int, state: torch.Tensor) -> None:
    cache.set_linear_cache(i, state)


def position(cache, L: Optional[int], position_ids) -> Optional[int]:
    """The position transformers rotates the token at: its `position_ids` (one value for every row), else the
    cache's `get_seq_length()`, as `MiniMaxModel.forward` takes it; None when the rows' positions differ."""
    if position_ids is None:
        return cache.get_seq_length()
    if not isinstance(position_ids, torch.Tensor) or position_ids.numel() == 0:
        return None
    pos = position_ids.reshape(-1)[0]
    return int(pos) if bool((position_ids == pos).all()) else None


#: the mask, if given, keeps the L keys the softmax layers hold and the new token (a model without softmax layers:
#: transformers' cache reports no length to build a mask with), the rows at one position
call_usable = _parts.call_usable(position, attention_free=None)
output_class = _parts.moe_output_class


# -- the rest of the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) -
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS
FP32_LOGITS = False
base = _parts.base_model
hookable = _parts.hookable(describe)
