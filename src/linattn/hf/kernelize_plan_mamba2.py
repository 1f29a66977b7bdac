"""A kernelized transformers Mamba2 decoded through the compiled decode plan: one call per token for the model.

`Mamba2ForCausalLM`'s blocks (`norm` -> `Mixer` -> residual, no feed-forward) map onto the plan's Mamba2 block
(kind 5, `cpu/csrc/decode_mamba2.h`) as they are: `in_proj` is the plan's `[z | xBC | dt]` product (read in place,
its bias too), `conv1d` the short convolution over xBC (SiLU, its bias), `-exp(A_log)` / `dt_bias` / `D` per head,
groups of B / C shared by H / G heads, the gated norm `RMSNorm_groups(y * silu(z))` (transformers'
`MambaRMSNormGated`), `out_proj`. The final norm `norm_f`, the head (tied or not); the logits are returned in fp32,
as transformers' forward returns them.

What the plan does not compute makes the whole model step aside (every cached token then runs transformers'
forward, as kernelize serves it; `undescribed_reason` says why): an `in_proj` with extra MLP rows (`d_mlp` > 0), a
`time_step_limit` other than (0, inf) (transformers clamps dt in its chunked prefill but not in its one-token step;
the plan would clamp both), an activation other than SiLU, modules that are not exactly transformers'.

transformers' cache stays valid after every token: the plan's block keeps each head's state as transformers does,
`[P, N]` (its `state_pn` layout: no z column, the arithmetic of linattn's `[N, P + 1]` layout in the same order),
so the cache's state tensors are the plan's state, read in place, and after the step the layer holds a view of the
new state (hf/kernelize_plan.py, as for Gated DeltaNet); the conv state (the last K inputs; the plan keeps K - 1) is
shifted and copied. Positions (`position_ids`) are accepted and ignored, as Mamba2's forward ignores them. The hook
steps aside for: grad enabled, torch.compile tracing, more than one token, `inputs_embeds`, labels, an attention
mask with a zero (left padding), a cache that is not a `DynamicCache` of these layers or that records its past, a
hook on a described module, non-CPU tensors or dtypes without a plan, `LINATTN_CPU_KERNELS=0`.
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Union

import torch
import torch.nn as nn

from ..cpu import decode as _cpu_decode
from ..models import decode_plan as _dp
from . import kernelize_plan_parts as _parts

__all__ = ["MODELS", "describe_model", "undescribed_reason"]

#: the transformers classes this module describes
MODELS = ("Mamba2ForCausalLM",)


def _linear(m, shape, wdt) -> bool:
    """m is a linear layer the plan reads (`decode_plan.plan_linear`: an nn.Linear of dtype wdt, int8 / int4) of
    weight shape `shape`, with or without a bias (a float one's in wdt)."""
    return (isinstance(m, nn.Module) and _dp.plan_linear(m, wdt) and (m.out_features, m.in_features) == shape
            and (m.bias is None or m.bias.dtype == wdt or type(m) is not nn.Linear))


def mixer_reason(mx, d: int, wdt, mixer_class: str = "Mamba2Mixer", norm_class: str = "MambaRMSNormGated",
                 any_dt_limit: bool = False) -> Optional[str]:
    """Why the plan's Mamba2 block does not compute this mixer (transformers' `mixer_class`, its gated norm of class
    `norm_class`: Mamba2's, or a hybrid's with the same attributes), or None. `any_dt_limit`: a model whose every
    Mamba2 mixer has a `time_step_limit` (Nemotron-H's (time_step_min, inf)): its one-token step, the one the plan
    computes, does not clamp dt either."""
    if type(mx).__name__ != mixer_class:
        return f"a mixer of type {type(mx).__name__}"
    H, P, G, N, KC = mx.num_heads, mx.head_dim, mx.n_groups, mx.ssm_state_size, mx.conv_kernel_size
    DI, CD = mx.intermediate_size, mx.conv_dim
    m = mx._modules
    if DI != H * P or H % G or CD != DI + 2 * G * N:
        return "heads, groups or widths the plan does not lay out (intermediate != heads x head_dim)"
    if not (_linear(m.get("in_proj"), (DI + CD + H, d), wdt) and _linear(m.get("out_proj"), (d, DI), wdt)):
        return ("an in_proj with extra rows (d_mlp > 0) or projections that are not linear layers the plan reads "
                "(nn.Linear of the model's dtype, int8, int4)")
    conv, norm = m.get("conv1d"), m.get("norm")
    if (type(conv) is not nn.Conv1d or conv.weight.shape != (CD, 1, KC) or conv.groups != CD
            or conv.weight.dtype != wdt or mx.activation not in ("silu", "swish")):
        return "a short convolution that is not a depthwise SiLU nn.Conv1d"
    if type(norm).__name__ != norm_class or norm.weight.shape != (DI,) or norm.group_size != DI // G:
        return f"an output norm that is not transformers' {norm_class} over the groups"
    if not any_dt_limit and tuple(float(x) for x in mx.time_step_limit) != (0.0, math.inf):
        return "a time_step_limit other than (0, inf) (transformers' one-token step does not clamp dt)"
    if mx.A_log.shape != (H,) or mx.dt_bias.shape != (H,) or mx.D.shape != (H,):
        return "A_log / dt_bias / D of unexpected shapes"
    return None


def _block(block, base, d: int, wdt) -> Union[tuple, str]:
    """(BlockDescription, mixer) of a Mamba2 block, or why not."""
    mx, norm = block._modules.get("mixer"), block._modules.get("norm")
    why = mixer_reason(mx, d, wdt)
    if why is None and (type(block).__name__ != "Mamba2Block" or type(norm).__name__ != "Mamba2RMSNorm"
                        or norm.weight.dtype != wdt):
        why = "a block that is not transformers' Mamba2Block with its Mamba2RMSNorm"
    if why is not None:
        return why
    return _dp.BlockDescription(mx, "mamba2", _parts.norm(norm.weight, norm.variance_epsilon)), mx


def describe(model: nn.Module) -> Union[tuple, str]:
    """(ModelDescription, per-layer mixer) or the reason the plan does not compute the model."""
    return _parts.describe_layers(model, MODELS, "backbone", "embeddings", _block, "norm_f", "Mamba2RMSNorm")


describe_model, undescribed_reason = _parts.public_description(describe, "a transformers Mamba2 model")


def mixer_plan(mx, bd: _dp.BlockDescription, B: int, d: int, wdt: torch.dtype):
    """The plan's Mamba2 block (kind 5) for a transformers Mamba2 mixer (`mixer_reason` None), with the block's
    feed-forward when `bd` describes one (the Mamba2 hybrids')."""
    cdt, keep, m = _dp.compute_dtype(wdt), [], mx._modules
    addr = _dp.plan_addresser(keep, cdt)
    H, P, G, N, CD = mx.num_heads, mx.head_dim, mx.n_groups, mx.ssm_state_size, mx.conv_dim
    p = _cpu_decode.BlockPlan(B=B, H=H, HV=H, K=N, V=P, d=d, ny=H * P + CD + H, KC=mx.conv_kernel_size,
                              hid=0 if bd.ffn_down is None else bd.ffn_down.in_features, kind=5, conv_act=1,
                              nthreads=max(1, torch.get_num_threads()), has_ffn=int(bd.ffn_down is not None),
                              wbf16=int(wdt == torch.bfloat16), n_groups=G, d_per_channel=0, dt_lo=0.0,
                              dt_hi=math.inf, norm_mode=1, state_pn=1)
    inp, out, conv, norm = m["in_proj"], m["out_proj"], m["conv1d"], m["norm"]
    _dp.set_weight(p, "W", inp, wdt, addr)
    p.Wb = addr(inp.bias)
    p.cw, p.cb = addr(conv.weight.detach().view(CD, -1)), addr(conv.bias)
    p.neg_a = addr(-torch.exp(mx.A_log.detach().to(cdt)))
    p.dt_bias, p.Dsk = addr(mx.dt_bias), addr(mx.D)
    p.nw, p.norm_eps = addr(norm.weight), float(norm.variance_epsilon)
    _dp.set_weight(p, "Wo", out, wdt, addr)
    p.bo = addr(out.bias)
    return _dp.finish_block_plan(p, bd, addr, keep, wdt)


#: no left padding (the positions are not read, as Mamba2's forward ignores them)
call_usable = _parts.call_usable("ignored")


def output_class():
    from transformers.models.mamba2.modeling_mamba2 import Mamba2CausalLMOutput
    return Mamba2CausalLMOutput


# -- the rest of the architecture description hf/kernelize_plan.py decodes through (its `_ARCHITECTURES` protocol) -
FAST_KWARGS = _parts.CAUSAL_LM_KWARGS - {"output_attentions"}   # (Mamba2's forward takes no output_attentions)
#: the logits in fp32, as transformers returns them
FP32_LOGITS = True
block_plan = mixer_plan
base = operator.attrgetter("backbone")
hookable = _parts.hookable(describe)


def state_spec(mx) -> tuple:
    # ("ssm": a state [B, H, P, N] as the block's state_pn layout keeps it, no extra column)
    return ("ssm", mx.num_heads, mx.head_dim, mx.ssm_state_size, mx.conv_kernel_size, (mx.conv_dim,), ("conv",))
