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

from typing import Union

import torch
import torch.nn as nn

from ..models import decode_plan as _dp
from . import kernelize_plan_mamba2 as _mamba2, kernelize_plan_parts as _parts

__all__ = ["MODELS", "describe_model", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("BambaForCausalLM",)


def _block(layer, base, d: int, wdt) -> Union[tuple, str]:
    """(BlockDescription, Mamba2 mixer or None) of a Bamba block, or why not."""
    if type(layer).__name__ != "BambaDecoderLayer":
        return f"a block of type {type(layer).__name__}"
    ffn = _parts.swiglu_ffn(layer._modules.get("feed_forward"), "BambaMLP", d, wdt)
    if isinstance(ffn, str):
        return ffn
    if layer.block_type == "linear_attention":
        mixer, att = layer.mamba, None
        why = _mamba2.mixer_reason(mixer, d, wdt, "BambaMixer", "BambaRMSNormGated")
    elif layer.block_type == "full_attention":
        mixer = layer.self_attn
        att = _parts.softmax_attention(mixer, "BambaAttention", d, wdt, base.rotary_emb, "part")
        why = att if isinstance(att, str) else None
    else:
        return f"a block of type {layer.block_type}"
    if why is not None:
        return why
    norms = _parts.block_norms(layer, ("input_layernorm", "pre_ff_layernorm"), "BambaRMSNorm", wdt)
    if isinstance(norms, str):
        return norms
    bd = _dp.BlockDescription(mixer, "softmax" if att is not None else "mamba2", *norms, "swiglu", ffn[0], ffn[1],
                              attention=att)
    return bd, None if att is not None else mixer


def describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer mixer or None) or the reason the plan does not compute the model."""
    return _parts.describe_layers(model, MODELS, "model", "embed_tokens", _block, "final_layernorm", "BambaRMSNorm")


describe_model, undescribed_reason = _parts.public_description(describe, "a transformers Bamba model")


def block_plan(mx, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    if mx is None:
        return _dp.new_softmax_plan(bd, B, d, wdt)
    return _mamba2.mixer_plan(mx, bd, B, d, wdt)


def state_spec(mx) -> tuple:
    return ("softmax", 0, 0, 0, 0, ()) if mx is None else _mamba2.state_spec(mx)


#: Bamba's forward takes a missing `position_ids` as 0, 1, ... whatever the cache holds (`generate` passes them)
call_usable = _parts.call_usable("required", "cache")
output_class = _parts.causal_lm_output_class


# -- the rest of the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) -
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS
FP32_LOGITS = False
base = _parts.base_model
hookable = _parts.hookable(describe)
