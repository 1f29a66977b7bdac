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

import operator
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
    `W = [qkv_proj | output_gate]` (read in place) and the block's residual factors."""

    __slots__ = ("layer", "W", "factors")

    def __init__(self, layer, factors):
        m = layer._modules
        self.layer, self.factors = layer, factors
        self.W = _parts.fused_linear(m["qkv_proj"].weight, m["output_gate"].weight)


class _Softmax:
    """A softmax block's residual factors (its plan is `decode_plan.new_softmax_plan`'s)."""

    __slots__ = ("factors",)

    def __init__(self, factors):
        self.factors = factors


def _norm(module, wdt, shape=None) -> Optional[object]:
    if (type(module).__name__ != "MiniMaxRMSNorm" or module.weight.dtype != wdt
            or (shape is not None and tuple(module.weight.shape) != shape)):
        return None
    return _parts.norm(module.weight, module.variance_epsilon)


def _silu(cfg) -> bool:
    return getattr(cfg, "hidden_act", None) in ("silu", "swish")


def _lightning_reason(layer, cfg, d: int, wdt) -> Optional[str]:
    """Why the plan's lightning kind does not compute this layer, or None."""
    if type(layer).__name__ != "MiniMaxLightningAttention":
        return f"a linear-attention layer of type {type(layer).__name__}"
    H, D, m = layer.num_attention_heads, layer.head_dim, layer._modules
    shapes = {"qkv_proj": (3 * H * D, d), "output_gate": (H * D, d), "out_proj": (d, H * D)}
    if not all(_parts.plain_linear(m.get(n), s, wdt) for n, s in shapes.items()):
        return "lightning projections that are not bias-free nn.Linear layers of the model's dtype and shapes"
    if not _silu(cfg) or type(layer.act_fn).__name__ not in ("SiLU", "SiLUActivation"):
        return "a lightning activation other than SiLU"
    if _norm(m.get("norm"), wdt, (H * D,)) is None:
        return "a lightning output norm that is not transformers' MiniMaxRMSNorm over all heads"
    if tuple(layer.slope_rate.shape) != (H, 1, 1):
        return "a slope rate of unexpected shape"
    return None


def _attention(att, rotary, cfg, d: int, wdt) -> Union[_dp.AttentionDescription, str]:
    """transformers' `MiniMaxAttention` as the softmax kind computes it, or why not."""
    if type(att).__name__ != "MiniMaxAttention":
        return f"an attention layer of type {type(att).__name__}"
    m = att._modules
    H, G, D = cfg.num_attention_heads, cfg.num_key_value_heads, att.head_dim
    why = _parts.gqa_projections_reason(m, H, G, D, d, wdt)
    if why:
        return why
    if getattr(cfg, "sliding_window", None) is not None:
        return "a sliding window"
    if type(rotary).__name__ != "MiniMaxRotaryEmbedding" or getattr(rotary, "rope_type", None) != "default":
        return "a rotary embedding other than the default RoPE"
    inv = rotary.inv_freq.detach().to(torch.float64)
    if 2 * inv.numel() != D:
        return "a rotary embedding over part of a head"
    return _dp.AttentionDescription(
        q_proj=m["q_proj"], k_proj=m["k_proj"], v_proj=m["v_proj"], o_proj=m["o_proj"], heads=H, kv_heads=G,
        head_dim=D, head_dim_v=D, scale=float(att.scaling), window=None, q_norm=None, k_norm=None, norm_offset=0,
        rot=D, inv_freq=inv, rope_f32=True, rope_scale=float(rotary.attention_scaling), gate=None, g_proj=None,
        gate_act="silu", kv_chunk=_parts.KV_CHUNK)


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
    moe = _dp.MoEDescription(router.weight.detach(), experts.gate_up_proj.detach(), experts.down_proj.detach(),
                             router.top_k, True)
    if not _dp.moe_usable(moe, d, wdt):
        return "an MoE block whose router or experts the plan does not read (shapes, dtype, layout)"
    return moe


def _describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer `_Lightning` or `_Softmax`) or the reason the plan does not compute the model."""
    got = _parts.base_and_embedding(model, MODELS, "model", "embed_tokens")
    if isinstance(got, str):
        return got
    base, embed, wdt = got
    cfg = model.config
    if getattr(cfg, "output_router_logits", False):
        return "output_router_logits set (the plan returns no router logits)"
    d = embed.weight.shape[1]
    blocks, parts = [], []
    for i, layer in enumerate(base.layers):
        if type(layer).__name__ != "MiniMaxDecoderLayer":
            return f"layer {i}: a block of type {type(layer).__name__}"
        moe = _moe(layer._modules.get("mlp"), cfg, d, wdt)
        if isinstance(moe, str):
            return f"layer {i}: {moe}"
        mixer = layer.self_attn
        factors = tuple(float(f) for f in (layer.attn_alpha_factor, layer.attn_beta_factor, layer.mlp_alpha_factor,
                                           layer.mlp_beta_factor))
        if layer.block_type == "linear_attention":
            why, att = _lightning_reason(mixer, cfg, d, wdt), None
            part = None if why else _Lightning(mixer, factors)
        elif layer.block_type == "full_attention":
            att = _attention(mixer, base.rotary_emb, cfg, d, wdt)
            why, part = (att, None) if isinstance(att, str) else (None, _Softmax(factors))
        else:
            return f"layer {i}: a block of type {layer.block_type}"
        if why is not None:
            return f"layer {i}: {why}"
        n1, n2 = (_norm(layer._modules.get(n), wdt) for n in ("input_layernorm", "post_attention_layernorm"))
        if n1 is None or n2 is None:
            return f"layer {i}: block norms that are not transformers' MiniMaxRMSNorm"
        blocks.append(_dp.BlockDescription(mixer, "lightning" if att is None else "softmax", n1, n2, "moe",
                                           attention=att, moe=moe))
        parts.append(part)
    desc = _parts.model_description(model, embed, blocks, base.norm, "MiniMaxRMSNorm", wdt)
    if isinstance(desc, str):
        return desc
    return desc, parts


def describe_model(model: nn.Module):
    """(ModelDescription, per-layer part) of a transformers MiniMax model, or None where the plan does not compute
    some part of it (`undescribed_reason` says which)."""
    return _parts.description(_describe(model))


def undescribed_reason(model: nn.Module) -> Optional[str]:
    """Why a MiniMax model does not decode through the compiled plan, or None when it does."""
    return _parts.reason(_describe(model))


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
    p.Wo = addr(m["out_proj"].weight, wdt)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


def _block_plan(part, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
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


def _call_usable(cache, B: int, L, attention_mask, position_ids) -> bool:
    # (the keys the softmax layers hold: L, when the model has any; the mask must keep every one and the new token)
    if L is None:
        return False   # (no softmax layer: transformers' cache reports no length to build a mask with)
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor)
                                           and attention_mask.shape == (B, L + 1) and bool(attention_mask.all())):
        return False   # (left padding: transformers' masked path)
    return position(cache, L, position_ids) is not None


output_class = _parts.moe_output_class


# -- the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) ----------
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS
FP32_LOGITS = False
describe, block_plan, call_usable = _describe, _block_plan, _call_usable
base = operator.attrgetter("model")
hookable = _parts.hookable(_describe)
